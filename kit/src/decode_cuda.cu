// The decoder's fused kernels (decode_kernels.hpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_elements.cuh"
#include "decode_kernels.hpp"

namespace loom::kit::detail {
namespace {

// A row's values stay in registers between the two passes, and each thread's loads are issued
// together: at one row (a decode step) the kernel's time is a few memory latencies, not one per
// element.
constexpr int kNormPerThread = 16;
constexpr int kNormMaxThreads = 1024;
static_assert(kNormPerThread * kNormMaxThreads == rms_norm_cuda_max_hidden, "the longest row a block holds in registers");

// Launch bounds: registers for kNormPerThread values in each of up to 1024 threads.
template <Dtype D>
__global__ void __launch_bounds__(kNormMaxThreads) rms_norm_kernel(const Stored<D>* __restrict__ x, const Stored<D>* __restrict__ weight, Stored<D>* __restrict__ out,
                                std::int64_t hidden, float eps) {
  const std::int64_t row = blockIdx.x;
  const Stored<D>* xr = x + row * hidden;
  // The weight (which training may have just updated) is read with x, not after the sum of squares:
  // one memory latency, not two.
  wait_for_prior_kernels();
  let_next_kernel_start();
  Stored<D> scale[kNormPerThread];
  float values[kNormPerThread];
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kNormPerThread; ++k) {
    const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x;
    values[k] = i < hidden ? load<D>(xr, i) : 0.f;
    if (i < hidden) scale[k] = weight[i];
  }
#pragma unroll
  for (int k = 0; k < kNormPerThread; ++k) sum += values[k] * values[k];
  __shared__ float partial[kNormMaxThreads / 32];
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    float s = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.f;
    s = warp_sum(s);
    if (threadIdx.x == 0) partial[0] = s;
  }
  __syncthreads();
  const float rstd = rsqrtf(partial[0] / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int k = 0; k < kNormPerThread; ++k) {
    const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x;
    if (i < hidden) out[row * hidden + i] = convert<D>(__fmul_rn(load<D>(scale, k), rounded<D>(__fmul_rn(values[k], rstd))));
  }
}

// Training's norms: a block of kRowThreads a row, each thread Vectors 16-byte words of it held in
// registers between the reduction and the output (hidden <= Vectors x 8 x kRowThreads).
constexpr int kRowThreads = 256;
static_assert(8 * 8 * kRowThreads == rms_norm_rows_max_hidden, "8 words a thread at most");

// The block's sum of v, in every thread.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kRowThreads / 32];
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kRowThreads / 32; ++w) total += partial[w];
  return total;
}

template <Dtype D, int Vectors>
__global__ void __launch_bounds__(kRowThreads) rms_norm_rows_kernel(const Stored<D>* __restrict__ x, const Stored<D>* __restrict__ weight,
                                                                     Stored<D>* __restrict__ out, float* __restrict__ rstd_out, std::int64_t hidden,
                                                                     float eps) {
  const std::int64_t row = blockIdx.x, words = hidden / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * hidden);
  uint4 xv[Vectors];
  float squares = 0.f;
#pragma unroll
  for (int v = 0; v < Vectors; ++v) {
    const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(v) * kRowThreads;
    if (i >= words) break;
    xv[v] = xr[i];
    float f[8];
    unpack8<D>(xv[v], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) squares += f[e] * f[e];
  }
  const float rstd = rsqrtf(block_sum(squares) / static_cast<float>(hidden) + eps);
  if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[row] = rstd;
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  uint4* outr = reinterpret_cast<uint4*>(out + row * hidden);
#pragma unroll
  for (int v = 0; v < Vectors; ++v) {
    const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(v) * kRowThreads;
    if (i >= words) break;
    float f[8], w[8];
    unpack8<D>(xv[v], f);
    unpack8<D>(wr[i], w);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = __fmul_rn(w[e], rounded<D>(__fmul_rn(f[e], rstd)));
    outr[i] = pack8<D>(f);
  }
}

template <Dtype D, int Vectors>
__global__ void __launch_bounds__(kRowThreads) rms_norm_rows_backward_kernel(const Stored<D>* __restrict__ grad, const Stored<D>* __restrict__ x,
                                                                              const Stored<D>* __restrict__ weight, const float* __restrict__ rstd,
                                                                              Stored<D>* __restrict__ dx, std::int64_t hidden) {
  const std::int64_t row = blockIdx.x, words = hidden / 8;
  const uint4* gr = reinterpret_cast<const uint4*>(grad + row * hidden);
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * hidden);
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  const float r = rstd[row];
  uint4 gv[Vectors], xv[Vectors];
  float dot = 0.f;
#pragma unroll
  for (int v = 0; v < Vectors; ++v) {
    const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(v) * kRowThreads;
    if (i >= words) break;
    gv[v] = gr[i];
    xv[v] = xr[i];
    float g[8], f[8], w[8];
    unpack8<D>(gv[v], g);
    unpack8<D>(xv[v], f);
    unpack8<D>(wr[i], w);
#pragma unroll
    for (int e = 0; e < 8; ++e) dot += __fmul_rn(rounded<D>(__fmul_rn(g[e], w[e])), __fmul_rn(f[e], r));
  }
  const float mean = block_sum(dot) / static_cast<float>(hidden);
  uint4* dxr = reinterpret_cast<uint4*>(dx + row * hidden);
#pragma unroll
  for (int v = 0; v < Vectors; ++v) {
    const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(v) * kRowThreads;
    if (i >= words) break;
    float g[8], f[8], w[8];
    unpack8<D>(gv[v], g);
    unpack8<D>(xv[v], f);
    unpack8<D>(wr[i], w);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float gy = rounded<D>(__fmul_rn(g[e], w[e])), xhat = __fmul_rn(f[e], r);
      g[e] = __fmul_rn(r, __fsub_rn(gy, __fmul_rn(xhat, mean)));
    }
    dxr[i] = pack8<D>(g);
  }
}

// Transposed: the rotation's transpose (rotary's backward), g * cos + [g2 * sin2, -(g1 * sin1)] by
// halves, each product and the sum rounded as autograd's composite backward rounds them.
template <Dtype D, bool Transposed>
__global__ void rotary_kernel(const Stored<D>* __restrict__ x, const Stored<D>* __restrict__ cos, const Stored<D>* __restrict__ sin,
                              Stored<D>* __restrict__ out, std::int64_t total, std::int64_t heads, std::int64_t dim) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const std::int64_t d = i % dim, row = i / (dim * heads), half = dim / 2;
  const float a = rounded<D>(__fmul_rn(load<D>(x, i), load<D>(cos, row * dim + d)));
  float b;
  if constexpr (Transposed) {
    b = d < half ? rounded<D>(__fmul_rn(load<D>(x, i + half), load<D>(sin, row * dim + d + half)))
                 : -rounded<D>(__fmul_rn(load<D>(x, i - half), load<D>(sin, row * dim + d - half)));
  } else {
    const float partner = d < half ? -load<D>(x, i + half) : load<D>(x, i - half);
    b = rounded<D>(__fmul_rn(partner, load<D>(sin, row * dim + d)));
  }
  out[i] = convert<D>(__fadd_rn(a, b));
}

// Rotary by 16-byte words (heads of a multiple of 16 values, 16-byte aligned): a thread takes 8
// values of a head's first half and their partners in its second, with the same rounding.
template <Dtype D, bool Transposed>
__global__ void rotary_words_kernel(const Stored<D>* __restrict__ x, const Stored<D>* __restrict__ cos, const Stored<D>* __restrict__ sin,
                                    Stored<D>* __restrict__ out, std::int64_t chunks, std::int64_t heads, std::int64_t dim) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t per_head = dim / 16;
  if (t >= chunks) return;
  const std::int64_t head_row = t / per_head, half = dim / 2, offset = (t % per_head) * 8;
  const std::int64_t first = head_row * dim + offset, table = (head_row / heads) * dim + offset;
  float x1[8], x2[8], c1[8], c2[8], s1[8], s2[8];
  unpack8<D>(*reinterpret_cast<const uint4*>(x + first), x1);
  unpack8<D>(*reinterpret_cast<const uint4*>(x + first + half), x2);
  unpack8<D>(*reinterpret_cast<const uint4*>(cos + table), c1);
  unpack8<D>(*reinterpret_cast<const uint4*>(cos + table + half), c2);
  unpack8<D>(*reinterpret_cast<const uint4*>(sin + table), s1);
  unpack8<D>(*reinterpret_cast<const uint4*>(sin + table + half), s2);
  float o1[8], o2[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if constexpr (Transposed) {
      o1[e] = __fadd_rn(rounded<D>(__fmul_rn(x1[e], c1[e])), rounded<D>(__fmul_rn(x2[e], s2[e])));
      o2[e] = __fadd_rn(rounded<D>(__fmul_rn(x2[e], c2[e])), -rounded<D>(__fmul_rn(x1[e], s1[e])));
    } else {
      o1[e] = __fadd_rn(rounded<D>(__fmul_rn(x1[e], c1[e])), rounded<D>(__fmul_rn(-x2[e], s1[e])));
      o2[e] = __fadd_rn(rounded<D>(__fmul_rn(x2[e], c2[e])), rounded<D>(__fmul_rn(x1[e], s2[e])));
    }
  }
  *reinterpret_cast<uint4*>(out + first) = pack8<D>(o1);
  *reinterpret_cast<uint4*>(out + first + half) = pack8<D>(o2);
}

// silu(g) as LibTorch's kernel computes it in float32.
__device__ __forceinline__ float silu_of(float g) { return __fdiv_rn(g, __fadd_rn(1.f, expf(-g))); }

// Where rows of `row_words` 16-byte words lie: word c of row r at r * pitch + c.
struct WordRows {
  std::int64_t rows, row_words, in_pitch, out_pitch;  // gate, up (and their gradients) by in_pitch; out (and its gradient) by out_pitch
  __device__ std::int64_t in(std::int64_t i) const { return i / row_words * in_pitch + i % row_words; }
  __device__ std::int64_t out(std::int64_t i) const { return i / row_words * out_pitch + i % row_words; }
};

// SwiGLU by 16-byte words, grid-stride: out = round(round(silu(gate)) * up).
template <Dtype D>
__global__ void swiglu_kernel(const uint4* __restrict__ gate, const uint4* __restrict__ up, uint4* __restrict__ out, WordRows w) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < w.rows * w.row_words;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float g[8], u[8];
    unpack8<D>(gate[w.in(i)], g);
    unpack8<D>(up[w.in(i)], u);
#pragma unroll
    for (int e = 0; e < 8; ++e) g[e] = __fmul_rn(rounded<D>(silu_of(g[e])), u[e]);
    out[w.out(i)] = pack8<D>(g);
  }
}

// Its backward, the composite's three kernels in one: d_up = round(grad * round(silu(g))),
// d_silu = round(grad * up), d_gate = round(d_silu * s * (1 + g (1 - s))) with s = sigmoid(g).
template <Dtype D>
__global__ void swiglu_backward_kernel(const uint4* __restrict__ grad, const uint4* __restrict__ gate, const uint4* __restrict__ up,
                                       uint4* __restrict__ d_gate, uint4* __restrict__ d_up, WordRows w) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < w.rows * w.row_words;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float dy[8], g[8], u[8];
    const std::int64_t at = w.in(i);
    unpack8<D>(grad[w.out(i)], dy);
    unpack8<D>(gate[at], g);
    unpack8<D>(up[at], u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      // One exponential for both: silu_of's exact quotient, and the sigmoid.
      const float denominator = __fadd_rn(1.f, expf(-g[e]));
      const float sigmoid = __fdiv_rn(1.f, denominator);
      const float d_silu = rounded<D>(__fmul_rn(dy[e], u[e]));
      u[e] = __fmul_rn(dy[e], rounded<D>(__fdiv_rn(g[e], denominator)));
      g[e] = __fmul_rn(__fmul_rn(d_silu, sigmoid), __fadd_rn(1.f, __fmul_rn(g[e], __fsub_rn(1.f, sigmoid))));
    }
    d_gate[at] = pack8<D>(g);
    d_up[at] = pack8<D>(u);
  }
}

// The next-token loss of logits rows: a block a row, two passes over it (the first finds the row's
// maximum and sum of exponentials online, the second writes the gradient).
constexpr int kLossThreads = 512;

// (m, s) <- the pair for the union of two sets of values, each given as its maximum m and its
// sum of exp(value - m).
__device__ __forceinline__ void merge_exp_sums(float& m, float& s, float other_m, float other_s) {
  const float top = fmaxf(m, other_m);
  if (top == -INFINITY) return;  // both empty
  s = s * expf(m - top) + other_s * expf(other_m - top);
  m = top;
}

template <Dtype D>
__global__ void __launch_bounds__(kLossThreads) next_token_loss_kernel(const Stored<D>* __restrict__ logits, const std::int64_t* __restrict__ targets,
                                                                       float* __restrict__ loss, Stored<D>* __restrict__ grad, std::int64_t vocab) {
  const std::int64_t row = blockIdx.x, words = vocab / 8;
  const Stored<D>* z = logits + row * vocab;
  const uint4* zw = reinterpret_cast<const uint4*>(z);
  float m = -INFINITY, s = 0.f;
  for (std::int64_t i = threadIdx.x; i < words; i += kLossThreads) {
    float f[8];
    unpack8<D>(zw[i], f);
    float top = f[0];
#pragma unroll
    for (int e = 1; e < 8; ++e) top = fmaxf(top, f[e]);
    if (top == -INFINITY) continue;  // adds nothing (and exp(-inf - -inf) would be NaN)
    if (top > m) {
      s = m == -INFINITY ? 0.f : s * expf(m - top);
      m = top;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) s += expf(f[e] - m);
  }
  for (int offset = 16; offset > 0; offset >>= 1)
    merge_exp_sums(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
  __shared__ float warp_m[kLossThreads / 32], warp_s[kLossThreads / 32];
  if (threadIdx.x % 32 == 0) {
    warp_m[threadIdx.x / 32] = m;
    warp_s[threadIdx.x / 32] = s;
  }
  __syncthreads();
  m = warp_m[0];
  s = warp_s[0];
#pragma unroll
  for (int w = 1; w < kLossThreads / 32; ++w) merge_exp_sums(m, s, warp_m[w], warp_s[w]);
  const float lse = m + logf(s);
  // As the composite: -100 is not counted, another negative target reads class 0; one past the
  // vocabulary (a bug upstream: the composite's gather fails) gives NaN, which the trainer refuses.
  const std::int64_t target = targets[row] < 0 ? 0 : targets[row];
  const bool counted = targets[row] != -100;
  if (threadIdx.x == 0) loss[row] = !counted ? 0.f : target < vocab ? lse - load<D>(z, target) : NAN;
  if (grad == nullptr) return;
  uint4* gw = reinterpret_cast<uint4*>(grad + row * vocab);
  for (std::int64_t i = threadIdx.x; i < words; i += kLossThreads) {
    float f[8];
    unpack8<D>(zw[i], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float p = expf(f[e] - lse) - (i * 8 + e == target ? 1.f : 0.f);
      f[e] = counted ? p : 0.f;
    }
    gw[i] = pack8<D>(f);
  }
}

constexpr int kAttentionWarps = 16;  // keys split 16 ways: at a few hundred keys, a few per warp

// The rotary embedding of one head of PerLane * 32 values, held as element lane + 32 e in v[e], with
// the row's cos and sin: rotary_kernel's arithmetic, each product and the sum rounded to the dtype.
// Element i's partner i +- dim / 2 is the same lane's v[e +- PerLane / 2] (PerLane even).
template <Dtype D, int PerLane>
__device__ __forceinline__ void rotate_held(float (&v)[PerLane], const Stored<D>* cos, const Stored<D>* sin, int lane) {
  static_assert(PerLane % 2 == 0, "a head's halves in whole lanes' strides");
  float rotated[PerLane];
#pragma unroll
  for (int e = 0; e < PerLane; ++e) {
    const int i = lane + 32 * e;
    const float partner = e < PerLane / 2 ? -v[e + PerLane / 2] : v[e - PerLane / 2];
    const float a = rounded<D>(__fmul_rn(v[e], load<D>(cos, i)));
    const float b = rounded<D>(__fmul_rn(partner, load<D>(sin, i)));
    rotated[e] = rounded<D>(__fadd_rn(a, b));
  }
#pragma unroll
  for (int e = 0; e < PerLane; ++e) v[e] = rotated[e];
}

// What a decode step's attention kernel reads besides q and the cache, when it also takes the step's
// own token (Step): the token's key (before rotary) and value [batch, kv_heads, d], the row's cos
// and sin [batch, d], and the cache column [batch] the token goes to.
template <Dtype D>
struct NewToken {
  const Stored<D>* key = nullptr;
  const Stored<D>* value = nullptr;
  const Stored<D>* cos = nullptr;
  const Stored<D>* sin = nullptr;
  const std::int64_t* column = nullptr;
};

// One block per (query head, row); each warp takes every kAttentionWarps-th key with an online
// softmax, the warps' parts merged at the end. A lane holds dim / 32 values of q and of the sum.
// With Step, the block first rotates q and the new key itself, the first block of each K/V head
// writes the new key and value into the cache, and every block uses them from registers at their
// column (so no block waits on another's write).
template <Dtype D, int PerLane, bool Step>
__global__ void decode_attention_kernel(const Stored<D>* __restrict__ q, Stored<D>* __restrict__ keys, Stored<D>* __restrict__ values,
                                        const bool* __restrict__ allowed, Stored<D>* __restrict__ out, std::int64_t heads, std::int64_t kv_heads,
                                        std::int64_t capacity, float scale, const NewToken<D> token) {
  wait_for_prior_kernels();
  let_next_kernel_start();
  constexpr int dim = PerLane * 32;
  const std::int64_t head = blockIdx.x, row = blockIdx.y;
  const std::int64_t group = heads / kv_heads, kv = head / group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Stored<D>* qh = q + (row * heads + head) * dim;
  Stored<D>* kh = keys + (row * kv_heads + kv) * capacity * dim;
  Stored<D>* vh = values + (row * kv_heads + kv) * capacity * dim;
  const bool* seen = allowed + row * capacity;
  float qv[PerLane], acc[PerLane], new_key[PerLane], new_value[PerLane];
  for (int e = 0; e < PerLane; ++e) {
    qv[e] = load<D>(qh, lane + 32 * e);
    acc[e] = 0.f;
  }
  std::int64_t column = -1;
  if constexpr (Step) {
    rotate_held<D, PerLane>(qv, token.cos + row * dim, token.sin + row * dim, lane);
    const std::int64_t at = (row * kv_heads + kv) * dim;
    for (int e = 0; e < PerLane; ++e) {
      new_key[e] = load<D>(token.key + at, lane + 32 * e);
      new_value[e] = load<D>(token.value + at, lane + 32 * e);
    }
    rotate_held<D, PerLane>(new_key, token.cos + row * dim, token.sin + row * dim, lane);
    column = token.column[row];
    if (column < 0 || column >= capacity) column = -1;  // never written nor read (the caller's columns are in range)
    if (column >= 0 && head % group == 0 && warp == 0)
      for (int e = 0; e < PerLane; ++e) {
        kh[column * dim + lane + 32 * e] = convert<D>(new_key[e]);
        vh[column * dim + lane + 32 * e] = convert<D>(new_value[e]);
      }
  }
  float best = -INFINITY, total = 0.f;
  for (std::int64_t j = warp; j < capacity; j += kAttentionWarps) {
    if (!seen[j]) continue;
    const bool own = Step && j == column;
    float dot = 0.f;
    for (int e = 0; e < PerLane; ++e) dot += qv[e] * (own ? new_key[e] : load<D>(kh + j * dim, lane + 32 * e));
    const float score = warp_sum(dot) * scale;
    const float next_best = fmaxf(best, score);
    const float keep = __expf(best - next_best), weight = __expf(score - next_best);
    total = total * keep + weight;
    for (int e = 0; e < PerLane; ++e) acc[e] = acc[e] * keep + weight * (own ? new_value[e] : load<D>(vh + j * dim, lane + 32 * e));
    best = next_best;
  }
  __shared__ float warp_best[kAttentionWarps], warp_total[kAttentionWarps];
  __shared__ float warp_acc[kAttentionWarps][dim];
  if (lane == 0) {
    warp_best[warp] = best;
    warp_total[warp] = total;
  }
  for (int e = 0; e < PerLane; ++e) warp_acc[warp][lane + 32 * e] = acc[e];
  __syncthreads();
  if (warp != 0) return;
  float overall = -INFINITY;
  for (int w = 0; w < kAttentionWarps; ++w) overall = fmaxf(overall, warp_best[w]);
  float sum = 0.f;
  float merged[PerLane];
  for (int e = 0; e < PerLane; ++e) merged[e] = 0.f;
  for (int w = 0; w < kAttentionWarps; ++w) {
    if (warp_best[w] == -INFINITY) continue;  // a warp that saw no allowed key
    const float f = __expf(warp_best[w] - overall);
    sum += warp_total[w] * f;
    for (int e = 0; e < PerLane; ++e) merged[e] += warp_acc[w][lane + 32 * e] * f;
  }
  Stored<D>* oh = out + (row * heads + head) * dim;
  for (int e = 0; e < PerLane; ++e) oh[lane + 32 * e] = convert<D>(sum > 0.f ? merged[e] / sum : 0.f);
}

const char* status() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

template <template <Dtype> class Launch, class... Args>
const char* by_dtype(Dtype dtype, Args... args) {
  switch (dtype) {
    case Dtype::kBFloat16: Launch<Dtype::kBFloat16>::run(args...); break;
    case Dtype::kFloat16: Launch<Dtype::kFloat16>::run(args...); break;
    default: Launch<Dtype::kFloat32>::run(args...); break;
  }
  return status();
}

template <Dtype D>
struct NormLaunch {
  static void run(const void* x, const void* weight, void* out, std::int64_t rows, std::int64_t hidden, float eps, cudaStream_t s) {
    // About 4 values a thread (at most kNormPerThread, as hidden is bounded), in whole warps.
    std::int64_t wanted = (hidden + 3) / 4;
    wanted = wanted < 128 ? 128 : wanted > kNormMaxThreads ? kNormMaxThreads : wanted;
    const int threads = static_cast<int>((wanted + 31) / 32 * 32);
    overlapped_launch(rms_norm_kernel<D>, dim3(static_cast<unsigned>(rows)), dim3(threads), 0, s, static_cast<const Stored<D>*>(x),
                      static_cast<const Stored<D>*>(weight), static_cast<Stored<D>*>(out), hidden, eps);
  }
};

// Calls launch(std::integral_constant<int, V>) with the fewest words a thread, V, that cover a row
// of `hidden`.
template <class Launch>
void by_row_vectors(std::int64_t hidden, Launch launch) {
  const std::int64_t words = (hidden / 8 + kRowThreads - 1) / kRowThreads;
  if (words <= 1) launch(std::integral_constant<int, 1>{});
  else if (words <= 2) launch(std::integral_constant<int, 2>{});
  else if (words <= 4) launch(std::integral_constant<int, 4>{});
  else launch(std::integral_constant<int, 8>{});
}

template <Dtype D>
struct NormRowsLaunch {
  static void run(const void* x, const void* weight, void* out, float* rstd, std::int64_t rows, std::int64_t hidden, float eps, cudaStream_t s) {
    if constexpr (D != Dtype::kFloat32)
      by_row_vectors(hidden, [&](auto vectors) {
        rms_norm_rows_kernel<D, decltype(vectors)::value><<<static_cast<unsigned>(rows), kRowThreads, 0, s>>>(
            static_cast<const Stored<D>*>(x), static_cast<const Stored<D>*>(weight), static_cast<Stored<D>*>(out), rstd, hidden, eps);
      });
  }
};

template <Dtype D>
struct NormRowsBackwardLaunch {
  static void run(const void* grad, const void* x, const void* weight, const float* rstd, void* dx, std::int64_t rows, std::int64_t hidden,
                  cudaStream_t s) {
    if constexpr (D != Dtype::kFloat32)
      by_row_vectors(hidden, [&](auto vectors) {
        rms_norm_rows_backward_kernel<D, decltype(vectors)::value><<<static_cast<unsigned>(rows), kRowThreads, 0, s>>>(
            static_cast<const Stored<D>*>(grad), static_cast<const Stored<D>*>(x), static_cast<const Stored<D>*>(weight), rstd,
            static_cast<Stored<D>*>(dx), hidden);
      });
  }
};

template <Dtype D>
struct RotaryLaunch {
  static void run(const void* x, const void* cos, const void* sin, void* out, std::int64_t total, std::int64_t heads, std::int64_t dim,
                  bool transposed, cudaStream_t s) {
    constexpr int threads = 256;
    const auto* xs = static_cast<const Stored<D>*>(x);
    const auto *c = static_cast<const Stored<D>*>(cos), *sn = static_cast<const Stored<D>*>(sin);
    if constexpr (D != Dtype::kFloat32) {
      if (dim % 16 == 0 && aligned_words(x) && aligned_words(cos) && aligned_words(sin) && aligned_words(out)) {
        const std::int64_t chunks = total / 16;
        const auto blocks = static_cast<unsigned>((chunks + threads - 1) / threads);
        auto* o = static_cast<Stored<D>*>(out);
        if (transposed) rotary_words_kernel<D, true><<<blocks, threads, 0, s>>>(xs, c, sn, o, chunks, heads, dim);
        else rotary_words_kernel<D, false><<<blocks, threads, 0, s>>>(xs, c, sn, o, chunks, heads, dim);
        return;
      }
    }
    const auto blocks = static_cast<unsigned>((total + threads - 1) / threads);
    if (transposed) rotary_kernel<D, true><<<blocks, threads, 0, s>>>(xs, c, sn, static_cast<Stored<D>*>(out), total, heads, dim);
    else rotary_kernel<D, false><<<blocks, threads, 0, s>>>(xs, c, sn, static_cast<Stored<D>*>(out), total, heads, dim);
  }
};

// Blocks for a grid-stride pass over `words`: enough to fill the GPU, no more.
unsigned stride_blocks(std::int64_t words, int threads) {
  const std::int64_t wanted = (words + threads - 1) / threads;
  return static_cast<unsigned>(wanted < 4096 ? wanted : 4096);
}

template <Dtype D>
struct SwigluLaunch {
  static void run(const void* gate, const void* up, void* out, WordRows w, cudaStream_t s) {
    constexpr int threads = 256;
    if constexpr (D != Dtype::kFloat32)
      swiglu_kernel<D><<<stride_blocks(w.rows * w.row_words, threads), threads, 0, s>>>(static_cast<const uint4*>(gate), static_cast<const uint4*>(up),
                                                                                         static_cast<uint4*>(out), w);
  }
};

template <Dtype D>
struct SwigluBackwardLaunch {
  static void run(const void* grad, const void* gate, const void* up, void* d_gate, void* d_up, WordRows w, cudaStream_t s) {
    constexpr int threads = 256;
    if constexpr (D != Dtype::kFloat32)
      swiglu_backward_kernel<D><<<stride_blocks(w.rows * w.row_words, threads), threads, 0, s>>>(
          static_cast<const uint4*>(grad), static_cast<const uint4*>(gate), static_cast<const uint4*>(up), static_cast<uint4*>(d_gate),
          static_cast<uint4*>(d_up), w);
  }
};

template <Dtype D>
struct LossLaunch {
  static void run(const void* logits, const std::int64_t* targets, float* loss, void* grad, std::int64_t rows, std::int64_t vocab, cudaStream_t s) {
    if constexpr (D != Dtype::kFloat32)
      next_token_loss_kernel<D><<<static_cast<unsigned>(rows), kLossThreads, 0, s>>>(static_cast<const Stored<D>*>(logits), targets, loss,
                                                                                       static_cast<Stored<D>*>(grad), vocab);
  }
};

constexpr int kGreedyThreads = 1024;

// The better of two (value, index) candidates: the larger value, the smaller index on a tie.
__device__ __forceinline__ bool better(float value, std::int64_t index, float than_value, std::int64_t than_index) {
  return value > than_value || (value == than_value && index < than_index);
}

template <Dtype D>
__global__ void __launch_bounds__(kGreedyThreads)
    greedy_step_kernel(const Stored<D>* __restrict__ logits, std::int64_t vocab, std::int64_t row_stride, const GreedyStepRows s, std::int64_t eos,
                       std::int64_t max_new, std::int64_t capacity) {
  constexpr std::int64_t kNone = INT64_MAX;
  __shared__ float best_of[kGreedyThreads / 32];
  __shared__ std::int64_t index_of[kGreedyThreads / 32];
  __shared__ int nan_in[kGreedyThreads / 32];
  const std::int64_t r = blockIdx.x;
  const Stored<D>* row = logits + r * row_stride;
  float best = -INFINITY;
  std::int64_t at = kNone;
  bool nan = false;
  for (std::int64_t i = threadIdx.x; i < vocab; i += kGreedyThreads) {
    const float v = load<D>(row, i);
    if (isnan(v)) nan = true;
    else if (better(v, i, best, at)) best = v, at = i;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const std::int64_t other_at = __shfl_xor_sync(0xffffffffu, at, offset);
    if (better(other, other_at, best, at)) best = other, at = other_at;
  }
  nan = __any_sync(0xffffffffu, nan);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) best_of[warp] = best, index_of[warp] = at, nan_in[warp] = nan;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kGreedyThreads / 32; ++w) {
    if (better(best_of[w], index_of[w], best, at)) best = best_of[w], at = index_of[w];
    nan = nan || nan_in[w];
  }
  const std::int64_t token = at == kNone ? 0 : at;  // a row of NaNs only: bad, and the run stops at its next look
  const bool live = !s.done[r];
  if (live && (nan || isinf(best))) *s.bad = true;
  s.tokens[r * (max_new + 1) + (live ? s.count[r] : max_new)] = token;
  if (live) {
    const std::int64_t count = s.count[r] + 1;
    s.count[r] = count;
    s.done[r] = token == eos || count >= max_new;
    s.position[r] += 1;
  }
  s.column[r] = min(s.column[r] + (live ? 1 : 0), capacity - 1);
  s.last[r] = token;
}

template <Dtype D>
struct GreedyLaunch {
  static void run(const void* logits, std::int64_t rows, std::int64_t vocab, std::int64_t row_stride, const GreedyStepRows& state, std::int64_t eos,
                  std::int64_t max_new, std::int64_t capacity, cudaStream_t stream) {
    greedy_step_kernel<D><<<static_cast<unsigned>(rows), kGreedyThreads, 0, stream>>>(static_cast<const Stored<D>*>(logits), vocab, row_stride, state, eos,
                                                                                      max_new, capacity);
  }
};

template <Dtype D>
struct AttentionLaunch {
  template <int PerLane, bool Step>
  static void launch(const void* q, void* k, void* v, const bool* allowed, void* out, std::int64_t batch, std::int64_t heads, std::int64_t kv_heads,
                     std::int64_t capacity, float scale, const NewToken<D>& token, cudaStream_t s) {
    const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(batch));
    overlapped_launch(decode_attention_kernel<D, PerLane, Step>, grid, dim3(kAttentionWarps * 32), 0, s, static_cast<const Stored<D>*>(q),
                      static_cast<Stored<D>*>(k), static_cast<Stored<D>*>(v), allowed, static_cast<Stored<D>*>(out), heads, kv_heads, capacity, scale,
                      token);
  }
  static void run(const void* q, void* k, void* v, const bool* allowed, void* out, std::int64_t batch, std::int64_t heads, std::int64_t kv_heads,
                  std::int64_t capacity, std::int64_t dim, const DecodeStepToken* step, cudaStream_t s) {
    const float scale = 1.0f / sqrtf(static_cast<float>(dim));
    if (step != nullptr) {
      const NewToken<D> token{static_cast<const Stored<D>*>(step->key), static_cast<const Stored<D>*>(step->value),
                              static_cast<const Stored<D>*>(step->cos), static_cast<const Stored<D>*>(step->sin), step->column};
      switch (dim / 32) {
        case 2: launch<2, true>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, token, s); break;
        case 4: launch<4, true>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, token, s); break;
        case 6: launch<6, true>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, token, s); break;
        default: launch<8, true>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, token, s); break;
      }
      return;
    }
    const NewToken<D> none{};
    switch (dim / 32) {
      case 1: launch<1, false>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, none, s); break;
      case 2: launch<2, false>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, none, s); break;
      case 3: launch<3, false>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, none, s); break;
      case 4: launch<4, false>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, none, s); break;
      case 6: launch<6, false>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, none, s); break;
      default: launch<8, false>(q, k, v, allowed, out, batch, heads, kv_heads, capacity, scale, none, s); break;
    }
  }
};

}  // namespace

const char* rms_norm_cuda(const void* x, const void* weight, void* out, std::int64_t rows, std::int64_t hidden, float eps, Dtype dtype,
                          void* stream) {
  if (rows == 0) return nullptr;
  if (hidden > rms_norm_cuda_max_hidden) return "rms_norm_cuda: rows longer than rms_norm_cuda_max_hidden";
  return by_dtype<NormLaunch>(dtype, x, weight, out, rows, hidden, eps, static_cast<cudaStream_t>(stream));
}

bool rms_norm_rows_supported(std::int64_t hidden, Dtype dtype) {
  return dtype != Dtype::kFloat32 && hidden > 0 && hidden % 8 == 0 && hidden <= rms_norm_rows_max_hidden;
}

const char* rms_norm_rows_cuda(const void* x, const void* weight, void* out, float* rstd, std::int64_t rows, std::int64_t hidden, float eps,
                               Dtype dtype, void* stream) {
  if (!rms_norm_rows_supported(hidden, dtype)) return "rms_norm_rows_cuda: a dtype or row length it does not take";
  if (rows == 0) return nullptr;
  return by_dtype<NormRowsLaunch>(dtype, x, weight, out, rstd, rows, hidden, eps, static_cast<cudaStream_t>(stream));
}

const char* rms_norm_rows_backward_cuda(const void* grad, const void* x, const void* weight, const float* rstd, void* dx, std::int64_t rows,
                                        std::int64_t hidden, Dtype dtype, void* stream) {
  if (!rms_norm_rows_supported(hidden, dtype)) return "rms_norm_rows_backward_cuda: a dtype or row length it does not take";
  if (rows == 0) return nullptr;
  return by_dtype<NormRowsBackwardLaunch>(dtype, grad, x, weight, rstd, dx, rows, hidden, static_cast<cudaStream_t>(stream));
}

const char* rotary_cuda(const void* x, const void* cos, const void* sin, void* out, std::int64_t rows, std::int64_t heads, std::int64_t dim,
                        bool transposed, Dtype dtype, void* stream) {
  const std::int64_t total = rows * heads * dim;
  if (total == 0) return nullptr;
  return by_dtype<RotaryLaunch>(dtype, x, cos, sin, out, total, heads, dim, transposed, static_cast<cudaStream_t>(stream));
}

// Whether 16-bit values, n of them (a multiple of 8), of tensors at these addresses are whole 16-byte words.
bool in_whole_words(std::int64_t n, Dtype dtype, std::initializer_list<const void*> tensors) {
  if (dtype == Dtype::kFloat32 || n % 8 != 0) return false;
  for (const void* t : tensors)
    if (!aligned_words(t)) return false;
  return true;
}

bool swiglu_cuda_takes(std::int64_t n, Dtype dtype, std::initializer_list<const void*> tensors) { return in_whole_words(n, dtype, tensors); }

bool swiglu_rows_cuda_takes(std::int64_t width, std::int64_t in_stride, std::int64_t out_stride, Dtype dtype, std::initializer_list<const void*> tensors) {
  return width % 8 == 0 && in_stride % 8 == 0 && out_stride % 8 == 0 && in_whole_words(width, dtype, tensors);
}

const char* swiglu_rows_cuda(const void* gate, const void* up, void* out, std::int64_t rows, std::int64_t width, std::int64_t in_stride,
                             std::int64_t out_stride, Dtype dtype, void* stream) {
  if (!swiglu_rows_cuda_takes(width, in_stride, out_stride, dtype, {gate, up, out}))
    return "swiglu_cuda: float32, or values not in whole aligned 16-byte words";
  if (rows * width == 0) return nullptr;
  return by_dtype<SwigluLaunch>(dtype, gate, up, out, WordRows{rows, width / 8, in_stride / 8, out_stride / 8}, static_cast<cudaStream_t>(stream));
}

const char* swiglu_rows_backward_cuda(const void* grad, const void* gate, const void* up, void* d_gate, void* d_up, std::int64_t rows,
                                      std::int64_t width, std::int64_t in_stride, std::int64_t out_stride, Dtype dtype, void* stream) {
  if (!swiglu_rows_cuda_takes(width, in_stride, out_stride, dtype, {grad, gate, up, d_gate, d_up}))
    return "swiglu_backward_cuda: float32, or values not in whole aligned 16-byte words";
  if (rows * width == 0) return nullptr;
  return by_dtype<SwigluBackwardLaunch>(dtype, grad, gate, up, d_gate, d_up, WordRows{rows, width / 8, in_stride / 8, out_stride / 8},
                                        static_cast<cudaStream_t>(stream));
}

const char* swiglu_cuda(const void* gate, const void* up, void* out, std::int64_t n, Dtype dtype, void* stream) {
  return swiglu_rows_cuda(gate, up, out, 1, n, n, n, dtype, stream);
}

const char* swiglu_backward_cuda(const void* grad, const void* gate, const void* up, void* d_gate, void* d_up, std::int64_t n, Dtype dtype,
                                 void* stream) {
  return swiglu_rows_backward_cuda(grad, gate, up, d_gate, d_up, 1, n, n, n, dtype, stream);
}

bool next_token_loss_cuda_takes(std::int64_t vocab, Dtype dtype, std::initializer_list<const void*> tensors) {
  return vocab > 0 && in_whole_words(vocab, dtype, tensors);
}

const char* next_token_loss_cuda(const void* logits, const std::int64_t* targets, float* loss, void* grad, std::int64_t rows, std::int64_t vocab,
                                 Dtype dtype, void* stream) {
  if (!next_token_loss_cuda_takes(vocab, dtype, {logits, grad}))
    return "next_token_loss_cuda: float32, or rows not in whole aligned 16-byte words";
  if (rows == 0) return nullptr;
  if (rows > 0x7fffffff) return "next_token_loss_cuda: more rows than a grid holds";
  return by_dtype<LossLaunch>(dtype, logits, targets, loss, grad, rows, vocab, static_cast<cudaStream_t>(stream));
}

const char* decode_attention_cuda(const void* q, void* keys, void* values, const bool* allowed, void* out, std::int64_t batch, std::int64_t heads,
                                  std::int64_t kv_heads, std::int64_t capacity, std::int64_t dim, Dtype dtype, void* stream,
                                  const DecodeStepToken* step) {
  if (batch == 0) return nullptr;
  if (step != nullptr && (dim % 64 != 0 || dim > 256)) return "decode_attention_cuda: a step's token takes heads of 64, 128, 192 or 256 values";
  return by_dtype<AttentionLaunch>(dtype, q, keys, values, allowed, out, batch, heads, kv_heads, capacity, dim, step, static_cast<cudaStream_t>(stream));
}

const char* greedy_step_cuda(const void* logits, std::int64_t rows, std::int64_t vocab, std::int64_t row_stride, const GreedyStepRows& state,
                             std::int64_t eos, std::int64_t max_new, std::int64_t capacity, Dtype dtype, void* stream) {
  if (rows == 0) return nullptr;
  if (rows > 0x7fffffff || vocab < 1 || max_new < 1 || capacity < 1) return "greedy_step_cuda: no rows it can take";
  return by_dtype<GreedyLaunch>(dtype, logits, rows, vocab, row_stride, state, eos, max_new, capacity, static_cast<cudaStream_t>(stream));
}

}  // namespace loom::kit::detail
