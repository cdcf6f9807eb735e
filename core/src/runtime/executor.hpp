#pragma once
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/adapter.hpp"
#include "loom/model.hpp"
#include "loom/placement.hpp"

namespace loom::core {

// Runs this rank's blocks of a loaded model in order, on the devices of its plan. Activations and
// the pass's shared tensors cross devices only here, at block boundaries.
class Executor {
 public:
  // `devices` has one entry per block of the model, nullopt for blocks other ranks hold. Checks
  // that every parameter sits on its block's device; with `check_devices`, forward() also checks
  // each block's output.
  Executor(std::unique_ptr<LoadedModel> model, std::vector<std::optional<c10::Device>> devices, bool check_devices = false,
           std::vector<std::string> block_names = {});

  // ids [B, T], positions [B, T], mask [B, S] on any device, through every block this rank holds
  // (all of them in a one-replica-rank plan). Returns the head's output on the head's device: the
  // logits, or the head's input where the model leaves its product to loss_sum() and logits() (a
  // frozen head; the kit's decoder). With `cached`, through the model's StaticCacheDecoding (which
  // the caller checked it offers).
  at::Tensor head_output(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass* cached = nullptr);
  // The logits of every position: logits() of head_output().
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass* cached = nullptr) {
    return logits(head_output(ids, positions, mask, cached));
  }
  // Runs the blocks first..last (all held here) on `state`, moving its tensors to each block's
  // device; what a pipeline stage runs.
  void run_blocks(std::size_t first, std::size_t last, ForwardState& state, CachedPass* cached = nullptr);
  // The model's generation through a cache made once per request; null when it lacks it.
  StaticCacheDecoding* cached_decoding() { return decoding_; }
  // Blocks whose activations backward recomputes instead of keeping (one flag per block); the
  // recomputation replays the random state, so dropout draws what it drew the first time.
  // With `offload`, their inputs wait for backward in host memory ([train] activation_checkpointing
  // = "offload").
  void set_checkpointed(std::vector<bool> blocks, bool offload = false) {
    checkpointed_ = std::move(blocks);
    offload_checkpoints_ = offload;
  }
  // The model's loss and logits from the head's output (the model owns both: a
  // vocabulary-parallel head never gathers full logits).
  at::Tensor loss_sum(const at::Tensor& head_output, const at::Tensor& labels) { return model_->loss_sum(head_output, labels); }
  at::Tensor logits(const at::Tensor& head_output) { return model_->logits(head_output); }

  LoadedModel& model() { return *model_; }
  // The distinct devices this rank's blocks use, in block order.
  const std::vector<c10::Device>& devices() const { return distinct_; }
  const c10::Device& head_device() const { return head_; }
  // The device of a block this rank holds.
  c10::Device device_of(std::size_t block) const { return blocks_.at(block).value(); }

 private:
  std::unique_ptr<LoadedModel> model_;
  std::vector<std::optional<c10::Device>> blocks_;
  std::vector<c10::Device> distinct_;
  c10::Device head_{c10::kCPU};
  bool check_devices_;
  std::vector<std::string> names_;  // for messages; "block N" when empty
  std::vector<bool> checkpointed_;
  bool offload_checkpoints_ = false;
  at::Tensor anchor_;
  StaticCacheDecoding* decoding_ = nullptr;  // requires grad, so a checkpointed block is reached by backward even when its input is not
};

c10::Device torch_device(const std::string& name);  // "cpu", "cuda:N"

// Loads the model onto the devices `plan` gives pipeline rank `pipeline_rank`, through `parallel`
// (null in one process; its tensor group splits the model when it has several ranks), with the base
// weights `adapter` stores its own way (a 4-bit base) built as it says.
std::unique_ptr<Executor> load_executor(const Model& model, const Plan& plan, DType dtype, std::uint64_t seed, bool check_devices = false,
                                        int pipeline_rank = 0, Parallel* parallel = nullptr, const Adapter* adapter = nullptr);

// Logs (info) what the linears of `model` stored in less than a dense matrix (a 4-bit base's
// codes, scales and their tables) weigh as stored, if it holds any. Asks only LinearWeight's
// interface, so it holds for any adapter's storage.
void log_compact_base(LoadedModel& model);

}  // namespace loom::core
