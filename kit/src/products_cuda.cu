// Few-row products (product_kernels.hpp). A warp computes two output features (two lines of
// weights) over the whole input: its lanes stride the input with wide loads of both lines, issued
// together before any arithmetic (4-bit: the blocks' scales with them), so a lane keeps several
// loads in flight and each x value it loads serves both lines. The sums meet by shuffles; nothing
// is written but the finished outputs. Measured on an H200 (8B decode step, bf16 and 4-bit, 1 and
// 4 rows): a warp a task beat splitting each task over 4 or 8 warps every time, by 7 to 40%.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_elements.cuh"
#include "product_kernels.hpp"

namespace loom::kit::detail {
namespace {

constexpr int kWarps = 8;  // warps a block, a task each
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;  // steps whose loads a thread issues before using them (dense)
// 4-bit: the code table's shared-memory reads, not DRAM, bound it; fewer registers (more warps to
// hide them) beat more loads in flight: 2 steps took an 8B step from 4.83 to 4.50 ms, 8 to 4.91.
constexpr int kCodesUnroll = 2;
constexpr int kCodesStep = 16;  // codes a 4-bit step reads: 8 bytes, one block scale

// Eight consecutive elements as 16-byte words: one for 16-bit dtypes, two for float32.
template <Dtype D>
struct Eight {
  uint4 w[sizeof(Stored<D>) / 2];
};

// Weights stream through once (no reason to keep them in L1 beside x); x is read by every warp.
template <Dtype D, bool Streaming>
__device__ __forceinline__ Eight<D> load_eight(const Stored<D>* p) {
  Eight<D> e;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(e.w) / sizeof(uint4)); ++i)
    e.w[i] = Streaming ? __ldcs(reinterpret_cast<const uint4*>(p) + i) : __ldg(reinterpret_cast<const uint4*>(p) + i);
  return e;
}

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
__device__ __forceinline__ void unpack(const Eight<D>& e, float (&v)[8]) {
  if constexpr (D == Dtype::kFloat32) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      v[4 * i] = __uint_as_float(e.w[i].x);
      v[4 * i + 1] = __uint_as_float(e.w[i].y);
      v[4 * i + 2] = __uint_as_float(e.w[i].z);
      v[4 * i + 3] = __uint_as_float(e.w[i].w);
    }
  } else {
    unpack_pair(e.w[0].x, D, v[0], v[1]);
    unpack_pair(e.w[0].y, D, v[2], v[3]);
    unpack_pair(e.w[0].z, D, v[4], v[5]);
    unpack_pair(e.w[0].w, D, v[6], v[7]);
  }
}

template <class T>
__device__ __forceinline__ T pick(const T (&of)[kMaxGroupedWeights], int s) {
  // Constant indices: a kernel parameter indexed by a register is copied to local memory first.
  return s == 0 ? of[0] : s == 1 ? of[1] : of[2];
}

// The two lines a block reads: features `feature[l]` of weights `weight[l]`; the second absent at
// the odd end of a weight. SwiGLU pairs gate and up of one feature.
struct Task {
  int weight[2];
  std::int64_t feature[2];
  bool second;
};

__device__ __forceinline__ Task task_of(const ProductGroup& g, std::int64_t task) {
  if (g.finish == ProductFinish::kSwiGLU) return Task{{0, 1}, {task, task}, true};
  int s = 0;
  std::int64_t pairs = (g.out[0] + 1) / 2;
  while (s + 1 < g.count && task >= pairs) {
    task -= pairs;
    ++s;
    pairs = (pick(g.out, s) + 1) / 2;
  }
  const std::int64_t out = pick(g.out, s);
  return Task{{s, s}, {2 * task, 2 * task + 1}, 2 * task + 1 < out};
}

template <Dtype D, int Rows>
__device__ __forceinline__ void finish_task(const ProductGroup& g, const Task& t, const float (&sum)[2][Rows]) {
  if (g.finish == ProductFinish::kSwiGLU) {
    const std::int64_t out = g.out[0], f = t.feature[0];
#pragma unroll
    for (int r = 0; r < Rows; ++r) {
      const float gate = rounded<D>(sum[0][r]), up = rounded<D>(sum[1][r]);
      const float act = rounded<D>(gate / (1.0f + expf(-gate)));
      static_cast<Stored<D>*>(g.y[0])[r * out + f] = convert<D>(act * up);
    }
    return;
  }
#pragma unroll
  for (int l = 0; l < 2; ++l) {
    if (l == 1 && !t.second) break;
    const std::int64_t out = pick(g.out, t.weight[l]), f = t.feature[l];
    Stored<D>* y = static_cast<Stored<D>*>(pick(g.y, t.weight[l]));
#pragma unroll
    for (int r = 0; r < Rows; ++r) {
      float v = sum[l][r];
      if (g.finish == ProductFinish::kAddResidual) v = rounded<D>(v) + load<D>(static_cast<const Stored<D>*>(g.residual), r * out + f);
      y[r * out + f] = convert<D>(v);
    }
  }
}

// A task's sums, in every lane of its warp.
template <int Rows>
__device__ __forceinline__ void reduce_warp(float (&sum)[2][Rows]) {
#pragma unroll
  for (int l = 0; l < 2; ++l)
#pragma unroll
    for (int r = 0; r < Rows; ++r) sum[l][r] = warp_sum(sum[l][r]);
}

template <Dtype D, int Rows>
__global__ void __launch_bounds__(kThreads)
    dense_products_kernel(const ProductGroup g, const Stored<D>* __restrict__ x, std::int64_t in, std::int64_t tasks) {
  const std::int64_t task = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (task >= tasks) return;  // the whole warp
  const int lane = threadIdx.x % 32;
  const Task t = task_of(g, task);
  const Stored<D>* line[2];
#pragma unroll
  for (int l = 0; l < 2; ++l) line[l] = static_cast<const Stored<D>*>(pick(g.dense, t.weight[l])) + t.feature[t.second ? l : 0] * in;
  float sum[2][Rows] = {};
  const std::int64_t steps = in / 8;
  for (std::int64_t first = lane; first < steps; first += 32 * kUnroll) {
    Eight<D> w[2][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (first + 32 * u < steps)
#pragma unroll
        for (int l = 0; l < 2; ++l) w[l][u] = load_eight<D, true>(line[l] + (first + 32 * u) * 8);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t step = first + 32 * u;
      if (step >= steps) break;
      float wf[2][8];
      unpack<D>(w[0][u], wf[0]);
      unpack<D>(w[1][u], wf[1]);
#pragma unroll
      for (int r = 0; r < Rows; ++r) {
        float xf[8];
        unpack<D>(load_eight<D, false>(x + r * in + step * 8), xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          sum[0][r] = fmaf(wf[0][e], xf[e], sum[0][r]);
          sum[1][r] = fmaf(wf[1][e], xf[e], sum[1][r]);
        }
      }
    }
  }
  reduce_warp<Rows>(sum);
  if (lane == 0) finish_task<D, Rows>(g, t, sum);
}

struct Shifts {
  int block[kMaxGroupedWeights];   // log2 of the block size
  int nested[kMaxGroupedWeights];  // log2 of the nested block size (double quantization)
};

template <Dtype D, int Rows, int Unroll>
__global__ void __launch_bounds__(kThreads)
    quantized_products_kernel(const ProductGroup g, const Stored<D>* __restrict__ x, std::int64_t in, std::int64_t tasks, const Shifts shifts) {
  // The code values, one copy per lane (lane i's in bank i): 32 lanes looking up 32 codes never
  // wait on each other.
  __shared__ float table[kMaxGroupedWeights][16 * 32];
  for (int i = threadIdx.x; i < g.count * 16 * 32; i += blockDim.x) {
    const int s = i / (16 * 32), code = (i % (16 * 32)) / 32;
    table[s][i % (16 * 32)] = s == 0 ? g.codes[0].values[code] : s == 1 ? g.codes[1].values[code] : g.codes[2].values[code];
  }
  __syncthreads();
  const std::int64_t task = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (task >= tasks) return;
  const int lane = threadIdx.x % 32;
  const Task t = task_of(g, task);
  DequantizeArgs w[2];
  std::int64_t element[2];  // the line's first element in its weight
  int block_shift[2], nested_shift[2];
  const float* lookup[2];
#pragma unroll
  for (int l = 0; l < 2; ++l) {
    const int s = t.weight[l];
    w[l] = s == 0 ? g.codes[0] : s == 1 ? g.codes[1] : g.codes[2];
    element[l] = t.feature[t.second ? l : 0] * in;
    block_shift[l] = pick(shifts.block, s);
    nested_shift[l] = pick(shifts.nested, s);
    lookup[l] = table[s] + lane;
  }
  float sum[2][Rows] = {};
  const std::int64_t steps = in / kCodesStep;
  for (std::int64_t first = lane; first < steps; first += 32 * Unroll) {
    uint2 codes[2][Unroll];
    float scale[2][Unroll];
#pragma unroll
    for (int u = 0; u < Unroll; ++u)
      if (first + 32 * u < steps)
#pragma unroll
        for (int l = 0; l < 2; ++l) {
          const std::int64_t start = element[l] + (first + 32 * u) * kCodesStep;
          codes[l][u] = __ldcs(reinterpret_cast<const uint2*>(w[l].packed + start / 2));
          // The 16 codes share one block (blocks are a power of two of at least 16); its scale is
          // fetched beside the codes, not after them.
          const std::int64_t block = start >> block_shift[l];
          scale[l][u] = block_scale(w[l], block, block >> nested_shift[l]);
        }
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const std::int64_t step = first + 32 * u;
      if (step >= steps) break;
      float part[2][Rows] = {};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[2][8];
#pragma unroll
        for (int l = 0; l < 2; ++l) {
          const std::uint32_t word = h == 0 ? codes[l][u].x : codes[l][u].y;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const std::uint32_t byte = (word >> (8 * b)) & 0xffu;
            v[l][2 * b] = lookup[l][(byte >> 4) * 32];
            v[l][2 * b + 1] = lookup[l][(byte & 15u) * 32];
          }
        }
#pragma unroll
        for (int r = 0; r < Rows; ++r) {
          float xf[8];
          unpack<D>(load_eight<D, false>(x + r * in + step * kCodesStep + 8 * h), xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            part[0][r] = fmaf(v[0][e], xf[e], part[0][r]);
            part[1][r] = fmaf(v[1][e], xf[e], part[1][r]);
          }
        }
      }
#pragma unroll
      for (int l = 0; l < 2; ++l)
#pragma unroll
        for (int r = 0; r < Rows; ++r) sum[l][r] = fmaf(part[l][r], scale[l][u], sum[l][r]);
    }
  }
  reduce_warp<Rows>(sum);
  if (lane == 0) finish_task<D, Rows>(g, t, sum);
}

int log2_exact(std::int64_t v) {  // -1 unless v is a power of two
  if (v <= 0 || (v & (v - 1)) != 0) return -1;
  int shift = 0;
  while ((std::int64_t{1} << shift) < v) ++shift;
  return shift;
}

bool aligned(const void* p, std::size_t to) { return reinterpret_cast<std::uintptr_t>(p) % to == 0; }

std::int64_t task_count(const ProductGroup& g) {
  if (g.finish == ProductFinish::kSwiGLU) return g.out[0];
  std::int64_t tasks = 0;
  for (int s = 0; s < g.count; ++s) tasks += (g.out[s] + 1) / 2;
  return tasks;
}

template <Dtype D, int Rows>
void launch_rows(const ProductGroup& g, const void* x, std::int64_t in, cudaStream_t stream) {
  const std::int64_t tasks = task_count(g);
  const auto blocks = static_cast<unsigned>((tasks + kWarps - 1) / kWarps);
  const auto* xs = static_cast<const Stored<D>*>(x);
  if (!g.quantized) {
    dense_products_kernel<D, Rows><<<blocks, kThreads, 0, stream>>>(g, xs, in, tasks);
    return;
  }
  Shifts shifts{};
  for (int s = 0; s < g.count; ++s) {
    shifts.block[s] = log2_exact(g.codes[s].blocksize);
    shifts.nested[s] = g.codes[s].absmax != nullptr ? 0 : log2_exact(g.codes[s].nested_blocksize);
  }
  quantized_products_kernel<D, Rows, kCodesUnroll><<<blocks, kThreads, 0, stream>>>(g, xs, in, tasks, shifts);
}

template <Dtype D>
void launch(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, cudaStream_t stream) {
  static_assert(kFewRowsMax == 4, "one instantiation per row count");
  switch (rows) {
    case 1: launch_rows<D, 1>(g, x, in, stream); break;
    case 2: launch_rows<D, 2>(g, x, in, stream); break;
    case 3: launch_rows<D, 3>(g, x, in, stream); break;
    default: launch_rows<D, 4>(g, x, in, stream); break;
  }
}

}  // namespace

bool few_row_products_supported(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, Dtype dtype) {
  (void)dtype;
  if (rows < 1 || rows > kFewRowsMax || in <= 0 || in % kCodesStep != 0 || !aligned(x, 16) || g.count < 1 || g.count > kMaxGroupedWeights) return false;
  if (g.finish == ProductFinish::kSwiGLU && (g.count != 2 || g.out[0] != g.out[1])) return false;
  if (g.finish == ProductFinish::kAddResidual && (g.count != 1 || g.residual == nullptr)) return false;
  for (int s = 0; s < g.count; ++s) {
    if (g.out[s] < 1 || (g.y[s] == nullptr && (s == 0 || g.finish != ProductFinish::kSwiGLU))) return false;
    if (!g.quantized) {
      if (g.dense[s] == nullptr || !aligned(g.dense[s], 16)) return false;
      continue;
    }
    const DequantizeArgs& c = g.codes[s];
    if (c.n != g.out[s] * in || c.blocksize < kCodesStep || log2_exact(c.blocksize) < 0 || !aligned(c.packed, 8)) return false;
    if (c.absmax == nullptr && log2_exact(c.nested_blocksize) < 0) return false;
  }
  return true;
}

const char* few_row_products_cuda(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, Dtype dtype, void* stream) {
  if (!few_row_products_supported(g, x, rows, in, dtype)) return "few_row_products_cuda called outside what it supports";
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kBFloat16: launch<Dtype::kBFloat16>(g, x, rows, in, s); break;
    case Dtype::kFloat16: launch<Dtype::kFloat16>(g, x, rows, in, s); break;
    default: launch<Dtype::kFloat32>(g, x, rows, in, s); break;
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace loom::kit::detail
