#pragma once
// A run's checkpoints: written by every rank into one folder, named only once complete, and read
// back by --resume after every number in them is checked against the run.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "loom/communicator.hpp"
#include "loom/mesh.hpp"
#include "runtime/optimizer.hpp"

namespace loom::core {

// What a checkpoint's trainer.json records, read as --resume reads it.
struct CheckpointState {
  std::string name;  // step-NNNNNNNN
  std::int64_t step = 0, optimizer_steps = 0, good_steps = 0;
  std::uint64_t epoch = 0;
  std::size_t index = 0, skipped_samples = 0;
  double loss_scale = 1, last_loss = 0;
  std::int64_t total_steps = 0;  // of the run that wrote it
  Mesh mesh;                     // of the run that wrote it
  int expert = 1;                // its [parallel] expert
  // [train] best_metric: the evaluation at this step, the best checkpoint so far and early
  // stopping's count (what a resumed run goes on comparing with).
  std::optional<double> eval_loss, exact_match;
  std::string best;  // the best checkpoint's name ("" before one)
  std::optional<double> best_value, best_eval;  // the best checkpoint's metric; the best of every evaluation
  std::int64_t evals_without_improvement = 0;
};
// What the resuming run can have reached.
struct RunShape {
  std::int64_t total_steps = 0;
  std::int64_t samples_per_step = 1;  // batch size x gradient accumulation
  std::size_t samples = 0;            // in an epoch
};
// Reads checkpoints/latest and the state of the checkpoint it names, checked against the run
// before anything is used: the name is one a run writes (so it stays inside the run folder), and
// every number is within what the run can have reached. Throws UserError naming file and key.
CheckpointState read_checkpoint_state(const std::filesystem::path& checkpoints, const RunShape& run);

// Writes and restores this rank's part of the run's checkpoints in `checkpoints` (a run folder's
// checkpoints/). Every rank of `parallel` calls save() and restore() at the same step.
class Checkpointer {
 public:
  // `cuda_devices`: this rank's GPUs, whose random state a checkpoint keeps; `comm_device`: where
  // the ranks agree whether every part was written.
  Checkpointer(std::filesystem::path checkpoints, Parallel& parallel, std::vector<c10::Device> cuda_devices, c10::Device comm_device);

  // Writes the checkpoint of `state.step` (its name is made from the step) under a temporary name,
  // renamed into place and named in checkpoints/latest once every rank wrote its part: a crash or
  // a full disk leaves the previous checkpoint intact (UserError saying so). Every rank writes its
  // random state; one rank per model shard (data rank 0) `optimizer`'s state, keyed by parameter
  // name; rank 0 `state` (trainer.json). `write_weights(dir)` is called on every rank with the
  // checkpoint's folder, to write the adapter or model there (it gathers).
  void save(CheckpointState state, const Optimizer& optimizer, const std::function<void(const std::filesystem::path&)>& write_weights);

  // The newest checkpoint's state, with `optimizer` and this rank's random state restored from it,
  // or nullopt when there is none yet. Refuses (UserError) a checkpoint of another mesh, one whose
  // numbers `run` cannot have reached, and one missing this rank's files.
  std::optional<CheckpointState> restore(const RunShape& run, Optimizer& optimizer);

  // The newest complete checkpoint this run wrote or resumed from ("" before one), for messages.
  const std::string& last() const { return last_; }

  // Rank 0 removes all but the newest `keep` checkpoints, never `protect` (the best) nor the
  // latest; 0 keeps all.
  void prune(std::int64_t keep, const std::string& protect);
  // Rank 0 names `name` in checkpoints/best (atomically).
  void name_best(const std::string& name);
  // Every rank loads `name`'s weights and optimizer state into `optimizer` (the run's end: the
  // best checkpoint's weights become its outputs).
  void load_weights(const std::string& name, Optimizer& optimizer);

 private:
  std::string optimizer_file() const;
  std::string rng_file() const;

  std::filesystem::path dir_;
  Parallel& parallel_;
  std::vector<c10::Device> cuda_;
  c10::Device comm_device_;
  std::string last_;
};

}  // namespace loom::core
