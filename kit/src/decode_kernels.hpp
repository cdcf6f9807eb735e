#pragma once
// Fused CUDA kernels for the decoder's small operations, where generation spends its time once the
// weights stream at full speed: each replaces several of LibTorch's kernels (launches, and passes
// over memory) with one. The composite LibTorch code in blocks.cpp is the CPU path and the
// reference; the kernels round where it rounds. No LibTorch here: nvcc compiles this without it.
#include <cstdint>
#include <initializer_list>

#include "quantize_kernels.hpp"

namespace loom::kit::detail {

// out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)) for rows of `hidden` values, the
// normalization in float32 and cast to the dtype before the weight's product (HF's order).
// hidden: at most rms_norm_cuda_max_hidden.
constexpr std::int64_t rms_norm_cuda_max_hidden = 16384;
const char* rms_norm_cuda(const void* x, const void* weight, void* out, std::int64_t rows, std::int64_t hidden, float eps, Dtype dtype,
                          void* stream);

// Training's RMSNorm over many rows (a prompt, a batch): out as rms_norm_cuda gives it, and each
// row's rsqrt(mean(x^2) + eps) in float32 into rstd (unless null), for the backward. bfloat16 or
// half, rows 16-byte aligned (hidden a multiple of 8), hidden at most rms_norm_rows_max_hidden.
constexpr std::int64_t rms_norm_rows_max_hidden = 16384;
bool rms_norm_rows_supported(std::int64_t hidden, Dtype dtype);
const char* rms_norm_rows_cuda(const void* x, const void* weight, void* out, float* rstd, std::int64_t rows, std::int64_t hidden, float eps,
                               Dtype dtype, void* stream);
// Its gradient to x, in float32 as the composite computes it: gy = round(grad * weight), xhat = x *
// rstd, dx = round(rstd * (gy - xhat * mean(gy * xhat))).
const char* rms_norm_rows_backward_cuda(const void* grad, const void* x, const void* weight, const float* rstd, void* dx, std::int64_t rows,
                                        std::int64_t hidden, Dtype dtype, void* stream);

// Rotary embedding of x [rows, heads, d] (rows = batch x tokens) with cos and sin [rows, d]:
// x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype as LibTorch's
// element-wise kernels round them.
// transposed: the rotation's transpose instead (rotary's backward, x the output's gradient):
// x * cos + [x2 * sin2, -(x1 * sin1)] by halves, rounded as autograd's composite backward rounds.
const char* rotary_cuda(const void* x, const void* cos, const void* sin, void* out, std::int64_t rows, std::int64_t heads, std::int64_t dim,
                        bool transposed, Dtype dtype, void* stream);

// SwiGLU over n values: out = silu(gate) * up, silu's result rounded to the dtype before the
// product as LibTorch's two kernels round. Its backward: d_up = grad * silu(gate) and d_gate =
// silu'(gate) * (grad * up), each as the composite's kernels round (silu's derivative in float32).
// bfloat16 or half, n a multiple of 8, every pointer 16-byte aligned (swiglu_cuda_takes).
bool swiglu_cuda_takes(std::int64_t n, Dtype dtype, std::initializer_list<const void*> tensors);
const char* swiglu_cuda(const void* gate, const void* up, void* out, std::int64_t n, Dtype dtype, void* stream);
const char* swiglu_backward_cuda(const void* grad, const void* gate, const void* up, void* d_gate, void* d_up, std::int64_t n, Dtype dtype,
                                 void* stream);
// The same over `rows` rows of `width` values: gate, up, d_gate and d_up rows `in_stride` values
// apart, out's and grad's `out_stride` apart (gate and up the two halves of one [rows, 2 x width]
// tensor: in_stride 2 x width). Widths and strides multiples of 8.
bool swiglu_rows_cuda_takes(std::int64_t width, std::int64_t in_stride, std::int64_t out_stride, Dtype dtype, std::initializer_list<const void*> tensors);
const char* swiglu_rows_cuda(const void* gate, const void* up, void* out, std::int64_t rows, std::int64_t width, std::int64_t in_stride,
                             std::int64_t out_stride, Dtype dtype, void* stream);
const char* swiglu_rows_backward_cuda(const void* grad, const void* gate, const void* up, void* d_gate, void* d_up, std::int64_t rows,
                                      std::int64_t width, std::int64_t in_stride, std::int64_t out_stride, Dtype dtype, void* stream);

// The next-token loss of logits [rows, vocab] (bfloat16 or half) against targets [rows] (int64;
// -100 is not counted, another negative reads class 0, as the composite clamps): per row lse = log(sum(exp(z))) in float32, loss[row] = lse -
// z[target], and, unless grad is null, grad[row] = exp(z - lse) - onehot(target) rounded to the
// dtype (zero rows where not counted): the composite's values (next_token_loss_sum_from_hidden) in
// one kernel reading the logits twice, where the composite made a float32 copy and passed over it
// about ten times. vocab a multiple of 8, logits and grad 16-byte aligned.
bool next_token_loss_cuda_takes(std::int64_t vocab, Dtype dtype, std::initializer_list<const void*> tensors);
const char* next_token_loss_cuda(const void* logits, const std::int64_t* targets, float* loss, void* grad, std::int64_t rows, std::int64_t vocab,
                                 Dtype dtype, void* stream);

// A decode step's own token, for decode_attention_cuda to take whole: its key (before rotary) and
// value [batch, kv_heads, d], the rows' cos and sin [batch, d], and the cache column [batch] (int64)
// each row's token goes to.
struct DecodeStepToken {
  const void* key = nullptr;
  const void* value = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  const std::int64_t* column = nullptr;
};

// Attention of one new token per row: q [batch, heads, d] over keys and values [batch, kv_heads,
// capacity, d] (query head h reads K/V head h / (heads / kv_heads)), where allowed [batch,
// capacity] (bytes, 1: attend) marks the columns each row sees; out [batch, heads, d]. Scores,
// softmax and the weighted sum in float32. d: a multiple of 32, at most 256.
// With `step`, q is before rotary too, and the kernel also does what would come before it: rotary
// of q and of the step's key (rotary_cuda's arithmetic) and their write into the cache at each
// row's column, one kernel for what were four. d: then 64, 128, 192 or 256.
const char* decode_attention_cuda(const void* q, void* keys, void* values, const bool* allowed, void* out, std::int64_t batch, std::int64_t heads,
                                  std::int64_t kv_heads, std::int64_t capacity, std::int64_t dim, Dtype dtype, void* stream,
                                  const DecodeStepToken* step = nullptr);

// A greedy decode step's bookkeeping, one block a row of logits [rows, vocab] (row r at logits + r
// row_stride), in one kernel where LibTorch took about twenty: the token is the first index of the
// row's largest value (LibTorch's argmax, except that a NaN is not taken). A live row
// (!done[r]) writes it at tokens[r, count[r]], counts it, ends at `eos` or max_new tokens, and moves
// its position and its cache column (at most capacity - 1) on; an ended row writes it at tokens[r,
// max_new]. Every row's last becomes the token; bad becomes true where a live row holds a NaN or
// its largest value is not finite. tokens: [rows, max_new + 1].
struct GreedyStepRows {
  std::int64_t* last = nullptr;
  std::int64_t* position = nullptr;
  std::int64_t* column = nullptr;
  std::int64_t* tokens = nullptr;
  std::int64_t* count = nullptr;
  bool* done = nullptr;
  bool* bad = nullptr;
};
const char* greedy_step_cuda(const void* logits, std::int64_t rows, std::int64_t vocab, std::int64_t row_stride, const GreedyStepRows& state,
                             std::int64_t eos, std::int64_t max_new, std::int64_t capacity, Dtype dtype, void* stream);

}  // namespace loom::kit::detail
