#include "loom/kit/torch_compat.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/api/include/torch/version.h>

#include "loom/kit/kernels.hpp"
#include "per_device.hpp"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

// NCCL is linked by CUDA builds of LibTorch; a weak reference finds it when present without
// making loom depend on NCCL's headers.
extern "C" int ncclGetVersion(int* version) __attribute__((weak));
extern "C" void openblas_set_num_threads(int threads) __attribute__((weak));
extern "C" int openblas_get_num_threads() __attribute__((weak));

namespace loom::kit::compat {

std::string torch_version() { return TORCH_VERSION; }

#ifdef LOOM_WITH_CUDA
int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: report none rather than fail
    return 0;
  }
  return count;
}

std::optional<std::string> cuda_runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return std::nullopt;
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

CudaDeviceMemory cuda_device_memory(int index) {
  CudaDeviceMemory out;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess)
    throw std::runtime_error("cudaGetDeviceProperties failed for cuda:" + std::to_string(index));
  out.name = prop.name;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(index);
  size_t free_bytes = 0, total_bytes = 0;
  const auto status = cudaMemGetInfo(&free_bytes, &total_bytes);
  cudaSetDevice(previous);
  if (status != cudaSuccess)
    throw std::runtime_error("cudaMemGetInfo failed for cuda:" + std::to_string(index));
  out.free_bytes = free_bytes;
  out.total_bytes = total_bytes;
  return out;
}
int cuda_device_capability(int index) {
  // Asked once a device: attention asks at every call.
  static std::atomic<int> known[detail::kMaxCudaDevices];
  const int own = detail::found_once(known, index, [index] {
    int major = 0, minor = 0;
    const bool read = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) == cudaSuccess &&
                      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index) == cudaSuccess;
    return read ? major * 10 + minor : 0;
  });
  if (own == 0) throw std::runtime_error("cannot read the compute capability of cuda:" + std::to_string(index));
  const int chosen = capability_override();
  return chosen > 0 && chosen < own ? chosen : own;
}

std::optional<std::uint64_t> cuda_peak_allocated(int index) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return static_cast<std::uint64_t>(stats.allocated_bytes[0].peak);  // [0]: all pools together
}

std::optional<std::uint64_t> cuda_available(int index) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  const auto held = static_cast<std::uint64_t>(stats.reserved_bytes[0].current - stats.allocated_bytes[0].current);
  return cuda_device_memory(index).free_bytes + held;
}

void limit_cuda_memory(int index, std::uint64_t bytes) {
  const auto total = cuda_device_memory(index).total_bytes;
  // LibTorch sets its caching allocator up with the first CUDA tensor; the fraction needs it.
  (void)at::empty({1}, at::TensorOptions().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index))));
  c10::cuda::CUDACachingAllocator::setMemoryFraction(std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total)),
                                                     static_cast<c10::DeviceIndex>(index));
}

void set_cuda_device(int index) {
  if (cudaSetDevice(index) != cudaSuccess) throw std::runtime_error("cannot select cuda:" + std::to_string(index));
}
#else
void limit_cuda_memory(int, std::uint64_t) {}
void set_cuda_device(int index) { throw std::logic_error("cuda:" + std::to_string(index) + " selected in a CPU-only build"); }
int cuda_device_count() { return 0; }
std::optional<std::uint64_t> cuda_peak_allocated(int) { return std::nullopt; }
std::optional<std::uint64_t> cuda_available(int) { return std::nullopt; }
std::optional<std::string> cuda_runtime_version() { return std::nullopt; }
CudaDeviceMemory cuda_device_memory(int index) {
  throw std::logic_error("cuda:" + std::to_string(index) + " requested from a CPU-only build");
}
int cuda_device_capability(int index) { throw std::logic_error("cuda:" + std::to_string(index) + " requested from a CPU-only build"); }
#endif

void set_cpu_threads(int threads) {
  at::set_num_threads(threads);
  // OpenBLAS resizes its pool and per-thread buffers even to the count it has: unsafe while another
  // thread of the process multiplies (ranks as threads), and needless.
  if (openblas_set_num_threads == nullptr) return;
  if (openblas_get_num_threads != nullptr && openblas_get_num_threads() == threads) return;
  openblas_set_num_threads(threads);
}

std::optional<std::string> nccl_version() {
  if (ncclGetVersion == nullptr) return std::nullopt;
  int v = 0;
  if (ncclGetVersion(&v) != 0) return std::nullopt;
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." +
         std::to_string(v % 100);
}

at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#ifdef LOOM_WITH_CUDA
  // As on a device of LOOM_DEVICE_CAPABILITY 7.x: LibTorch has no flash or cuDNN attention there.
  static const bool emulating_7x = [] {
    const int chosen = capability_override();
    if (chosen == 0 || chosen >= 80) return false;
    at::globalContext().setSDPUseFlash(false);
    at::globalContext().setSDPUseCuDNN(false);
    return true;
  }();
  (void)emulating_7x;
  // Only the flash kernel takes grouped-query heads as they are (16-bit, no mask, compute
  // capability 8.0 on); the memory-efficient kernel takes none, so SDPA would fall back to the
  // exact formula, which keeps every [T, T] of probabilities for backward (the 8B at 4 x 1024 in fp16
  // on 7.5: 55 GiB where bf16 took 33; in fp32 out of memory on 80 GiB). Elsewhere each key/value
  // head is repeated for its group, as transformers' repeat_kv does.
  const auto flash_takes = [&] {
    return !allowed.defined() && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) && q.size(-1) <= 256 &&
           cuda_device_capability(static_cast<int>(q.device().index())) >= 80;
  };
  if (q.is_cuda() && k.size(1) != q.size(1) && !flash_takes()) {
    const auto groups = q.size(1) / k.size(1);
    const at::Tensor keys = k.repeat_interleave(groups, 1), values = v.repeat_interleave(groups, 1);
    if (!allowed.defined()) return at::scaled_dot_product_attention(q, keys, values, {}, 0.0, /*is_causal=*/true);
    return at::scaled_dot_product_attention(q, keys, values, allowed, 0.0, false);
  }
#endif
  // Grouped-query heads go to the kernel as they are; no mask means plain causal, which lets
  // SDPA pick its flash kernel.
  if (!allowed.defined()) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt, /*enable_gqa=*/true);
  return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, std::nullopt, /*enable_gqa=*/true);
#else
  const auto groups = q.size(1) / k.size(1);
  const at::Tensor keys = groups == 1 ? k : k.repeat_interleave(groups, 1);
  const at::Tensor values = groups == 1 ? v : v.repeat_interleave(groups, 1);
  at::Tensor mask = allowed;
  if (!mask.defined()) {
    const auto len = q.size(2);
    mask = at::ones({len, len}, at::TensorOptions().dtype(at::kBool).device(q.device())).tril();
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q.to(at::kFloat), keys.to(at::kFloat).transpose(-2, -1)) * scale;
  scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
  return at::matmul(at::softmax(scores, -1), values.to(at::kFloat)).to(q.scalar_type());
#endif
}

void foreach_copy(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  if (dst.size() != src.size()) throw std::logic_error("foreach_copy: " + std::to_string(dst.size()) + " destinations for " + std::to_string(src.size()) + " sources");
  if (dst.empty()) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
  at::_foreach_copy_(dst, src);
#else
  for (std::size_t i = 0; i < dst.size(); ++i) {
    at::Tensor d = dst[i];
    d.copy_(src[i]);
  }
#endif
}

}  // namespace loom::kit::compat
