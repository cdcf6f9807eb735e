#pragma once
// The decoder's building blocks model families share (llama.cpp's lesson: one place for attention
// and norms), so every architecture gets them right once.
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom {
class AdaptableLinear;  // loom/layers.hpp
}

namespace loom::kit {

// RMSNorm with statistics in fp32 and the result cast back before the weight, as HF computes it.
LOOM_API at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// Gemma's RMSNorm: (1 + weight) times the normalized x, all in fp32, then rounded to x's dtype.
LOOM_API at::Tensor rms_norm_offset(const at::Tensor& x, const at::Tensor& weight, double eps);
// OLMo 2's: weight times the normalized x, in fp32, then rounded to x's dtype.
LOOM_API at::Tensor rms_norm_float(const at::Tensor& x, const at::Tensor& weight, double eps);

// LayerNorm over x's last dimension, as torch.nn.LayerNorm computes it in x's dtype (GPT-NeoX,
// StableLM, StarCoder 2); `weight` or `bias` undefined: none. Kit 3.8.
LOOM_API at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);
// The same in fp32 with the weight applied before rounding back to x's dtype, and no bias (Cohere's
// LayerNorm). Kit 3.8.
LOOM_API at::Tensor layer_norm_float(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rotary embedding in the half-split convention (HF's rotate_half). x: [B, heads, T, d];
// cos, sin: [B, T, r], r <= d: a partial rotary turns x's first r dimensions (kit 3.0).
LOOM_API at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Rotary in the interleaved convention (GPT-J's; Cohere, DeepSeek's rope_interleave): dimensions 2i
// and 2i + 1 of a head turn together by frequency i. cos and sin as apply_rotary takes them
// ([B, T, r], frequency i's value at i and at i + r/2); x [B, heads, T, d], its first r dimensions
// turned, the rest passed. Computed in fp32 and rounded back (as Cohere does). Kit 3.8.
LOOM_API at::Tensor apply_rotary_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and logits. Kit 3.8.
LOOM_API at::Tensor soft_cap(const at::Tensor& x, double cap);

// gpt-oss's expert activation: gate clamped to at most `limit`, up to [-limit, limit], then
// gate * sigmoid(alpha * gate) * (up + 1). Kit 3.8.
LOOM_API at::Tensor clamped_swiglu(const at::Tensor& gate, const at::Tensor& up, double alpha, double limit);

// gelu(gate) * up (GeGLU), with the tanh approximation or exact, as LibTorch computes it.
LOOM_API at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, bool tanh_approximation);

// A long row's MLP a slice of rows at a time (kit 4.2): past twice mlp_chunk_rows rows, an MLP of
// `units` hidden units whose [rows, units] intermediates would dominate a layer's memory. Without a
// graph, `mlp` runs each slice in turn. With one, forward keeps only the input; backward runs each
// slice again with a graph (the random state replayed, so dropout draws as it drew) and
// backpropagates through it, so the weights get their gradients there, a slice's intermediates
// alive at a time. `linears`: those `mlp` uses (nulls skipped), whose weights may take gradients. A slice is as many
// rows (a multiple of 128) as make one [rows, units] intermediate mlp_slice_bytes (256 MiB unless
// set: tests make long rows of small models).
LOOM_API void set_mlp_slice_bytes(std::int64_t bytes);
LOOM_API std::int64_t mlp_slice_bytes();
LOOM_API std::int64_t mlp_chunk_rows(std::int64_t units, std::int64_t value_bytes);
LOOM_API bool mlp_runs_in_chunks(std::int64_t rows, std::int64_t units, std::int64_t value_bytes);
LOOM_API at::Tensor mlp_over_row_chunks(const at::Tensor& x, std::int64_t units, std::initializer_list<AdaptableLinear*> linears,
                                        const std::function<at::Tensor(const at::Tensor&)>& mlp);
// The random state dropout draws from on `device`: the CPU generator's, and the device's own.
LOOM_API std::vector<at::Tensor> random_state(const c10::Device& device);
LOOM_API void set_random_state(const c10::Device& device, const std::vector<at::Tensor>& state);

// silu(gate) * up, as LibTorch's two kernels compute and round it. On a GPU one kernel forward and
// one backward, and only gate and up kept for the backward.
LOOM_API at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
// The same of both [..., 2W]'s halves: silu(both[..., :W]) * both[..., W:] (a mixture of experts'
// fused gate_up rows). Keeps only `both` for the backward, which gives both halves' gradient as
// one tensor; on a GPU one kernel each way (kit 3.5).
LOOM_API at::Tensor swiglu_halves(const at::Tensor& both);

// Which keys each query may see: [B, 1, T, S] bool, causal over positions S-T.. S-1 and blind to
// padding. A query always sees itself, so a padding row never softmaxes over nothing (NaN). In
// packed rows (loom/model.hpp, PackedSequences) the mask numbers each row's samples, and a query
// sees only the keys of its own sample. With a window (> 0), a query sees only the keys of the
// `window` latest columns up to its own (a sliding layer; transformers' q - window < k <= q).
LOOM_API at::Tensor attention_allowed(const at::Tensor& attention_mask, std::int64_t query_len, std::int64_t window = 0);

// Softmax attention with grouped-query heads: q [B, H, T, d], k and v [B, KV, S, d], allowed as
// above, or undefined for plain causal attention when nothing is padded or cached. Uses
// LibTorch's fused SDPA where it has one, the exact formula otherwise.
LOOM_API at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed);
// What some families add to attention's scores, which the fused kernels do not take (kit 3.8):
// `softcap` (> 0) bends them to cap * tanh(s / cap) before the mask (Gemma 2's
// attn_logit_softcapping); `sinks` [H] (defined) are one more logit a head that every softmax
// takes in and drops after (gpt-oss's attention sinks, which soak up a share of each row's weight);
// `scale` (> 0) replaces 1 / sqrt(d).
struct AttentionExtras {
  double softcap = 0;
  at::Tensor sinks;
  double scale = 0;
};
// attention() in its exact form with `extras`: q [B, H, T, d], k and v [B, KV, S, d] (grouped-query
// heads as they are), allowed [B, 1, T, S] bool or undefined (causal over the last T of S). The
// softmax in fp32, rounded to q's dtype before the values (transformers' eager path). Kit 3.8.
LOOM_API at::Tensor attention_exact(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                                    const AttentionExtras& extras = {});

// The same for one new token per row (q [B, H, 1, d]) over a cache's keys and values, allowed
// [B, 1, 1, S]: on a GPU one fused kernel (float32 softmax), elsewhere attention().
LOOM_API at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed);

// Packed or padded rows as segments for variable-length attention: every run of equal
// attention-mask values in a row (a sample of a packed row, a padded row's sample, its padding) is
// one segment, attending causally within itself. A real token sees what attention_allowed() lets it
// see; a padding token sees only the padding before it (nothing reads its output). offsets: [n + 1]
// int32, where each segment starts in the rows laid end to end, on the mask's device; longest: the
// longest segment. Reads the mask on the host. A mask where a sample's tokens come back after a gap
// (1 1 0 1 1) is no set of segments: offsets is then undefined, and attention_allowed() serves.
struct AttentionSegments {
  at::Tensor offsets;
  std::int64_t longest = 0;
};
LOOM_API AttentionSegments attention_segments(const at::Tensor& attention_mask);
// Whether segment_attention() takes the heads of these activations: on a GPU of compute capability
// 8 or more, in bfloat16 or half, heads of at most 256 values (a multiple of 8), in a LibTorch
// with flash attention; for a window, one whose kernel takes windows.
LOOM_API bool segment_attention_serves(const at::Tensor& activations, std::int64_t head_dim, bool windowed = false);
// Causal attention within each segment, q [B, H, T, d] over k and v [B, KV, T, d] (grouped-query
// heads as they are): LibTorch's variable-length flash kernel, differentiable, with no [T, T]
// pattern made and no work spent across segments. [B, H, T, d]. With a window (> 0), each token sees
// only the `window` latest tokens of its segment up to itself, through the kernel's own window
// (segment_attention_serves says whether this build has it).
LOOM_API at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionSegments& segments,
                                      std::int64_t window = 0);

// A decode step's attention whole (one new token per row, no gradients, on a GPU): rotary of q
// [B, 1, H, d] and k [B, 1, KV, d] (before rotary, as the projections give them) with cos and sin
// [B, 1, d], k and v [B, 1, KV, d] written into the cache's keys and values [B, KV, capacity, d] at
// each row's column ([B, 1] int64), and attention over the columns allowed [B, 1, 1, capacity]
// marks: [B, H, 1, d], what apply_rotary, the cache write and decode_attention give, in one kernel.
// Undefined where it does not apply (the CPU, heads not of 64, 128, 192 or 256 values).
LOOM_API at::Tensor decode_step_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                                          at::Tensor& keys, at::Tensor& values, const at::Tensor& allowed, const at::Tensor& columns);

// Generation's few rows (x with at most 4 rows, no gradients, on a GPU): the products of the
// layers that read x in one kernel, dense or 4-bit weights read once (product_kernels.hpp). Each
// output is what the layer's forward gives (bias and adapter added after the product). Empty, or
// undefined, where the kernel does not apply: more rows, the CPU, a weight split over a tensor
// group, a layout it does not take; the caller then runs the layers itself.
LOOM_API std::vector<at::Tensor> few_row_products(const at::Tensor& x, const std::vector<AdaptableLinear*>& layers);
// residual + layer(x), the sum done by the product's kernel where the layer has no bias or adapter.
LOOM_API at::Tensor few_row_product_add(const at::Tensor& x, AdaptableLinear& layer, const at::Tensor& residual);
// silu(gate(x)) * up(x), the activation done by the products' kernel where neither has a bias or adapter.
LOOM_API at::Tensor few_row_swiglu(const at::Tensor& x, AdaptableLinear& gate, AdaptableLinear& up);
// x W^T for a dense [out, in] W (the head).
LOOM_API at::Tensor few_row_linear(const at::Tensor& x, const at::Tensor& weight);

// Generation's rows as a greedy decode step changes them, on the logits' device: int64 [R] each but
// tokens [R, max_new + 1]; done [R] and bad [] bool.
struct GreedyStepRows {
  at::Tensor last, position, column, tokens, count, done, bad;
};
// A greedy step's bookkeeping in one kernel on a GPU (logits [R, vocab], its rows' last dimension
// contiguous): each row's token is the first index of its largest logit (argmax); a live row
// (!done) writes it at tokens[r, count], counts it, ends at `eos` (negative: never) or max_new
// tokens, and moves its position and cache column (at most capacity - 1) on; an ended row writes it
// at tokens[r, max_new]; every row's last becomes its token; bad becomes true where a live row's
// largest logit is not finite. False where it does not apply (the CPU, other layouts): the caller
// does the same with LibTorch's operations.
LOOM_API bool greedy_decode_step(const at::Tensor& logits, GreedyStepRows& rows, std::int64_t eos, std::int64_t max_new, std::int64_t capacity);

}  // namespace loom::kit
