#pragma once
// The one place where LibTorch 1.13 (Debian, CPU) and LibTorch 2.x (CUDA) differ for loom.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit::compat {

LOOM_API std::string torch_version();                     // "1.13.0"
LOOM_API int cuda_device_count();                         // 0 on a CPU build or without GPUs
LOOM_API std::optional<std::string> cuda_runtime_version();  // "13.0"
LOOM_API std::optional<std::string> nccl_version();          // "2.28.9"

struct CudaDeviceMemory {
  std::string name;
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
};
LOOM_API CudaDeviceMemory cuda_device_memory(int index);  // requires index < cuda_device_count()
// cuda:`index`'s compute capability as loom chooses by it (major * 10 + minor): the device's own,
// or LOOM_DEVICE_CAPABILITY's where lower (loom/kit/kernels.hpp). Requires index < cuda_device_count().
LOOM_API int cuda_device_capability(int index);

// Sets LibTorch's intra-op threads and, where Debian's LibTorch calls into OpenBLAS, OpenBLAS's
// own pool too: left alone, its threads spin beside LibTorch's and a small model runs slower.
LOOM_API void set_cpu_threads(int threads);

// Peak bytes LibTorch's caching allocator has handed out on cuda:`index`
// (what torch.cuda.max_memory_allocated reports: since the process started, as loom never resets
// it); nullopt on a CPU build.
LOOM_API std::optional<std::uint64_t> cuda_peak_allocated(int index);
// Bytes a new allocation on cuda:`index` can still get: the device's free memory and what
// LibTorch's caching allocator holds unused; nullopt on a CPU build.
LOOM_API std::optional<std::uint64_t> cuda_available(int index);
// Caps what LibTorch's caching allocator may hold on cuda:`index` at `bytes` (a fraction of the
// device's memory); past it an allocation fails as out of memory. No-op on a CPU build.
LOOM_API void limit_cuda_memory(int index, std::uint64_t bytes);
// Makes cuda:`index` the current device (NCCL communicators bind to it when created).
LOOM_API void set_cuda_device(int index);

// softmax(q k^T / sqrt(d) where allowed) v with grouped-query heads (k, v may have fewer heads than
// q), a boolean mask [B, 1, T, S], or no mask for plain causal attention over T == S. LibTorch 2.x
// runs its fused kernels; 1.13 (no public SDPA) the exact formula in fp32.
LOOM_API at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& allowed);

// dst[i].copy_(src[i]) for every i (dtypes may differ): LibTorch 2.2 on in a few foreach kernels
// instead of one per tensor (an optimizer's casts of hundreds of LoRA tensors), 1.13 one by one.
LOOM_API void foreach_copy(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src);

}  // namespace loom::kit::compat
