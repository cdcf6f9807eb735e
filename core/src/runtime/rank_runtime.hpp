#pragma once
// This rank's runtime: how it trains a step, evaluates and generates, one path for all three
// whatever the placement. A process that holds every block runs a one-stage schedule; a pipeline
// rank runs its list of forwards, backwards, sends and receives for one step, whatever schedule made
// it. Receives are posted where the schedule says (as soon as the peer sends), waited for only when
// a forward or backward needs them.
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "runtime/executor.hpp"
#include "loom/collator.hpp"
#include "loom/communicator.hpp"
#include "loom/placement.hpp"

namespace loom::core {

// A collated batch as tensors [B, T] on the CPU (labels may have been moved to the head's device).
struct MicroBatch {
  at::Tensor ids, positions, mask, labels;
};
// The collator's batch as tensors; positions count the real tokens of each row from 0.
MicroBatch to_micro_batch(const Batch& batch);
// Tokens that carry a next-token label, counted on the CPU labels (no device sync).
std::int64_t label_count(const MicroBatch& batch);

class RankRuntime {
 public:
  // Every block of the executor's model held here, run as one stage (one process, data or tensor
  // ranks): no transfers.
  explicit RankRuntime(Executor& executor);
  // `plan` is this rank's replica plan (its schedule not empty), `me` this rank's place in it (its
  // pipeline coordinate). Transfers go through `group` (the pipeline group) on `comm_device`.
  RankRuntime(Executor& executor, const Plan& plan, int me, Communicator& group, c10::Device comm_device, std::int64_t hidden_size,
              at::ScalarType dtype);
  // The one-stage runtime when `plan` has no schedule, else the pipeline one.
  static std::unique_ptr<RankRuntime> for_plan(Executor& executor, const Plan& plan, int me, Communicator& group, c10::Device comm_device,
                                               std::int64_t hidden_size, at::ScalarType dtype);

  // One step's forwards and backwards (in a one-stage run each micro-batch's forward then its
  // backward). `loss(state, m)` gives micro-batch m's loss, from its state after the head block
  // (state.hidden: the head's output), as it is to be reported (the last stage calls it); backward runs on it times `scale`. `before_last_backward`
  // is called before this rank's last backward of the step. Returns the sum of the reported
  // losses on the rank of the last stage, an undefined tensor elsewhere.
  at::Tensor train_step(const std::vector<MicroBatch>& micro, const std::function<at::Tensor(const ForwardState&, std::size_t)>& loss, double scale,
                        const std::function<void()>& before_last_backward);

  // Every stage in turn, without gradients: the head's output on the rank of the last stage,
  // undefined elsewhere. `cached`: a generation pass through this rank's cache.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass* cached = nullptr);

  // One generation pass (see CachedPass; `mask` as StaticCacheDecoding reads it): the head's logits
  // at each row's last token [B, V] (fp32) on every rank, on the head's device in one stage, else
  // computed on the last stage's rank and broadcast over the group (on its device). Only those
  // positions' logits are made (a vocabulary-parallel head gathers just those). A model without
  // StaticCacheDecoding has every written position of the rows run again, from the ids and
  // positions this keeps in the pass's cache.
  at::Tensor last_logits(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass& pass);

  // Whether a generation step may be captured as a CUDA graph: one stage on one GPU, nothing split
  // over processes (no collective inside the step).
  bool graph_capturable(Parallel& parallel) const;

  Executor& executor() { return executor_; }
  bool holds_last_stage() const { return schedule_.stage_rank.back() == me_; }

  // Tied blocks on several ranks (an embedding and its head on the first and last stage) each keep
  // a copy: `tie()` finds which of `params` (this rank's trainable ones) are such copies;
  // `sum_tied_gradients()` sums their gradients between the holders after a step's backward, in
  // rank order, so the copies stay bitwise equal.
  void tie(const ModelStructure& structure, const std::vector<NamedParameter>& params);
  void sum_tied_gradients(std::vector<NamedParameter>& params);
  // Per parameter given to tie(): a copy another rank counts in the gradient norm.
  const std::vector<bool>& counted_elsewhere() const { return counted_elsewhere_; }

 private:
  struct Pending {
    at::Tensor buffer;
    std::unique_ptr<Work> work;
  };
  int rank_of(int stage) const { return schedule_.stage_rank[static_cast<std::size_t>(stage)]; }
  c10::Device stage_device(int stage) const { return executor_.device_of(first_[static_cast<std::size_t>(stage)]); }
  int tag(int kind, int stage, int micro) const { return (kind * schedule_.stages + stage) * std::max(1, schedule_.micro_batches) + micro; }
  // Where an activation [B, T, hidden] of the micro-batch `ids` [B, T] is received.
  at::Tensor activation_buffer(const at::Tensor& ids) const;
  at::Tensor receive_now(int stage, const at::Tensor& like_ids);
  void run_stage(int stage, ForwardState& state, CachedPass* cached = nullptr);

  Executor& executor_;
  PipelineSchedule schedule_;
  int me_;
  Communicator* group_;  // null in a one-stage run
  c10::Device comm_device_;
  std::int64_t hidden_;
  at::ScalarType dtype_;
  std::vector<std::size_t> first_, last_;  // blocks of each stage
  std::vector<int> block_rank_;
  struct TiedCopy {
    std::size_t index;         // into the parameters given to tie()
    std::vector<int> holders;  // ranks, ascending
  };
  std::vector<TiedCopy> tied_;
  std::vector<bool> counted_elsewhere_;
};

}  // namespace loom::core
