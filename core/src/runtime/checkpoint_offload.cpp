#include "runtime/checkpoint_offload.hpp"

#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#ifdef LOOM_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "generation/side_stream.hpp"
#include "loom/error.hpp"

namespace loom::core {
namespace {

std::atomic<std::uint64_t> held_bytes{0}, peak_bytes{0};  // pinned buffers handed out (none without CUDA)

#ifdef LOOM_WITH_CUDA
void count_held(std::int64_t change) {
  const std::uint64_t now = held_bytes.fetch_add(static_cast<std::uint64_t>(change)) + static_cast<std::uint64_t>(change);
  std::uint64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
}

// Pinned buffers kept for reuse: every step offloads the same shapes, and cudaHostAlloc of tens of
// GiB takes seconds. Sizes round up to 64 MiB; a buffer serves a request up to a quarter smaller.
// LibTorch's own pinned allocator rounds to a power of two, which at a long row doubles the host
// memory. Every use of a buffer is on the side stream, so a returned one is reused in order.
class PinnedPool {
 public:
  at::Tensor take(at::IntArrayRef sizes, at::ScalarType dtype) {
    const std::uint64_t bytes = static_cast<std::uint64_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
    const std::uint64_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
    void* buffer = nullptr;
    std::uint64_t size = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.lower_bound(rounded);
      if (it != free_.end() && it->first <= rounded + rounded / 4) {
        size = it->first;
        buffer = it->second;
        free_.erase(it);
      } else {
        // Smaller free buffers would never serve this size again: give them back first.
        for (auto small = free_.begin(); small != free_.end() && small->first < rounded;) {
          cudaFreeHost(small->second);
          small = free_.erase(small);
        }
      }
    }
    if (buffer == nullptr) {
      if (cudaHostAlloc(&buffer, rounded, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        throw UserError("[train] activation_checkpointing = \"offload\": could not pin " + std::to_string(rounded >> 20) +
                        " MiB of host memory for a layer's input (" + std::to_string(held_bytes.load() >> 20) +
                        " MiB held already); lower [data] max_length or [train] batch_size, or use \"every-layer\"");
      }
      size = rounded;
    }
    count_held(static_cast<std::int64_t>(size));
    return at::from_blob(
        buffer, sizes,
        [this, size](void* p) {
          count_held(-static_cast<std::int64_t>(size));
          std::lock_guard<std::mutex> lock(mutex_);
          free_.emplace(size, p);
        },
        at::TensorOptions().dtype(dtype).device(at::kCPU));
  }

 private:
  static constexpr std::uint64_t kGranule = std::uint64_t{64} << 20;
  std::mutex mutex_;
  std::multimap<std::uint64_t, void*> free_;
};

PinnedPool& pinned_pool() {
  static auto* pool = new PinnedPool();  // outlives every tensor that returns a buffer to it
  return *pool;
}

// The side stream waits for what the compute stream has queued so far.
c10::cuda::CUDAStream side_after_compute(c10::DeviceIndex device) {
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device), side = side_stream(device);
  at::cuda::CUDAEvent queued;
  queued.record(compute);
  queued.block(side);
  return side;
}
#endif

}  // namespace

#ifdef LOOM_WITH_CUDA
struct OffloadedInput::Transfers {
  at::cuda::CUDAEvent back;  // the copy to the device done
};
#else
struct OffloadedInput::Transfers {};
#endif

OffloadedInput::OffloadedInput(const at::Tensor& input, c10::intrusive_ptr<OffloadedInput> previous)
    : device_(input.device()), previous_(std::move(previous)) {
#ifdef LOOM_WITH_CUDA
  if (device_.is_cuda()) {
    transfers_ = std::make_unique<Transfers>();
    const at::Tensor whole = input.contiguous();
    kept_ = pinned_pool().take(whole.sizes(), whole.scalar_type());
    const c10::cuda::CUDAStream side = side_after_compute(device_.index());
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      kept_.copy_(whole, /*non_blocking=*/true);
    }
    // The allocator may not hand the input's memory out again before the copy has read it.
    whole.record_stream(side);
    return;
  }
#endif
  kept_ = input;
}

OffloadedInput::~OffloadedInput() = default;

void OffloadedInput::prefetch() {
#ifdef LOOM_WITH_CUDA
  if (!device_.is_cuda() || back_.defined() || !kept_.defined()) return;
  back_ = at::empty(kept_.sizes(), kept_.options().device(device_));  // on the compute stream, ordered after its last use there
  const c10::cuda::CUDAStream side = side_after_compute(device_.index());
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    back_.copy_(kept_, /*non_blocking=*/true);
  }
  back_.record_stream(side);
  transfers_->back.record(side);
#endif
}

at::Tensor OffloadedInput::take() {
  if (!kept_.defined()) throw std::logic_error("checkpoint offload: a layer's input taken twice");
#ifdef LOOM_WITH_CUDA
  if (device_.is_cuda()) {
    prefetch();
    if (previous_) previous_->prefetch();  // queued behind this one on the side stream
    transfers_->back.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    at::Tensor out = back_;
    back_ = at::Tensor();
    kept_ = at::Tensor();  // the buffer goes back to the pool; its next copy is queued behind this one
    return out;
  }
#endif
  at::Tensor out = kept_;
  kept_ = at::Tensor();
  return out;
}

std::uint64_t offloaded_bytes_now() { return held_bytes.load(); }
std::uint64_t offloaded_bytes_peak() { return peak_bytes.load(); }

}  // namespace loom::core
