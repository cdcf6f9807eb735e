#pragma once
// The decoder's building blocks model families share (llama.cpp's lesson: one place for attention
// and norms), so every architecture gets them right once.
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"

namespace loom::kit {

// RMSNorm with statistics in fp32 and the result cast back before the weight, as HF computes it.
LOOM_API at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rotary embedding in the half-split convention (HF's rotate_half). x: [B, heads, T, d];
// cos, sin: [B, T, d].
LOOM_API at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Which keys each query may see: [B, 1, T, S] bool, causal over positions S-T.. S-1 and blind to
// padding. A query always sees itself, so a padding row never softmaxes over nothing (NaN).
LOOM_API at::Tensor attention_allowed(const at::Tensor& attention_mask, std::int64_t query_len);

// Softmax attention with grouped-query heads: q [B, H, T, d], k and v [B, KV, S, d], allowed as
// above, or undefined for plain causal attention when nothing is padded or cached. Uses
// LibTorch's fused SDPA where it has one, the exact formula otherwise.
LOOM_API at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed);
// The same for one new token per row (q [B, H, 1, d]) over a cache's keys and values, allowed
// [B, 1, 1, S]: on a GPU one fused kernel (float32 softmax), elsewhere attention().
LOOM_API at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed);

}  // namespace loom::kit
