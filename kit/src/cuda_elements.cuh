#pragma once
// How the kit's CUDA kernels store one element of a float32, bfloat16 or half tensor, and read
// and write it as float32 (rounding to nearest, ties to even, as LibTorch converts).
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "quantize_kernels.hpp"

namespace loom::kit::detail {

// What one element is stored as: float32, or the 16 bits of a bfloat16 or half.
template <Dtype D>
using Stored = typename std::conditional<D == Dtype::kFloat32, float, std::uint16_t>::type;

template <Dtype D>
__device__ __forceinline__ Stored<D> convert(float v) {
  if constexpr (D == Dtype::kBFloat16) return bfloat16_bits(v);
  else if constexpr (D == Dtype::kFloat16) return __half_as_ushort(__float2half_rn(v));
  else return v;
}

template <Dtype D>
__device__ __forceinline__ float load(const Stored<D>* p, std::int64_t i) {
  if constexpr (D == Dtype::kBFloat16) return bfloat16_value(p[i]);
  else if constexpr (D == Dtype::kFloat16) return __half2float(__ushort_as_half(p[i]));
  else return p[i];
}

// float32 -> the dtype and back: the value LibTorch's kernel of that dtype would have stored.
template <Dtype D>
__device__ __forceinline__ float rounded(float v) {
  if constexpr (D == Dtype::kFloat32) return v;
  else {
    const Stored<D> s = convert<D>(v);
    return load<D>(&s, 0);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace loom::kit::detail
