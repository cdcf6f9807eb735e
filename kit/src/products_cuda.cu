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
#include <limits>
#include <type_traits>

#include "cuda_elements.cuh"
#include "product_kernels.hpp"

namespace loom::kit::detail {
namespace {

constexpr int kWarps = kProductWarps;
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

// One output: y[s] at row r and feature f from its sum (SwiGLU: s 0, gate's sum and up's).
template <Dtype D>
__device__ __forceinline__ void finish_output(const ProductGroup& g, int s, std::int64_t f, int r, float sum, float up_sum) {
  const std::int64_t out = pick(g.out, s);
  Stored<D>* y = static_cast<Stored<D>*>(pick(g.y, s));
  if (g.finish == ProductFinish::kSwiGLU) {
    const float gate = rounded<D>(sum), up = rounded<D>(up_sum);
    y[r * out + f] = convert<D>(rounded<D>(gate / (1.0f + expf(-gate))) * up);
    return;
  }
  if (g.finish == ProductFinish::kAddResidual) sum = rounded<D>(sum) + load<D>(static_cast<const Stored<D>*>(g.residual), r * out + f);
  y[r * out + f] = convert<D>(sum);
}

template <Dtype D, int Rows>
__device__ __forceinline__ void finish_task(const ProductGroup& g, const Task& t, const float (&sum)[2][Rows]) {
  if (g.finish == ProductFinish::kSwiGLU) {
#pragma unroll
    for (int r = 0; r < Rows; ++r) finish_output<D>(g, 0, t.feature[0], r, sum[0][r], sum[1][r]);
    return;
  }
#pragma unroll
  for (int l = 0; l < 2; ++l) {
    if (l == 1 && !t.second) break;
#pragma unroll
    for (int r = 0; r < Rows; ++r) finish_output<D>(g, t.weight[l], t.feature[l], r, sum[l][r], 0);
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

// Pair: the dtype of the table's values (the lanes' kernel: float32, or fp16 for 16-bit models; the
// tiles: the model's own, as the mma reads it).
// Stride: bytes from entry to entry (the copies take the first 128).
template <Dtype Pair, int Stride = kEntryBytes>
__device__ __forceinline__ void fill_table(uint4* table, const float* values) {
  for (int i = threadIdx.x; i < kTableBytes / 16; i += kThreads) {
    const int entry = i / (kEntryBytes / 16);
    const float high = values[entry >> 4], low = values[entry & 15];
    uint4& to = table[entry * (Stride / 16) + i % (kEntryBytes / 16)];
    if constexpr (Pair == Dtype::kFloat32) {
      to = make_uint4(__float_as_uint(high), __float_as_uint(low), __float_as_uint(high), __float_as_uint(low));
    } else {
      const std::uint32_t bits = pack_pair<Pair>(high, low);
      to = make_uint4(bits, bits, bits, bits);
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
  fill_table<D == Dtype::kFloat32 ? Dtype::kFloat32 : Dtype::kFloat16>(pair_table, values);
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
      w[l] = pick(g.codes, s);
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

// Tensor-core tiles (16-bit dtypes, compute capability 8 on; dense from 3 rows, 4-bit from 1: the
// kernel table, loom/kit/kernels.hpp): a block computes 16 features (one mma.m16n8k16 tile; SwiGLU: 16 of gate and 16 of up) for every
// row of x, its 8 warps splitting the input and meeting in shared memory. A product is a sum over
// the input, so the order in which a tile takes the input's elements is free as long as weights and
// x take the same one: lane (group, quad) feeds the mma's slots 2 quad, 2 quad + 1, 2 quad + 8 and
// 2 quad + 9 from 16 bytes of its rows' weights (dense) or 8 or 16 bytes of their codes (4-bit), and
// x from the same elements, so nothing is shuffled. The work per weight does not grow with rows as
// the lanes' own products (1 FMA a row) do.
constexpr int kTileFeatures = 16;

// D += A B for one 16 x 8 x 16 tile, A and B as the dtype's pairs, D in float32.
template <Dtype D>
__device__ __forceinline__ void mma_tile(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2, std::uint32_t a3, std::uint32_t b0,
                                         std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (D == Dtype::kBFloat16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// The 16 features a tile computes: from `first` of weight `weight[l]` for each of its lines.
struct FeatureTile {
  int weight[2];
  std::int64_t first;
};

__device__ __forceinline__ FeatureTile feature_tile_of(const ProductGroup& g, std::int64_t tile) {
  if (g.finish == ProductFinish::kSwiGLU) return FeatureTile{{0, 1}, tile * kTileFeatures};
  int s = 0;
  std::int64_t tiles = (g.out[0] + kTileFeatures - 1) / kTileFeatures;
  while (s + 1 < g.count && tile >= tiles) {
    tile -= tiles;
    ++s;
    tiles = (pick(g.out, s) + kTileFeatures - 1) / kTileFeatures;
  }
  return FeatureTile{{s, s}, tile * kTileFeatures};
}

// A lane's two rows of weights in a tile: features group and group + 8 (the last feature past the
// end of the weight: read, never written).
__device__ __forceinline__ void tile_rows(const ProductGroup& g, const FeatureTile& t, int line, int group, std::int64_t (&feature)[2]) {
  const std::int64_t last = pick(g.out, t.weight[line]) - 1;
  feature[0] = min(t.first + group, last);
  feature[1] = min(t.first + group + 8, last);
}

// A warp's share of its block's tiles: the block's warps make teams of `team` warps (8, 4 or 2), each
// team on tiles of its own, and a warp takes steps begin to end of each of its team's tiles (of
// `per`, some past the input, so that every warp meets its team at each tile's end), `items` steps in
// all. The team's tiles are first_tile, first_tile + tile_stride, ...
struct WarpSlice {
  std::int64_t per, begin, end, items, first_tile, tile_stride;
  int team, first_warp;  // the team's size and its first warp in the block
};
__device__ __forceinline__ WarpSlice warp_slice(std::int64_t in, int step_inputs, std::int64_t tiles, int team = kWarps) {
  const int warp = threadIdx.x / 32, teams = kWarps / team;
  const std::int64_t steps = (in + step_inputs - 1) / step_inputs, per = (steps + team - 1) / team, begin = warp % team * per;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * teams + warp / team, stride = static_cast<std::int64_t>(gridDim.x) * teams;
  const std::int64_t team_tiles = tiles > first ? (tiles - first + stride - 1) / stride : 0;
  return WarpSlice{per, begin, min(begin + per, steps), team_tiles * per, first, stride, team, warp - warp % team};
}

// Every warp of the slice's team (a named barrier each, so teams never wait on one another).
__device__ __forceinline__ void sync_team(const WarpSlice& w) {
  if (w.team == kWarps) {
    __syncthreads();
    return;
  }
  // Immediate barrier numbers: with a register one, ptxas reserves all 16 of a block's.
  const int threads = w.team * 32;
  switch (w.first_warp / w.team) {
    case 0: asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory"); break;
    case 1: asm volatile("bar.sync 2, %0;" ::"r"(threads) : "memory"); break;
    case 2: asm volatile("bar.sync 3, %0;" ::"r"(threads) : "memory"); break;
    default: asm volatile("bar.sync 4, %0;" ::"r"(threads) : "memory"); break;
  }
}

// A thread an output: the smallest team (2 warps) has a thread for each of a tile's features at
// every row count the products take.
static_assert(kTileFeatures * kFewRowsMax <= 2 * 32, "a team of 2 warps finishes a tile's outputs");

// The team's sums of a tile meet in shared memory; a thread an output finishes it. `acc` is the
// mma's D: features group (0, 1) and group + 8 (2, 3), rows 2 quad and 2 quad + 1.
template <Dtype D, int Rows, int Lines>
__device__ __forceinline__ void finish_tile(const ProductGroup& g, const FeatureTile& t, const float (&acc)[Lines][4],
                                            float (*partial)[Lines][kTileFeatures * 8], const WarpSlice& ws) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  if (2 * quad < Rows)
#pragma unroll
    for (int l = 0; l < Lines; ++l) {
      float* p = partial[warp][l];
      p[group * 8 + 2 * quad] = acc[l][0];
      p[group * 8 + 2 * quad + 1] = acc[l][1];
      p[(group + 8) * 8 + 2 * quad] = acc[l][2];
      p[(group + 8) * 8 + 2 * quad + 1] = acc[l][3];
    }
  sync_team(ws);
  const int local = static_cast<int>(threadIdx.x) - ws.first_warp * 32;
  if (local < kTileFeatures * Rows) {
    const int f = local / Rows, r = local % Rows;
    float sum[2] = {};
#pragma unroll
    for (int l = 0; l < Lines; ++l)
      for (int w = 0; w < ws.team; ++w) sum[l] += partial[ws.first_warp + w][l][f * 8 + r];
    if (t.first + f < pick(g.out, t.weight[0])) finish_output<D>(g, t.weight[0], t.first + f, r, sum[0], sum[1]);
  }
  sync_team(ws);  // the partials are read before the next tile writes them
}

// Where a warp is in its slice: a tile of its block and a step of it. The loads run ahead of the
// products, each with a cursor of its own.
struct TileCursor {
  std::int64_t tile, step;
  __device__ __forceinline__ bool at_tile_end(const WarpSlice& w) const { return step + 1 == w.begin + w.per; }
  // Goes to the next step; true where that starts the next tile.
  __device__ __forceinline__ bool advance(const WarpSlice& w) {
    if (!at_tile_end(w)) {
      ++step;
      return false;
    }
    step = w.begin;
    tile += w.tile_stride;
    return true;
  }
};

// After a warp's step: at the last of a tile the warps' sums meet, and it goes on. SumQuads: each
// quad held a part of its features' sums (the 4-bit kBlocks tiles), which meet in quad 0 first.
template <Dtype D, int Rows, int Lines, bool SumQuads = false>
__device__ __forceinline__ void next_step(const ProductGroup& g, float (&acc)[Lines][4], float (*partial)[Lines][kTileFeatures * 8], const WarpSlice& w,
                                          TileCursor& at) {
  if (at.at_tile_end(w)) {
    if constexpr (SumQuads)
#pragma unroll
      for (int l = 0; l < Lines; ++l)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[l][i] += __shfl_xor_sync(0xffffffffu, acc[l][i], 1);
          acc[l][i] += __shfl_xor_sync(0xffffffffu, acc[l][i], 2);
        }
    finish_tile<D, Rows, Lines>(g, feature_tile_of(g, at.tile), acc, partial, w);
#pragma unroll
    for (int l = 0; l < Lines; ++l) acc[l][0] = acc[l][1] = acc[l][2] = acc[l][3] = 0;
  }
  at.advance(w);
}

// x's row `group` at input k: eight elements (dense) or sixteen (4-bit), zero for rows past Rows
// (the mma's columns no output reads) and for elements past the input.
template <int Rows, int Words>
__device__ __forceinline__ void load_x(const std::uint16_t* x, std::int64_t in, int group, std::int64_t k, std::uint32_t (&words)[Words]) {
#pragma unroll
  for (int i = 0; i < Words / 4; ++i) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (group < Rows && k < in) v = __ldg(reinterpret_cast<const uint4*>(x + group * in + k) + i);
    words[4 * i] = v.x;
    words[4 * i + 1] = v.y;
    words[4 * i + 2] = v.z;
    words[4 * i + 3] = v.w;
  }
}

// How a 4-bit tile spends the mma's 8 columns. The mma sums its 16 inputs' products, and the
// block's scale multiplies that sum afterwards, so the inputs one column sums must share a block.
enum class TileColumns {
  // Column r is x's row r (3 or 4 rows), fed by the lanes of group r: a step is 16 codes a lane a
  // row, the quads' 64 codes of a feature in one block (blocks of at least 64).
  kRows,
  // Columns 2q and 2q + 1 are quad q's, x's rows 0 and 1 (1 or 2 rows): a step is 32 codes a lane a
  // row (one 16-byte load), in one block (blocks of at least 32), and lane (group, quad) feeds
  // column `group` with x where that column is its own quad's and zeros elsewhere, so each column
  // sums one block's products. Six of the 8 columns (7 at one row) carry nothing, which costs the
  // mma no more issues; the quads' sums meet by shuffles at the tile's end.
  kBlocks,
};

// A zero x for the lanes whose columns are not their quad's (kBlocks): one load address for all.
__device__ uint4 zero_inputs[8];

// 4-bit tiles: a lane's step is the codes of each of its two rows and what their blocks' scales are
// made from. Double quantization's map lookup waits for the product: made at load time, it would
// hold the warp's next loads behind the code byte's whole latency.
template <Dtype D, int Lines, TileColumns Columns>
struct CodeTiles {
  static constexpr bool kBlocks = Columns == TileColumns::kBlocks;
  static constexpr int kLaneCodes = kBlocks ? 32 : 16;  // codes a lane's step takes of a row
  static constexpr int kStep = 4 * kLaneCodes;          // inputs a warp's step takes
  static constexpr int kWords = kLaneCodes / 8;         // 32-bit words of codes a lane a row
  static constexpr int kUnroll = (kBlocks ? 2 : 4) / Lines;  // 2 KB in flight (registers bound it)
  // The table's entries 256 bytes apart (kBlocks), so one byte permutation makes a lookup's offset
  // from its code byte and the lane's copy; 128 apart, a shift and a logic operation.
  static constexpr int kEntryStride = kBlocks ? 256 : kEntryBytes;
  static constexpr int kTableSharedBytes = 256 * kEntryStride;
  static constexpr bool kQuadsSplitFeatures = kBlocks;
  struct Loaded {
    std::uint32_t codes[Lines][2][kWords];
    float scale[Lines][2];        // the block's scale, or its nested block's absmax
    std::uint32_t code[Lines][2]; // double quantization: the scale's code on the nested map
    int weight;                   // one line's (SwiGLU's two lines are weights 0 and 1)
  };
  const std::uint8_t* packed[Lines];
  const float* scales[Lines];             // absmax, or nested_absmax with double quantization
  const std::uint8_t* scale_codes[Lines];  // absmax_codes, or null
  // The first element of each of the lane's rows, this lane's part (SwiGLU's lines alike), in 32
  // bits (the kernel table): a step's addresses then cost a few 32-bit operations, not 64-bit shifts.
  std::uint32_t element[2];
  std::int64_t lane_end;  // kBlocks: steps from this one on have no codes of this lane's
  int weight[Lines], block_shift[Lines], nested_shift[Lines];

  __device__ __forceinline__ CodeTiles(const ProductGroup& g, const FeatureTile& t, std::int64_t in, int group, int quad, const Shifts& shifts) {
#pragma unroll
    for (int l = 0; l < Lines; ++l) {
      const int s = t.weight[l];
      weight[l] = s;
      const DequantizeArgs c = pick(g.codes, s);
      packed[l] = c.packed;
      scales[l] = c.absmax != nullptr ? c.absmax : c.nested_absmax;
      scale_codes[l] = c.absmax != nullptr ? nullptr : c.absmax_codes;
      block_shift[l] = pick(shifts.block, s);
      nested_shift[l] = pick(shifts.nested, s);
    }
    std::int64_t feature[2];
    tile_rows(g, t, 0, group, feature);
    element[0] = static_cast<std::uint32_t>(feature[0] * in + kLaneCodes * quad);
    element[1] = static_cast<std::uint32_t>(feature[1] * in + kLaneCodes * quad);
    lane_end = kBlocks ? (in - kLaneCodes * quad + kStep - 1) / kStep : 0;
  }
  // The code table: entry e holds the dtype's pair (value of e's high nibble, of its low one),
  // first element in the low half as the mma reads it, 32 copies as in pair_table; beside it each
  // weight's nested map.
  __device__ static float (&nested_maps())[kMaxGroupedWeights][256] {
    __shared__ float maps[kMaxGroupedWeights][256];
    return maps;
  }
  __device__ static const char* prepare(const ProductGroup& g, uint4* table) {
    __shared__ float values[16];
    if (threadIdx.x < 16) values[threadIdx.x] = g.codes[0].values[threadIdx.x];
    for (int s = 0; s < g.count; ++s) {
      const DequantizeArgs c = pick(g.codes, s);
      if (c.absmax == nullptr) nested_maps()[s][threadIdx.x] = c.nested_map[threadIdx.x];
    }
    __syncthreads();
    fill_table<D, kEntryStride>(table, values);
    __syncthreads();
    return reinterpret_cast<const char*>(table);
  }
  __device__ __forceinline__ void load(std::int64_t step, Loaded& v) const {
    v.weight = weight[0];
    // kBlocks: a lane past the input's end reads its row's first codes, which x's zeros cancel.
    const std::uint32_t advance = !kBlocks || step < lane_end ? static_cast<std::uint32_t>(step) * kStep : 0u;
#pragma unroll
    for (int l = 0; l < Lines; ++l) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::uint32_t start = element[h] + advance;
        if constexpr (kBlocks) {
#pragma unroll
          for (int i = 0; i < kWords / 4; ++i) {
            const uint4 c = __ldcs(reinterpret_cast<const uint4*>(packed[l] + (start >> 1)) + i);
            v.codes[l][h][4 * i] = c.x;
            v.codes[l][h][4 * i + 1] = c.y;
            v.codes[l][h][4 * i + 2] = c.z;
            v.codes[l][h][4 * i + 3] = c.w;
          }
        } else {
          const uint2 c = __ldcs(reinterpret_cast<const uint2*>(packed[l] + (start >> 1)));
          v.codes[l][h][0] = c.x;
          v.codes[l][h][1] = c.y;
        }
        const std::uint32_t block = start >> block_shift[l];
        v.scale[l][h] = __ldg(scales[l] + (block >> nested_shift[l]));  // nested_shift 0 without
        v.code[l][h] = scale_codes[l] != nullptr ? __ldg(scale_codes[l] + block) : 0;
      }
    }
  }
  // On sm_90 ptxas adds the shared window's base (it carries the block's rank in its cluster) to
  // each lookup's offset, whether the table is reached through this pointer or a shared-window
  // address (both measured: the same SASS pattern and step time). Compiled for sm_90 with nvcc 13,
  // no other form saved it: the base's high bytes put in by the byte permutation with a plain
  // ld.shared, or a generic load, took 3 instructions a lookup, ld.shared::cluster 4.
  __device__ __forceinline__ static std::uint32_t pair(const char* table, std::uint32_t word, int byte, unsigned lane_offset) {
    const unsigned offset = kBlocks ? __byte_perm(word, lane_offset, 0x5504u | (static_cast<unsigned>(byte) << 4)) : pair_offset(word, byte, lane_offset);
    return *reinterpret_cast<const std::uint32_t*>(table + offset);
  }
  // The mma's D of each line over the step: kRows, a lane's 16 codes a row against x's rows;
  // kBlocks, its 32 against x where its columns are its quad's.
  template <int Rows>
  __device__ __forceinline__ static void step_sums(float (&d)[Lines][4], const Loaded& v, const Stored<D>* x, std::int64_t in, int group, int quad,
                                                   std::int64_t step, const char* table, unsigned lane_offset) {
    if constexpr (kBlocks) {
      const int row = group - 2 * quad;
      const std::int64_t k = step * kStep + kLaneCodes * quad;
      const uint4* xs = row >= 0 && row < Rows && k < in ? reinterpret_cast<const uint4*>(x + row * in + k) : zero_inputs;
#pragma unroll
      for (int j = 0; j < kWords; ++j) {
        const uint4 xw = __ldg(xs + j);
#pragma unroll
        for (int l = 0; l < Lines; ++l) {
          const std::uint32_t first = v.codes[l][0][j], second = v.codes[l][1][j];
          mma_tile<D>(d[l], pair(table, first, 0, lane_offset), pair(table, second, 0, lane_offset), pair(table, first, 1, lane_offset),
                      pair(table, second, 1, lane_offset), xw.x, xw.y);
          mma_tile<D>(d[l], pair(table, first, 2, lane_offset), pair(table, second, 2, lane_offset), pair(table, first, 3, lane_offset),
                      pair(table, second, 3, lane_offset), xw.z, xw.w);
        }
      }
    } else {
      std::uint32_t xw[8];
      load_x<Rows>(x, in, group, step * kStep + 16 * quad, xw);
#pragma unroll
      for (int l = 0; l < Lines; ++l)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // Bytes 2j and 2j + 1 of each row's eight: elements 4j to 4j + 3 of the lane's sixteen.
          const std::uint32_t first = v.codes[l][0][j / 2], second = v.codes[l][1][j / 2];
          const int b = 2 * (j % 2);
          mma_tile<D>(d[l], pair(table, first, b, lane_offset), pair(table, second, b, lane_offset), pair(table, first, b + 1, lane_offset),
                      pair(table, second, b + 1, lane_offset), xw[2 * j], xw[2 * j + 1]);
        }
    }
  }
  template <int Rows>
  __device__ __forceinline__ static void add(const ProductGroup& g, float (&acc)[Lines][4], const Loaded& v, const Stored<D>* x, std::int64_t in, int group,
                                             int quad, std::int64_t step, const char* table, unsigned lane_offset) {
    float sums[Lines][4] = {};
    step_sums<Rows>(sums, v, x, in, group, quad, step, table, lane_offset);
#pragma unroll
    for (int l = 0; l < Lines; ++l) {
      float scale[2];
      const int s = Lines == 2 ? l : v.weight;
      const DequantizeArgs c = pick(g.codes, s);
#pragma unroll
      for (int h = 0; h < 2; ++h)
        scale[h] = c.absmax != nullptr ? v.scale[l][h] : add_rn(mul_rn(nested_maps()[s][v.code[l][h]], v.scale[l][h]), c.offset);
      acc[l][0] = fmaf(sums[l][0], scale[0], acc[l][0]);
      acc[l][2] = fmaf(sums[l][2], scale[1], acc[l][2]);
      if (!kBlocks || Rows > 1) {  // kBlocks: column 2 quad + 1 is x's row 1
        acc[l][1] = fmaf(sums[l][1], scale[0], acc[l][1]);
        acc[l][3] = fmaf(sums[l][3], scale[1], acc[l][3]);
      }
    }
  }
};

// Blocks stay resident and take tiles in turn; each warp streams its slice of the input (the same
// steps of every tile) as one sequence across tiles, P::kUnroll steps' loads always in flight: a
// step's loads are issued before the oldest one's product, so the next tile's first weights are on
// their way while a tile's sums meet. A step past the slice's end loads nothing (its product is
// skipped), not zeros. Measured on an H200 (bench/RESULTS.md): a ring of twice the slots walked
// unrolled, which saves copying a slot out before its refill, lost (8B 4-bit step 3.16-3.18
// against 3.00 ms, 70B 21.1 against 19.6); the 3- and 4-row kernels spilled with it, and taken for
// the one-row, one-line products only, which did not spill, it still lost (3.08-3.09, 70B 20.5).
template <Dtype D, int Rows, int Lines, TileColumns Columns>
__global__ void __launch_bounds__(kThreads, 2)
    code_tiles_kernel(const ProductGroup g, const Stored<D>* __restrict__ x, std::int64_t in, std::int64_t tiles, const Shifts shifts, int team) {
  using P = CodeTiles<D, Lines, Columns>;
  extern __shared__ uint4 dynamic_shared[];
  __shared__ float partial[kWarps][Lines][kTileFeatures * 8];
  const char* table = P::prepare(g, dynamic_shared);
  const int lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const unsigned lane_offset = static_cast<unsigned>(lane) * 4;
  const WarpSlice w = warp_slice(in, P::kStep, tiles, team);
  TileCursor loading{w.first_tile, w.begin};
  P source(g, feature_tile_of(g, min(loading.tile, tiles - 1)), in, group, quad, shifts);
  const auto load_next = [&](typename P::Loaded& slot) {
    if (loading.step < w.end) source.load(loading.step, slot);
    if (loading.advance(w) && loading.tile < tiles) source = P(g, feature_tile_of(g, loading.tile), in, group, quad, shifts);
  };
  typename P::Loaded ring[P::kUnroll] = {};  // a slot a step past the end keeps what it held
#pragma unroll
  for (int u = 0; u < P::kUnroll; ++u)
    if (u < w.items) load_next(ring[u]);
  // The first weights are on their way before x, which the kernel before may still be writing.
  wait_for_prior_kernels();
  let_next_kernel_start();
  float acc[Lines][4] = {};
  TileCursor at{w.first_tile, w.begin};
  for (std::int64_t item = 0; item < w.items; item += P::kUnroll) {
#pragma unroll
    for (int u = 0; u < P::kUnroll; ++u) {
      if (item + u >= w.items) break;
      const typename P::Loaded current = ring[u];
      if (item + u + P::kUnroll < w.items) load_next(ring[u]);
      if (at.step < w.end) P::template add<Rows>(g, acc, current, x, in, group, quad, at.step, table, lane_offset);
      next_step<D, Rows, Lines, P::kQuadsSplitFeatures>(g, acc, partial, w, at);
    }
  }
}

// Dense tiles through shared memory: each warp copies its slice of a tile's 16 rows with cp.async,
// 256 contiguous bytes a row per pair of instructions, and feeds the mma from the copies as the
// 4-bit tiles do from registers. Measured on an H200 (8B decode step at 1 and 4 rows): the same
// tiles fed from registers, 16 or 64 bytes a lane a row, took 7.1 and 5.6 ms (DRAM at a third of its
// bandwidth, by ncu), these 4.9 and 5.1; a ring of 3 stages 5.4 and 5.6, of 6 (192 KB, no padding)
// 5.1 and 5.4, so 4 it is: 3 stages of copies in flight while one is read (SwiGLU's two lines: 2
// stages of both, one in flight).
constexpr int kStagedInputs = 128;  // inputs a stage takes of each row: 256 bytes
constexpr int kStagedPitch = 320;    // bytes from row to row in shared memory: the two rows a
                                     // quarter-warp reads fall in different banks
constexpr int kStagedStageBytes = kTileFeatures * kStagedPitch;
template <int Lines>
constexpr int kStagedSlots = 4 / Lines;  // a warp's ring: 20 KB either way
constexpr int kStagedSharedBytes = kWarps * 4 * kStagedStageBytes;  // 160 KB, for either line count

__device__ __forceinline__ void copy_async16(void* shared, const void* global, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto to = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(global), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int Pending>
__device__ __forceinline__ void wait_copies() {  // all but the newest Pending groups are in
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
#endif
}

template <Dtype D, int Rows, int Lines>
__global__ void __launch_bounds__(kThreads, 1)
    staged_tiles_kernel(const ProductGroup g, const Stored<D>* __restrict__ x, std::int64_t in, std::int64_t tiles) {
  constexpr int kSlots = kStagedSlots<Lines>;
  extern __shared__ uint4 dynamic_shared[];
  __shared__ float partial[kWarps][Lines][kTileFeatures * 8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  char* ring = reinterpret_cast<char*>(dynamic_shared) + warp * kSlots * Lines * kStagedStageBytes;
  const WarpSlice w = warp_slice(in, kStagedInputs, tiles);
  TileCursor loading{w.first_tile, w.begin};
  FeatureTile load_t = feature_tile_of(g, min(loading.tile, tiles - 1));
  // Copies the next stage into `slot` (nothing past the input or the tiles) and closes its group.
  const auto issue = [&](int slot) {
    if (loading.step < w.end && loading.tile < tiles) {
      char* stage = ring + slot * Lines * kStagedStageBytes;
      const int col = lane % 16;
      const std::int64_t k = loading.step * kStagedInputs + 8 * col;
#pragma unroll
      for (int j = 0; j < 8 * Lines; ++j) {
        const int line = j / 8, row = 2 * (j % 8) + lane / 16;
        const std::int64_t feature = min(load_t.first + row, pick(g.out, load_t.weight[line]) - 1);
        const auto* src = static_cast<const Stored<D>*>(pick(g.dense, load_t.weight[line])) + feature * in + (k < in ? k : 0);
        copy_async16(stage + (line * kTileFeatures + row) * kStagedPitch + 16 * col, src, k < in ? 16 : 0);
      }
    }
    commit_copies();
    if (loading.advance(w) && loading.tile < tiles) load_t = feature_tile_of(g, loading.tile);
  };
#pragma unroll
  for (int s = 0; s < kSlots - 1; ++s) issue(s);
  // The first weights are on their way before x, which the kernel before may still be writing.
  wait_for_prior_kernels();
  let_next_kernel_start();
  float acc[Lines][4] = {};
  TileCursor at{w.first_tile, w.begin};
  for (std::int64_t item = 0; item < w.items; ++item) {
    __syncwarp();  // every lane is done with the slot the next copies go to
    issue(static_cast<int>((item + kSlots - 1) % kSlots));
    wait_copies<kSlots - 1>();
    __syncwarp();  // and every lane's copies of this item are in
    if (at.step < w.end) {
      const char* stage = ring + static_cast<int>(item % kSlots) * Lines * kStagedStageBytes;
#pragma unroll
      for (int c = 0; c < kStagedInputs / 32; ++c) {
        // Inputs 32c + 8 quad to 32c + 8 quad + 7 of the stage: one 16-byte word a row.
        std::uint32_t xw[4];
        load_x<Rows>(x, in, group, at.step * kStagedInputs + 32 * c + 8 * quad, xw);
#pragma unroll
        for (int l = 0; l < Lines; ++l) {
          const uint4 a = *reinterpret_cast<const uint4*>(stage + (l * kTileFeatures + group) * kStagedPitch + 16 * (4 * c + quad));
          const uint4 b = *reinterpret_cast<const uint4*>(stage + (l * kTileFeatures + group + 8) * kStagedPitch + 16 * (4 * c + quad));
          mma_tile<D>(acc[l], a.x, b.x, a.y, b.y, xw[0], xw[1]);
          mma_tile<D>(acc[l], a.z, b.z, a.w, b.w, xw[2], xw[3]);
        }
      }
    }
    next_step<D, Rows, Lines>(g, acc, partial, w, at);
  }
  wait_copies<0>();
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

// How many blocks of `Kernel` (with SharedBytes of dynamic shared memory) the current device holds
// at once, found once per device; 0 if CUDA cannot say.
template <auto Kernel, int SharedBytes>
unsigned resident_blocks() {
  static std::atomic<unsigned> known[kMaxCudaDevices];  // zero: static storage
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxCudaDevices) return 0;
  if (const unsigned n = known[device].load(std::memory_order_relaxed)) return n;
  // A kernel whose dynamic shared memory comes near 48 KB with its static opts in (past 48 KB it
  // must), once a device as this count is found.
  if (SharedBytes > 40 * 1024 && cudaFuncSetAttribute(reinterpret_cast<const void*>(Kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, SharedBytes) != cudaSuccess)
    return 0;
  int per_sm = 0;
  const int sms = current_device_attribute<cudaDevAttrMultiProcessorCount>();
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, SharedBytes) != cudaSuccess || per_sm < 1 || sms < 1) return 0;
  const unsigned n = static_cast<unsigned>(per_sm * sms);
  known[device].store(n, std::memory_order_relaxed);
  return n;
}

Shifts shifts_of(const ProductGroup& g) {
  Shifts shifts{};
  for (int s = 0; s < g.count; ++s) {
    shifts.block[s] = log2_exact(g.codes[s].blocksize);
    shifts.nested[s] = g.codes[s].absmax != nullptr ? 0 : log2_exact(g.codes[s].nested_blocksize);
  }
  return shifts;
}

// Launches a kernel whose blocks stay resident and take `work` blocks' worth in turn: as many blocks
// as the device holds at once, or fewer.
template <auto Kernel, int SharedBytes, class... Args>
cudaError_t launch_resident(std::int64_t work, cudaStream_t stream, Args... args) {
  const unsigned resident = resident_blocks<Kernel, SharedBytes>();
  if (resident == 0) {
    const cudaError_t e = cudaGetLastError();  // what the occupancy query met, if CUDA said
    return e != cudaSuccess ? e : cudaErrorInvalidConfiguration;
  }
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(work, resident));
  return overlapped_launch(Kernel, dim3(blocks), dim3(kThreads), SharedBytes, stream, args...);
}

template <Dtype D, int Rows, int Unroll>
cudaError_t launch_quantized(const ProductGroup& g, const Stored<D>* x, std::int64_t in, std::int64_t tasks, cudaStream_t stream) {
  return launch_resident<quantized_products_kernel<D, Rows, Unroll>, kTableBytes>((tasks + kWarps - 1) / kWarps, stream, g, x, in, tasks, shifts_of(g));
}

static_assert(kStagedSharedBytes + static_cast<int>(sizeof(float[kWarps][2][kTileFeatures * 8])) == kStagedTilesBlockBytes,
              "the table's staged-tiles block (product_kernels.hpp) is what the kernel takes");

// The group as the kernel table reads it (loom/kit/kernels.hpp).
ProductShape shape_of(const ProductGroup& g, std::int64_t rows, std::int64_t in, Dtype dtype) {
  ProductShape shape;
  shape.quantized = g.quantized;
  shape.sixteen_bit = dtype != Dtype::kFloat32;
  shape.swiglu = g.finish == ProductFinish::kSwiGLU;
  shape.rows = rows;
  shape.in = in;
  shape.count = g.count;
  shape.smallest_block = std::numeric_limits<std::int64_t>::max();
  for (int s = 0; s < g.count; ++s) {
    shape.out[s] = g.out[s];
    if (!g.quantized) continue;
    shape.largest_codes = std::max(shape.largest_codes, g.codes[s].n);
    shape.smallest_block = std::min(shape.smallest_block, g.codes[s].blocksize);
  }
  return shape;
}

// Warps a 4-bit tile (8, 4 or 2): the team size whose slowest warp finishes first, counting whole
// waves of the resident warps (a wave part-filled takes as long as a full one) times a warp's steps
// of a tile plus one more for the tile's end (its shuffles, barriers and the next tile's offsets).
// Measured on an H200 (bench/RESULTS.md): the 8B's gate/up then takes 2 and q/k/v 4, the 70B's o
// and down 4; counting a tile's end as 2 to 4 steps gave the 70B's gate/up teams of 2, 3% slower.
int tile_team(std::int64_t tiles, unsigned resident, std::int64_t steps) {
  if (resident == 0) return kWarps;  // the launch reports what the occupancy query met
  constexpr std::int64_t kTileEnd = 1;
  int best = kWarps;
  std::int64_t best_cost = 0;
  for (const int team : {kWarps, 4, 2}) {
    const std::int64_t slots = static_cast<std::int64_t>(resident) * (kWarps / team);
    const std::int64_t cost = (tiles + slots - 1) / slots * ((steps + team - 1) / team + kTileEnd);
    if (team == kWarps || cost < best_cost) best = team, best_cost = cost;
  }
  return best;
}

template <Dtype D, int Rows, int Lines>
cudaError_t launch_tiles(const ProductGroup& g, const Stored<D>* x, std::int64_t in, cudaStream_t stream) {
  std::int64_t tiles = 0;
  for (int s = 0; s < (Lines == 2 ? 1 : g.count); ++s) tiles += (g.out[s] + kTileFeatures - 1) / kTileFeatures;
  if (g.quantized) {
    constexpr auto kColumns = Rows <= 2 ? TileColumns::kBlocks : TileColumns::kRows;
    constexpr auto kKernel = code_tiles_kernel<D, Rows, Lines, kColumns>;
    constexpr int kShared = CodeTiles<D, Lines, kColumns>::kTableSharedBytes;
    constexpr int kStep = CodeTiles<D, Lines, kColumns>::kStep;
    const int team = tile_team(tiles, resident_blocks<kKernel, kShared>(), (in + kStep - 1) / kStep);
    return launch_resident<kKernel, kShared>((tiles + kWarps / team - 1) / (kWarps / team), stream, g, x, in, tiles, shifts_of(g), team);
  }
  if constexpr (Rows >= 3) return launch_resident<staged_tiles_kernel<D, Rows, Lines>, kStagedSharedBytes>(tiles, stream, g, x, in, tiles);
  return cudaErrorInvalidConfiguration;  // dense tiles start at 3 rows (the kernel table)
}

template <Dtype D, int Rows>
cudaError_t launch_rows(const ProductGroup& g, const void* x, std::int64_t in, ProductKernel kernel, cudaStream_t stream) {
  const std::int64_t tasks = task_count(g);
  const auto* xs = static_cast<const Stored<D>*>(x);
  switch (kernel) {
    case ProductKernel::kDenseStagedTiles:
    case ProductKernel::kCodeTilesBlocks:
    case ProductKernel::kCodeTilesRows:
      if constexpr (D != Dtype::kFloat32)
        return g.finish == ProductFinish::kSwiGLU ? launch_tiles<D, Rows, 2>(g, xs, in, stream) : launch_tiles<D, Rows, 1>(g, xs, in, stream);
      return cudaErrorInvalidConfiguration;  // the table gives float32 no tiles
    case ProductKernel::kCodeLanes: return launch_quantized<D, Rows, kCodesUnroll>(g, xs, in, tasks, stream);
    case ProductKernel::kDenseLanesOneLine: {
      std::int64_t lines = 0;
      for (int s = 0; s < g.count; ++s) lines += g.out[s];
      return overlapped_launch(dense_products_kernel<D, Rows, 1>, dim3(static_cast<unsigned>((lines + kWarps - 1) / kWarps)), dim3(kThreads), 0,
                               stream, g, xs, in, lines);
    }
    case ProductKernel::kDenseLanes:
      return overlapped_launch(dense_products_kernel<D, Rows, 2>, dim3(static_cast<unsigned>((tasks + kWarps - 1) / kWarps)), dim3(kThreads), 0,
                               stream, g, xs, in, tasks);
    case ProductKernel::kLibTorch: break;
  }
  return cudaErrorInvalidConfiguration;  // few_row_products_supported refuses what goes to LibTorch
}

template <Dtype D>
cudaError_t launch(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, ProductKernel kernel, cudaStream_t stream) {
  static_assert(kFewRowsMax == 4, "one instantiation per row count");
  switch (rows) {
    case 1: return launch_rows<D, 1>(g, x, in, kernel, stream);
    case 2: return launch_rows<D, 2>(g, x, in, kernel, stream);
    case 3: return launch_rows<D, 3>(g, x, in, kernel, stream);
    default: return launch_rows<D, 4>(g, x, in, kernel, stream);
  }
}

}  // namespace

bool few_row_products_supported(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, Dtype dtype) {
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
  return choose_product_kernel(shape_of(g, rows, in, dtype), current_device_traits()) != ProductKernel::kLibTorch;
}

const char* few_row_products_cuda(const ProductGroup& g, const void* x, std::int64_t rows, std::int64_t in, Dtype dtype, void* stream) {
  if (!few_row_products_supported(g, x, rows, in, dtype)) return "few_row_products_cuda called outside what it supports";
  const auto s = static_cast<cudaStream_t>(stream);
  const ProductKernel kernel = choose_product_kernel(shape_of(g, rows, in, dtype), current_device_traits());
  cudaError_t e = dtype == Dtype::kBFloat16 ? launch<Dtype::kBFloat16>(g, x, rows, in, kernel, s)
                  : dtype == Dtype::kFloat16 ? launch<Dtype::kFloat16>(g, x, rows, in, kernel, s)
                                             : launch<Dtype::kFloat32>(g, x, rows, in, kernel, s);
  if (e == cudaSuccess) e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace loom::kit::detail
