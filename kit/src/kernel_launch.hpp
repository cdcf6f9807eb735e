#pragma once
// What the kit's LibTorch side needs to launch its own CUDA kernels: the kernels' dtype code of a
// tensor, a 4-bit tensor's arguments, the tensor's current stream, and a kernel status turned into an
// exception.
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "quantize_kernels.hpp"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::kit {
struct QuantizedTensor;  // loom/kit/quantize.hpp
}

namespace loom::kit::launch {

// The kernels' view of q, with q's tensors made contiguous where they were not (held in `kept`).
detail::DequantizeArgs dequantize_args(const QuantizedTensor& q, std::vector<at::Tensor>& kept);

inline detail::Dtype kernel_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? detail::Dtype::kBFloat16 : t == at::kHalf ? detail::Dtype::kFloat16 : detail::Dtype::kFloat32;
}
// Whether the kernels take the tensor's dtype.
inline bool kernels_take(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

#ifdef LOOM_WITH_CUDA
inline void check_cuda(const char* error, const char* what) {
  if (error != nullptr) throw std::runtime_error(std::string(what) + ": CUDA error: " + error);
}
inline void* current_stream(const at::Tensor& on) { return c10::cuda::getCurrentCUDAStream(on.device().index()).stream(); }
#endif

}  // namespace loom::kit::launch
