#pragma once
#include <filesystem>
#include <functional>
#include <memory>

#include "runtime/executor.hpp"
#include "loom/communicator.hpp"
#include "config/session.hpp"

namespace loom::core {

struct TrainReport {
  std::int64_t steps = 0;
  double final_loss = 0;              // the mean training loss of the last metrics row
  std::int64_t final_loss_steps = 0;  // the steps that row covers
  std::optional<double> eval_loss;
  std::optional<double> exact_match;  // fraction of eval samples answered exactly
  std::int64_t exact_match_samples = 0;
  std::size_t skipped_samples = 0;  // by the collator (no template, too long)
  std::size_t skipped_lines = 0;    // bad data lines under on_bad_line = "skip"
  std::filesystem::path adapter_dir;  // empty for a full fine-tune
  std::filesystem::path merged_dir;
  int stopped_by = 0;  // the signal (SIGTERM, SIGINT) that stopped the run at a checkpoint, or 0
  std::string eval_failure;  // why the final evaluation failed (the outputs are written), or empty
  std::string stopped_early;  // why early stopping ended the run, or empty
  std::filesystem::path best_checkpoint;  // the checkpoint whose weights are the outputs ([train] best_metric), or empty
};


// Where this process trains: its replica's plan and its rank in it, and its groups.
struct RankContext {
  const Plan* plan = nullptr;  // this rank's data replica
  int pipeline_rank = 0;  // which of the plan's ranks this process is (BlockPlacement::rank)
  Parallel* parallel = nullptr;
  // The most of evaluation's generation rows whose cache fits this rank's devices, given rows and
  // positions (null: no check).
  std::function<std::int64_t(std::int64_t rows, std::int64_t capacity)> generation_rows;
};

// Trains the session's model as the pipeline says, writing metrics.jsonl, checkpoints and the
// adapter into `out_dir` (rank 0 writes what is shared; each rank its own random state); with
// `resume`, continues from the newest checkpoint there. With several data ranks each draws its
// share of every micro-batch and the gradients are summed over them, so the run equals one process
// with the global batch. `first_step_done` is called once the first step has been taken. SIGTERM
// or SIGINT (Slurm's preemption, Ctrl-C) stops every rank at the same step boundary with a
// checkpoint (report.stopped_by); a second one exits at once.
TrainReport train(Session& session, const RankContext& where, const std::filesystem::path& out_dir, bool resume,
                  const std::function<void()>& first_step_done = {});

}  // namespace loom::core
