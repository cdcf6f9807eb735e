#pragma once
// How the kit's CUDA kernels store one element of a float32, bfloat16 or half tensor, and read
// and write it as float32 (rounding to nearest, ties to even, as LibTorch converts).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "loom/kit/kernels.hpp"
#include "per_device.hpp"
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

// A 32-bit word of two 16-bit values (the first in the low half) as float32, and back.
__device__ __forceinline__ void unpack_pair(std::uint32_t word, Dtype d, float& first, float& second) {
  if (d == Dtype::kBFloat16) {
    first = __uint_as_float(word << 16);
    second = __uint_as_float(word & 0xffff0000u);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&word));
    first = f.x;
    second = f.y;
  }
}
template <Dtype D>
__device__ __forceinline__ std::uint32_t pack_pair(float first, float second) {
  static_assert(D != Dtype::kFloat32, "two 16-bit values a word");
  return static_cast<std::uint32_t>(convert<D>(first)) | (static_cast<std::uint32_t>(convert<D>(second)) << 16);
}

// Eight 16-bit values (one 16-byte load) as float32, and back.
template <Dtype D>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  unpack_pair(v.x, D, f[0], f[1]);
  unpack_pair(v.y, D, f[2], f[3]);
  unpack_pair(v.z, D, f[4], f[5]);
  unpack_pair(v.w, D, f[6], f[7]);
}
template <Dtype D>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack_pair<D>(f[0], f[1]), pack_pair<D>(f[2], f[3]), pack_pair<D>(f[4], f[5]), pack_pair<D>(f[6], f[7]));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Programmatic dependent launch (sm_90 on): a kernel started by overlapped_launch may be scheduled
// while the kernel before it in the stream still runs, so its start (weights it streams, tables it
// fills) hides that kernel's tail. Before wait_for_prior_kernels() such a kernel writes nothing and
// reads only what no kernel of its pass writes (a layer's weights while generating, never a copy
// made for the launch). Each thread lets the next kernel start only after its own wait, so a kernel
// that reads early can run beside the one before it, never beside the one before that: everything
// older is complete and visible. Without the launch attribute both are no-ops.
__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// An attribute of the current device (a positive one: compute capability, multiprocessors), asked
// of CUDA once a device; 0 where CUDA cannot say.
template <cudaDeviceAttr Attribute>
int current_device_attribute() {
  static std::atomic<int> known[kMaxCudaDevices];
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return found_once(known, device, [device] {
    int asked = 0;
    return cudaDeviceGetAttribute(&asked, Attribute, device) == cudaSuccess ? asked : 0;
  });
}

// The compute capability (major * 10 + minor) the kit's kernels were compiled for as the current
// device runs them: their PTX's (a build of compute_75 PTX only, JIT-compiled on an H200, has 7.5's
// code: no tensor-core tiles, no launch overlap); 0 where CUDA cannot say. quantize_cuda.cu.
int kernels_code_capability();

// What the kit's kernels may use on the current device: its compute capability, or
// LOOM_DEVICE_CAPABILITY's where lower (loom/kit/kernels.hpp), never past the code's.
inline int kernel_capability() {
  static const int override_capability = capability_override();  // a malformed value throws here, at the first launch
  int device = current_device_attribute<cudaDevAttrComputeCapabilityMajor>() * 10 + current_device_attribute<cudaDevAttrComputeCapabilityMinor>();
  if (override_capability > 0 && override_capability < device) device = override_capability;
  const int code = kernels_code_capability();
  return code > 0 && code < device ? code : device;
}

// The current device as the product table (loom/kit/kernels.hpp) reads it.
inline DeviceTraits current_device_traits() {
  return {kernel_capability(), current_device_attribute<cudaDevAttrMultiProcessorCount>(),
          current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>()};
}

// Whether launches overlap (compute capability 9 or more: griddepcontrol).
inline bool launches_overlap() { return kernel_capability() >= 90; }

// Whether a kernel may read p as 16-byte words: a contiguous tensor may start anywhere in its storage.
inline bool aligned_words(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <class... Params, class... Args>
cudaError_t overlapped_launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = launches_overlap() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace loom::kit::detail
