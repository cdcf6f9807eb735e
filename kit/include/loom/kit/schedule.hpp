#pragma once
// The pipeline schedules loom knows, and the checks and pictures of any schedule (the data is the
// contract's, loom/schedule.hpp).
#include <string>
#include <vector>

#include "loom/export.hpp"
#include "loom/schedule.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// The schedules loom knows, for `ranks` ranks each running `stages_per_rank` stages (stage s on
// rank s % ranks) over `micro_batches` micro-batches: "gpipe" (every forward, then every
// backward), "1f1b" (stage s runs at most ranks - s forwards ahead of its backwards) and
// "interleaved-1f1b" (Megatron's: several stages per rank, micro-batches in groups of `ranks`).
// Receives are posted as soon as the sender has sent, so transfers overlap compute; between two
// ranks, sends and receives come in the same order on both sides. Throws UserError for a
// combination the schedule does not allow, naming what to change.
LOOM_API PipelineSchedule make_schedule(const std::string& kind, int ranks, int stages_per_rank, int micro_batches);

// Empty when every forward and backward of every (stage, micro-batch) appears once on its stage's
// rank, every transfer between ranks has its matching send and receive, and running the lists
// cannot deadlock; otherwise what is wrong.
LOOM_API std::string check_schedule(const PipelineSchedule& schedule);

// The most micro-batches whose activations each stage holds at once (forward done, backward not).
LOOM_API std::vector<int> in_flight_per_stage(const PipelineSchedule& schedule);

// One line per rank, each action in a fixed-width cell ("F3.1" forward of stage 3, micro-batch 1;
// "B" backward; "." idle while waiting for a peer), in time slots of one compute action.
LOOM_API std::string schedule_timeline(const PipelineSchedule& schedule);

}  // namespace loom::kit
