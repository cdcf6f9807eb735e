#pragma once
// A value of each CUDA device found once and kept: what CUDA says of a device (its attributes,
// which code its kernels run) does not change while a process runs. Plain C++, for the kernels'
// host code and for LibTorch's side alike.
#include <atomic>

namespace loom::kit::detail {

inline constexpr int kMaxCudaDevices = 64;

// known[device] holds 0 (not asked yet), -1 (`find` could not say) or the value; `find` returns
// the value, or 0 or less where it cannot say. 0 for a device past kMaxCudaDevices or unknown.
template <class Find>
int found_once(std::atomic<int> (&known)[kMaxCudaDevices], int device, Find find) {
  if (device < 0 || device >= kMaxCudaDevices) return 0;
  int value = known[device].load(std::memory_order_relaxed);
  if (value == 0) {
    value = find();
    if (value <= 0) value = -1;
    known[device].store(value, std::memory_order_relaxed);
  }
  return value > 0 ? value : 0;
}

}  // namespace loom::kit::detail
