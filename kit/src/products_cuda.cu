// Few-row products (product_kernels.hpp). A warp computes two output features (two lines of
// weights) over the whole input: its lanes stride the input with wide loads of both lines, issued
// together before any arithmetic (4-bit: the blocks' scales with them), so a lane keeps several
// loads in flight and each x value it loads serves both lines. The sums meet by shuffles; nothing
// is written but the finished outputs. Measured on an H200 (8B decode step, bf16 and 4-bit, 1 and
// 4 rows): a warp a task beat splitting each task over 2, 4 or 8 warps every time, by 6 to 40%, and
// 8 steps' loads in flight lost to 4 (5.09 against 4.91 ms at 1 row). At one row a small group
// (a grid of two blocks a multiprocessor or fewer) takes one line a warp instead (launch_rows).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda_elements.cuh"
#include "product_kernels.hpp"

namespace loom::kit::detail {
namespace {

constexpr int kWarps = 8;  // warps a block, a task each
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;  // steps whose loads a thread issues before using them (dense)
constexpr int kCodesUnroll = 2;  // the same for 4-bit steps
constexpr int kCodesStep = 32;  // codes a 4-bit step reads: 16 bytes, one block scale

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
    unpack8<D>(e.w[0], v);
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

// One line a task (not SwiGLU): feature `task` of the group's weights laid end to end.
__device__ __forceinline__ Task single_task_of(const ProductGroup& g, std::int64_t task) {
  int s = 0;
  while (s + 1 < g.count && task >= pick(g.out, s)) {
    task -= pick(g.out, s);
    ++s;
  }
  return Task{{s, s}, {task, task}, false};
}

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

// Lines: 2 (a task reads two lines), or 1 (one line a task: twice the tasks, for one row's groups
// whose pairs would leave the multiprocessors a block or two each).
template <Dtype D, int Rows, int Lines>
__global__ void __launch_bounds__(kThreads)
    dense_products_kernel(const ProductGroup g, const Stored<D>* __restrict__ x, std::int64_t in, std::int64_t tasks) {
  const std::int64_t task = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (task >= tasks) {  // the whole warp
    wait_for_prior_kernels();
    let_next_kernel_start();
    return;
  }
  const int lane = threadIdx.x % 32;
  const Task t = Lines == 2 ? task_of(g, task) : single_task_of(g, task);
  const Stored<D>* line[2];
#pragma unroll
  for (int l = 0; l < 2; ++l) line[l] = static_cast<const Stored<D>*>(pick(g.dense, t.weight[l])) + t.feature[t.second ? l : 0] * in;
  const std::int64_t steps = in / 8;
  float sum[2][Rows] = {};
  bool waiting = true;
  for (std::int64_t first = lane; first < steps; first += 32 * kUnroll) {
    Eight<D> w[2][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (first + 32 * u < steps)
#pragma unroll
        for (int l = 0; l < Lines; ++l) w[l][u] = load_eight<D, true>(line[l] + (first + 32 * u) * 8);
    // The first weights are on their way before x, which the kernel before may still be writing.
    if (waiting) {
      wait_for_prior_kernels();
      let_next_kernel_start();
      waiting = false;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t step = first + 32 * u;
      if (step >= steps) break;
      float wf[2][8];
#pragma unroll
      for (int l = 0; l < Lines; ++l) unpack<D>(w[l][u], wf[l]);
#pragma unroll
      for (int r = 0; r < Rows; ++r) {
        float xf[8];
        unpack<D>(load_eight<D, false>(x + r * in + step * 8), xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          sum[0][r] = fmaf(wf[0][e], xf[e], sum[0][r]);
          if constexpr (Lines == 2) sum[1][r] = fmaf(wf[1][e], xf[e], sum[1][r]);
        }
      }
    }
  }
  reduce_warp<Rows>(sum);
  wait_for_prior_kernels();  // returns at once after the first
  let_next_kernel_start();
  if (lane == 0) finish_task<D, Rows>(g, t, sum);
}

struct Shifts {
  int block[kMaxGroupedWeights];   // log2 of the block size
  int nested[kMaxGroupedWeights];  // log2 of the nested block size (double quantization)
};

__device__ __forceinline__ std::uint32_t word_of(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// The code table by packed byte: entry e holds the values of its high (first) and low nibble, 128
// bytes an entry: 32 copies of a half2 for 16-bit models (the values to fp16's 11 significant bits,
// finer than bfloat16's rounding of each dequantized weight, and fp16's own), 16 of a float2 for
// float32 ones (a 64-bit shared load serves a half-warp a pass). Each lane reads its own copy, so a
// warp's 32 lookups meet no bank conflict, and a byte's offset costs a shift and a logic operation.
template <Dtype D>
using CodePair = typename std::conditional<D == Dtype::kFloat32, float2, __half2>::type;
constexpr int kEntryBytes = 128;
constexpr int kTableBytes = 256 * kEntryBytes;

__device__ __forceinline__ unsigned pair_offset(std::uint32_t word, int b, unsigned lane_offset) {
  const std::uint32_t shifted = b == 0 ? word << 7 : word >> (8 * b - 7);  // byte b to bits 7-14
  return (shifted & 0x7f80u) | lane_offset;
}

template <Dtype D>
__device__ __forceinline__ float2 code_pair(const char* table, unsigned offset) {
  if constexpr (D == Dtype::kFloat32) return *reinterpret_cast<const float2*>(table + offset);
  else return __half22float2(*reinterpret_cast<const __half2*>(table + offset));
}

template <Dtype D>
__device__ __forceinline__ void fill_table(uint4* table, const float* values) {
  for (int i = threadIdx.x; i < kTableBytes / 16; i += kThreads) {
    const int entry = i / (kEntryBytes / 16);
    const float high = values[entry >> 4], low = values[entry & 15];
    if constexpr (D == Dtype::kFloat32) {
      table[i] = make_uint4(__float_as_uint(high), __float_as_uint(low), __float_as_uint(high), __float_as_uint(low));
    } else {
      const __half2 pair = __floats2half2_rn(high, low);
      const std::uint32_t bits = *reinterpret_cast<const std::uint32_t*>(&pair);
      table[i] = make_uint4(bits, bits, bits, bits);
    }
  }
}

// Blocks stay resident and take tasks in turn, so each fills its table once.
template <Dtype D, int Rows, int Unroll>
__global__ void __launch_bounds__(kThreads)
    quantized_products_kernel(const ProductGroup g, const Stored<D>* __restrict__ x, std::int64_t in, std::int64_t tasks, const Shifts shifts) {
  extern __shared__ uint4 pair_table[];
  __shared__ float values[16];
  if (threadIdx.x < 16) values[threadIdx.x] = g.codes[0].values[threadIdx.x];
  __syncthreads();
  fill_table<D>(pair_table, values);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  constexpr unsigned kPairBytes = sizeof(CodePair<D>);
  const unsigned lane_offset = static_cast<unsigned>(lane) % (kEntryBytes / kPairBytes) * kPairBytes;
  const char* table = reinterpret_cast<const char*>(pair_table);
  const std::int64_t steps = in / kCodesStep;
  bool waiting = true;
  for (std::int64_t task = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; task < tasks;
       task += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const Task t = task_of(g, task);
    DequantizeArgs w[2];
    std::int64_t element[2];  // the line's first element in its weight
    int block_shift[2], nested_shift[2];
#pragma unroll
    for (int l = 0; l < 2; ++l) {
      const int s = t.weight[l];
      w[l] = s == 0 ? g.codes[0] : s == 1 ? g.codes[1] : g.codes[2];
      element[l] = t.feature[t.second ? l : 0] * in;
      block_shift[l] = pick(shifts.block, s);
      nested_shift[l] = pick(shifts.nested, s);
    }
    float sum[2][Rows] = {};
    for (std::int64_t first = lane; first < steps; first += 32 * Unroll) {
      uint4 codes[2][Unroll];
      float scale[2][Unroll];
#pragma unroll
      for (int u = 0; u < Unroll; ++u)
        if (first + 32 * u < steps)
#pragma unroll
          for (int l = 0; l < 2; ++l) {
            const std::int64_t start = element[l] + (first + 32 * u) * kCodesStep;
            codes[l][u] = __ldcs(reinterpret_cast<const uint4*>(w[l].packed + start / 2));
            // A step's codes share one block (blocks are a power of two of at least a step); its
            // scale is fetched beside the codes, not after them.
            const std::int64_t block = start >> block_shift[l];
            scale[l][u] = block_scale(w[l], block, block >> nested_shift[l]);
          }
      if (waiting) {  // the first codes are on their way before x is read
        wait_for_prior_kernels();
        let_next_kernel_start();
        waiting = false;
      }
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const std::int64_t step = first + 32 * u;
        if (step >= steps) break;
        float part[2][Rows] = {};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float v[2][8];
#pragma unroll
          for (int l = 0; l < 2; ++l) {
            const std::uint32_t word = word_of(codes[l][u], k);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              const float2 pair = code_pair<D>(table, pair_offset(word, b, lane_offset));
              v[l][2 * b] = pair.x;
              v[l][2 * b + 1] = pair.y;
            }
          }
#pragma unroll
          for (int r = 0; r < Rows; ++r) {
            float xf[8];
            unpack<D>(load_eight<D, false>(x + r * in + step * kCodesStep + 8 * k), xf);
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
    wait_for_prior_kernels();  // returns at once after the first
    if (lane == 0) finish_task<D, Rows>(g, t, sum);
  }
  // Warps that had no task, or no step of one, let the next kernel start too (after their wait).
  wait_for_prior_kernels();
  let_next_kernel_start();
}

int log2_exact(std::int64_t v) {  // -1 unless v is a power of two
  if (v <= 0 || (v & (v - 1)) != 0) return -1;
  int shift = 0;
  while ((std::int64_t{1} << shift) < v) ++shift;
  return shift;
}


std::int64_t task_count(const ProductGroup& g) {
  if (g.finish == ProductFinish::kSwiGLU) return g.out[0];
  std::int64_t tasks = 0;
  for (int s = 0; s < g.count; ++s) tasks += (g.out[s] + 1) / 2;
  return tasks;
}

constexpr int kMaxDevices = 64;

// How many blocks of `Kernel` (with kTableBytes of dynamic shared memory) the current device holds
// at once, found once per device; 0 if CUDA cannot say.
template <auto Kernel>
unsigned resident_blocks() {
  static std::atomic<unsigned> known[kMaxDevices];  // zero: static storage
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  if (const unsigned n = known[device].load(std::memory_order_relaxed)) return n;
  static_assert(kTableBytes <= 48 * 1024, "past 48 KB a kernel must opt in (cudaFuncAttributeMaxDynamicSharedMemorySize)");
  int per_sm = 0;
  const int sms = current_device_attribute<cudaDevAttrMultiProcessorCount>();
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, kTableBytes) != cudaSuccess || per_sm < 1 || sms < 1) return 0;
  const unsigned n = static_cast<unsigned>(per_sm * sms);
  known[device].store(n, std::memory_order_relaxed);
  return n;
}

template <Dtype D, int Rows, int Unroll>
cudaError_t launch_quantized(const ProductGroup& g, const Stored<D>* x, std::int64_t in, std::int64_t tasks, cudaStream_t stream) {
  Shifts shifts{};
  for (int s = 0; s < g.count; ++s) {
    shifts.block[s] = log2_exact(g.codes[s].blocksize);
    shifts.nested[s] = g.codes[s].absmax != nullptr ? 0 : log2_exact(g.codes[s].nested_blocksize);
  }
  constexpr auto kKernel = quantized_products_kernel<D, Rows, Unroll>;
  const unsigned resident = resident_blocks<kKernel>();
  if (resident == 0) {
    const cudaError_t e = cudaGetLastError();  // what the occupancy query met, if CUDA said
    return e != cudaSuccess ? e : cudaErrorInvalidConfiguration;
  }
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((tasks + kWarps - 1) / kWarps, resident));
  return overlapped_launch(kKernel, dim3(blocks), dim3(kThreads), kTableBytes, stream, g, x, in, tasks, shifts);
}

template <Dtype D, int Rows>
cudaError_t launch_rows(const ProductGroup& g, const void* x, std::int64_t in, cudaStream_t stream) {
  const std::int64_t tasks = task_count(g);
  const auto* xs = static_cast<const Stored<D>*>(x);
  if (g.quantized) return launch_quantized<D, Rows, kCodesUnroll>(g, xs, in, tasks, stream);
  const auto blocks = static_cast<unsigned>((tasks + kWarps - 1) / kWarps);
  // At one row, pairs of lines in at most two blocks a multiprocessor (the 8B's o and down: 256
  // blocks on 132) leave each a few warps and stream at 2.0 to 2.4 TB/s (ncu, H200) where gate/up's
  // 1,792 blocks reach 3.5: such groups take one line a task, twice the blocks (the 8B step 4.65 ->
  // 4.56 ms; at 4 rows 5.85 -> 5.92, so not there).
  if constexpr (Rows == 1) {
    const int sms = current_device_attribute<cudaDevAttrMultiProcessorCount>();
    if (g.finish != ProductFinish::kSwiGLU && sms > 0 && blocks <= 2u * static_cast<unsigned>(sms)) {
      std::int64_t lines = 0;
      for (int s = 0; s < g.count; ++s) lines += g.out[s];
      return overlapped_launch(dense_products_kernel<D, Rows, 1>, dim3(static_cast<unsigned>((lines + kWarps - 1) / kWarps)), dim3(kThreads), 0,
                               stream, g, xs, in, lines);
    }
  }
  return overlapped_launch(dense_products_kernel<D, Rows, 2>, dim3(blocks), dim3(kThreads), 0, stream, g, xs, in, tasks);
}

template <Dtype D>
cudaError_t launch(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, cudaStream_t stream) {
  static_assert(kFewRowsMax == 4, "one instantiation per row count");
  switch (rows) {
    case 1: return launch_rows<D, 1>(g, x, in, stream);
    case 2: return launch_rows<D, 2>(g, x, in, stream);
    case 3: return launch_rows<D, 3>(g, x, in, stream);
    default: return launch_rows<D, 4>(g, x, in, stream);
  }
}

}  // namespace

bool few_row_products_supported(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, Dtype dtype) {
  (void)dtype;
  if (rows < 1 || rows > kFewRowsMax || in <= 0 || in % 8 != 0 || !aligned_words(x) || g.count < 1 || g.count > kMaxGroupedWeights) return false;
  if (g.quantized && in % kCodesStep != 0) return false;
  if (g.finish == ProductFinish::kSwiGLU && (g.count != 2 || g.out[0] != g.out[1])) return false;
  if (g.finish == ProductFinish::kAddResidual && (g.count != 1 || g.residual == nullptr)) return false;
  for (int s = 0; s < g.count; ++s) {
    if (g.out[s] < 1 || (g.y[s] == nullptr && (s == 0 || g.finish != ProductFinish::kSwiGLU))) return false;
    if (!g.quantized) {
      if (g.dense[s] == nullptr || !aligned_words(g.dense[s])) return false;
      continue;
    }
    const DequantizeArgs& c = g.codes[s];
    if (c.n != g.out[s] * in || c.blocksize < kCodesStep || log2_exact(c.blocksize) < 0 || !aligned_words(c.packed)) return false;
    if (c.absmax == nullptr && log2_exact(c.nested_blocksize) < 0) return false;
    // One table serves the group: every weight's codes stand for the same values.
    for (int v = 0; v < 16; ++v)
      if (c.values[v] != g.codes[0].values[v]) return false;
  }
  return true;
}

const char* few_row_products_cuda(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, Dtype dtype, void* stream) {
  if (!few_row_products_supported(g, x, rows, in, dtype)) return "few_row_products_cuda called outside what it supports";
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e = dtype == Dtype::kBFloat16 ? launch<Dtype::kBFloat16>(g, x, rows, in, s)
                  : dtype == Dtype::kFloat16 ? launch<Dtype::kFloat16>(g, x, rows, in, s)
                                             : launch<Dtype::kFloat32>(g, x, rows, in, s);
  if (e == cudaSuccess) e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace loom::kit::detail
