// CUDA kernels for 4-bit weights: the element arithmetic is quantize_kernels.hpp's, shared with
// the CPU loops, so both devices give the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda_elements.cuh"
#include "quantize_kernels.hpp"

namespace loom::kit::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;  // elements a thread of the general kernel dequantizes
constexpr int kChunk = 16;     // elements a thread of the chunked kernel dequantizes: 8 packed bytes

template <Dtype D>
__global__ void dequantize_kernel(const DequantizeArgs a, bool packed_word_aligned, bool out_vector_aligned, Stored<D>* __restrict__ out) {
  // The code values in shared memory: a warp indexing the kernel's parameter array by 32 different
  // codes would have its reads of the constant bank serialised.
  __shared__ float code_values[16];
  if (threadIdx.x < 16) code_values[threadIdx.x] = a.values[threadIdx.x];
  __syncthreads();
  const std::int64_t first = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread;
  if (first >= a.n) return;
  const int count = a.n - first < kPerThread ? static_cast<int>(a.n - first) : kPerThread;
  // The thread's packed bytes (little-endian in one word): one 4-byte load where all 4 are there.
  std::uint32_t word = 0;
  if (count == kPerThread && packed_word_aligned) {
    word = *reinterpret_cast<const std::uint32_t*>(a.packed + first / 2);
  } else {
    for (int b = 0; b < (count + 1) / 2; ++b) word |= static_cast<std::uint32_t>(a.packed[first / 2 + b]) << (8 * b);
  }
  std::int64_t block = first / a.blocksize;
  std::int64_t block_end = (block + 1) * a.blocksize;
  float scale = block_scale(a, block);
  // blocks hold at least 16 elements: at most one boundary inside a thread's 8
  const auto value = [&](int k) {
    if (first + k >= block_end) {
      ++block;
      block_end += a.blocksize;
      scale = block_scale(a, block);
    }
    return convert<D>(dequantized_code(code_values, (word >> (8 * (k / 2))) & 0xffu, (k & 1) != 0, scale));
  };
  if (count < kPerThread || !out_vector_aligned) {  // the tensor's last few elements, or an unaligned out
    for (int k = 0; k < count; ++k) out[first + k] = value(k);
    return;
  }
  // A whole thread's worth, unrolled so the values stay in registers, then stored as 16-byte
  // vectors (the thread's first element is a multiple of 8 from an aligned out).
  union {
    Stored<D> values[kPerThread];
    uint4 vectors[sizeof(Stored<D>) * kPerThread / sizeof(uint4)];
  } staged;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) staged.values[k] = value(k);
  uint4* target = reinterpret_cast<uint4*>(out + first);
#pragma unroll
  for (int v = 0; v < static_cast<int>(sizeof(staged.vectors) / sizeof(uint4)); ++v) target[v] = staged.vectors[v];
}

// Two elements, the first at the lower address, as the 32 bits of a bfloat16 or half pair: one
// conversion instruction for both, rounding to nearest even as bfloat16_bits and the CPU's half do
// (NaN payloads aside: only a weight holding inf or NaN dequantizes to NaN).
template <Dtype D>
__device__ __forceinline__ std::uint32_t pair_bits(float first, float second) {
  if constexpr (D == Dtype::kBFloat16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(first, second);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(first, second);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
}

// The common case, bound by memory: blocks a multiple of 16 long, so each thread's 16 elements
// share one scale, found with 32-bit divisions (the launcher checks that n / 16 fits in 31 bits); one 8-byte load
// of codes, 16-byte stores. The tensor's last partial chunk goes element by element.
template <Dtype D>
__global__ void dequantize_chunks_kernel(const DequantizeArgs a, std::uint32_t chunks_per_block, std::uint32_t nested_blocksize,
                                         Stored<D>* __restrict__ out) {
  __shared__ float code_values[16];
  if (threadIdx.x < 16) code_values[threadIdx.x] = a.values[threadIdx.x];
  __syncthreads();
  const std::uint32_t chunk = blockIdx.x * blockDim.x + threadIdx.x;
  const std::int64_t first = static_cast<std::int64_t>(chunk) * kChunk;
  if (first >= a.n) return;
  const std::uint32_t block = chunk / chunks_per_block;
  const float scale = block_scale(a, block, block / nested_blocksize);
  if (a.n - first < kChunk) {
    for (std::int64_t i = first; i < a.n; ++i) out[i] = convert<D>(dequantized_code(code_values, a.packed[i >> 1], (i & 1) != 0, scale));
    return;
  }
  const uint2 codes = *reinterpret_cast<const uint2*>(a.packed + first / 2);
  const auto value = [&](int byte, bool odd) {
    const std::uint32_t word = byte < 4 ? codes.x : codes.y;
    return dequantized_code(code_values, (word >> (8 * (byte % 4))) & 0xffu, odd, scale);
  };
  uint4* target = reinterpret_cast<uint4*>(out + first);
  if constexpr (D == Dtype::kFloat32) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float4 f = make_float4(value(2 * v, false), value(2 * v, true), value(2 * v + 1, false), value(2 * v + 1, true));
      target[v] = *reinterpret_cast<const uint4*>(&f);
    }
  } else {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      uint4 w;
      w.x = pair_bits<D>(value(4 * v, false), value(4 * v, true));
      w.y = pair_bits<D>(value(4 * v + 1, false), value(4 * v + 1, true));
      w.z = pair_bits<D>(value(4 * v + 2, false), value(4 * v + 2, true));
      w.w = pair_bits<D>(value(4 * v + 3, false), value(4 * v + 3, true));
      target[v] = w;
    }
  }
}

// One warp per block of the input: its max |x|.
__global__ void absmax_kernel(const QuantizeArgs a, std::int64_t blocks) {
  const std::int64_t block = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (block >= blocks) return;  // whole warps leave together: blockDim is a multiple of 32
  const std::int64_t begin = block * a.blocksize;
  const std::int64_t end = begin + a.blocksize < a.n ? begin + a.blocksize : a.n;
  float m = 0;
  for (std::int64_t i = begin + lane; i < end; i += 32) m = fmaxf(m, fabsf(input_at(a, i)));
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (lane == 0) a.absmax[block] = m;
}

__global__ void codes_kernel(const QuantizeArgs a, std::int64_t bytes) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= bytes) return;
  const std::int64_t i = 2 * j;
  a.packed[j] = packed_byte(a, j, input_at(a, i), i + 1 < a.n ? input_at(a, i + 1) : 0.0f);
}

unsigned grid_for(std::int64_t work) { return static_cast<unsigned>((work + kThreads - 1) / kThreads); }

const char* launched() {
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

template <Dtype D>
void launch_dequantize(const DequantizeArgs& args, Stored<D>* out, cudaStream_t s) {
  const auto chunks = (args.n + kChunk - 1) / kChunk;
  const bool chunked = args.blocksize % kChunk == 0 && chunks < (std::int64_t{1} << 31) && args.nested_blocksize < (std::int64_t{1} << 31) &&
                       reinterpret_cast<std::uintptr_t>(args.packed) % alignof(uint2) == 0 &&
                       reinterpret_cast<std::uintptr_t>(out) % alignof(uint4) == 0;
  if (chunked) {
    dequantize_chunks_kernel<D><<<grid_for(chunks), kThreads, 0, s>>>(args, static_cast<std::uint32_t>(args.blocksize / kChunk),
                                                                      static_cast<std::uint32_t>(args.nested_blocksize), out);
  } else {
    const bool packed_word_aligned = reinterpret_cast<std::uintptr_t>(args.packed) % sizeof(std::uint32_t) == 0;
    const bool out_vector_aligned = reinterpret_cast<std::uintptr_t>(out) % alignof(uint4) == 0;
    dequantize_kernel<D><<<grid_for((args.n + kPerThread - 1) / kPerThread), kThreads, 0, s>>>(args, packed_word_aligned, out_vector_aligned, out);
  }
}

// Compiled as every kernel of the kit is: what CUDA says of it says what the others were built as.
__global__ void capability_probe_kernel() {}

}  // namespace

int kernels_code_capability() {
  static std::atomic<int> known[kMaxCudaDevices];
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return found_once(known, device, [] {
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, capability_probe_kernel) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    // ptxVersion is the virtual architecture the code came from, whether the device runs its cubin
    // or JIT-compiled its PTX.
    return attributes.ptxVersion > 0 ? attributes.ptxVersion : attributes.binaryVersion;
  });
}

DeviceTraits current_device_traits_of_kernels() { return current_device_traits(); }

const char* dequantize_4bit_cuda(const DequantizeArgs& args, void* out, Dtype out_dtype, void* stream) {
  if (args.n == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (out_dtype) {
    case Dtype::kBFloat16: launch_dequantize<Dtype::kBFloat16>(args, static_cast<std::uint16_t*>(out), s); break;
    case Dtype::kFloat16: launch_dequantize<Dtype::kFloat16>(args, static_cast<std::uint16_t*>(out), s); break;
    default: launch_dequantize<Dtype::kFloat32>(args, static_cast<float*>(out), s); break;
  }
  return launched();
}

namespace {
// One block of 256 threads a quantization block: each thread decodes, updates and codes its value;
// the block's new absmax is a shared-memory reduction between the update and the coding.
__global__ void adamw_8bit_kernel(const AdamW8bitArgs a) {
  __shared__ float maps[2][kAdam8Block];
  __shared__ float m_max[kAdam8Block], v_max[kAdam8Block];
  const int t = static_cast<int>(threadIdx.x);
  maps[0][t] = a.signed_map[t];
  maps[1][t] = a.unsigned_map[t];
  const std::int64_t block = blockIdx.x, i = block * kAdam8Block + t;
  __syncthreads();
  float m = 0, v = 0;
  if (i < a.n) {
    m = mul_rn(maps[0][a.m_codes[i]], a.m_absmax[block]);
    v = mul_rn(maps[1][a.v_codes[i]], a.v_absmax[block]);
    adam8_update(a, i, m, v);
  }
  m_max[t] = fabsf(m);
  v_max[t] = fabsf(v);
  __syncthreads();
  for (int s = kAdam8Block / 2; s > 0; s >>= 1) {
    if (t < s) {
      m_max[t] = fmaxf(m_max[t], m_max[t + s]);
      v_max[t] = fmaxf(v_max[t], v_max[t + s]);
    }
    __syncthreads();
  }
  a.m_codes[i] = adam8_code(maps[0], m, m_max[0]);
  a.v_codes[i] = adam8_code(maps[1], v, v_max[0]);
  if (t == 0) {
    a.m_absmax[block] = m_max[0];
    a.v_absmax[block] = v_max[0];
  }
}
}  // namespace

const char* adamw_8bit_cuda(const AdamW8bitArgs& args, void* stream) {
  if (args.n == 0) return nullptr;
  const std::int64_t blocks = (args.n + kAdam8Block - 1) / kAdam8Block;
  adamw_8bit_kernel<<<static_cast<unsigned>(blocks), kAdam8Block, 0, static_cast<cudaStream_t>(stream)>>>(args);
  return launched();
}

const char* quantize_4bit_cuda(const QuantizeArgs& args, void* stream) {
  if (args.n == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  const std::int64_t blocks = (args.n + args.blocksize - 1) / args.blocksize;
  absmax_kernel<<<grid_for(blocks * 32), kThreads, 0, s>>>(args, blocks);
  if (const char* error = launched()) return error;
  const std::int64_t bytes = (args.n + 1) / 2;
  codes_kernel<<<grid_for(bytes), kThreads, 0, s>>>(args, bytes);
  return launched();
}

}  // namespace loom::kit::detail
