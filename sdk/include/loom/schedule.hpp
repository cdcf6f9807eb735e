#pragma once
// Pipeline schedules as data: for each rank of a model replica, the list of what it does in one
// optimizer step (forward or backward of micro-batch m on stage s, and the sends and receives that
// move activations and their gradients between stages). A placement plugin makes the schedule;
// the host runs it with one runtime, whatever the schedule.
#include <string>
#include <vector>

#include "loom/export.hpp"

namespace loom {

enum class StageOp {
  kForward,         // run stage s on micro-batch m
  kBackward,        // backward of stage s for micro-batch m
  kRecvActivation,  // post the receive of stage s's input for m (from the rank of stage s - 1)
  kSendActivation,  // send stage s's output for m (to the rank of stage s + 1)
  kRecvGradient,    // post the receive of the gradient of stage s's output for m (from stage s + 1)
  kSendGradient,    // send the gradient of stage s's input for m (to the rank of stage s - 1)
};
LOOM_API const char* stage_op_name(StageOp op);

struct StageAction {
  StageOp op = StageOp::kForward;
  int stage = 0;
  int micro_batch = 0;
  bool operator==(const StageAction& o) const { return op == o.op && stage == o.stage && micro_batch == o.micro_batch; }
};

struct PipelineSchedule {
  std::string name;  // "gpipe", "1f1b", "interleaved-1f1b"; empty: no pipeline, blocks run in order
  int stages = 0;
  int micro_batches = 0;
  std::vector<int> stage_rank;                   // the replica rank of each stage
  std::vector<std::vector<StageAction>> actions;  // per replica rank, in order
  bool empty() const { return stages == 0; }
};

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

}  // namespace loom
