#pragma once
// What data parallelism adds to a step: each rank's share of the samples, and the sum of every
// rank's gradients.
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "loom/communicator.hpp"
#include "loom/model.hpp"

namespace loom::core {

// Rank `rank` of `ranks`' part of a micro-batch drawn for all of them: the contiguous slice
// [rank * per_rank, (rank + 1) * per_rank). Rank 0 of 1 gets everything, so N ranks with batch B
// see exactly the samples one process with batch N x B sees.
template <typename T>
std::vector<T> share_of(const std::vector<T>& drawn, int rank, int ranks) {
  const std::size_t per = drawn.size() / static_cast<std::size_t>(ranks);
  return std::vector<T>(drawn.begin() + static_cast<std::ptrdiff_t>(per * static_cast<std::size_t>(rank)),
                        drawn.begin() + static_cast<std::ptrdiff_t>(per * static_cast<std::size_t>(rank + 1)));
}

// Sums the gradients of `params` over a data group, flattened into buckets of about
// `bucket_bytes` (per device and dtype). Armed before the backward pass of a step's last
// micro-batch, each bucket's sum is launched from a hook on its parameters' gradient accumulators
// as soon as the backward has produced all of them, so communication overlaps the rest of the
// backward; earlier micro-batches accumulate locally and communicate nothing. Buckets follow the
// parameters backwards (the order the backward produces them) and are launched strictly in bucket
// order, the same on every rank, as collectives must be. finish() launches what the backward did
// not reach (a rank whose micro-batches were all skipped, an unused parameter: zeros), waits, and
// writes the sums back. Gradients on a device the group cannot reach (CPU-offloaded blocks under
// NCCL) travel through `group_device`.
class GradientSync {
 public:
  GradientSync(Communicator& group, std::vector<NamedParameter> params, c10::Device group_device, std::size_t bucket_bytes = 25u << 20);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;
  void arm();
  void finish();
  // Called by the hooks: parameter `index` has its gradient for this backward.
  void ready(std::size_t index);

 private:
  struct Bucket {
    std::vector<std::size_t> members;  // indices into params_
    c10::Device device{c10::kCPU};
    at::ScalarType dtype = at::kFloat;
    std::int64_t numel = 0;
  };
  void start_round();      // nothing launched yet this step; with mutex_ held
  void launch_in_order();  // with mutex_ held
  void launch(std::size_t bucket);

  Communicator& group_;
  std::vector<NamedParameter> params_;
  c10::Device group_device_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;                 // per parameter
  std::vector<std::shared_ptr<void>> accumulators_;    // keeps the hooked autograd nodes alive
  std::mutex mutex_;                                   // hooks run on the autograd engine's threads
  bool armed_ = false;
  std::vector<std::size_t> ready_count_;
  std::size_t next_ = 0;                               // next bucket to launch
  std::vector<at::Tensor> flats_;
  std::vector<std::unique_ptr<Work>> pending_;
  bool logged_ = false;  // how many buckets overlapped, once per run at debug level
};

}  // namespace loom::core
