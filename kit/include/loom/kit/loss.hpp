#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// Summed next-token cross-entropy of logits [B, T, V] against labels [B, T] (label t is the token
// at t; positions labelled -100 do not count), on the logits' device, as
// cross_entropy(logits[:, :-1].float(), labels[:, 1:], reduction=sum, ignore_index=-100) computes
// it, but a slice of rows at a time in fp32: the fp32 copy of the logits, their log-softmax and its
// gradient (each 2x the size of bf16 logits) never exist whole. Backward recomputes the softmax
// from the logits and a saved log-sum-exp per row.
LOOM_API at::Tensor next_token_loss_sum(const at::Tensor& logits, const at::Tensor& labels);

// The values of fp32 logits one slice holds (64 MiB).
inline constexpr std::int64_t kLossSliceValues = std::int64_t{1} << 24;
// As above, with slices of about `slice_values` values (at least a row): for a tighter memory
// bound, and for tests that slice small logits as large ones are sliced. SDK 2.3.
LOOM_API at::Tensor next_token_loss_sum(const at::Tensor& logits, const at::Tensor& labels, std::int64_t slice_values);

// The same loss from the head's input hidden [B, T, H] and its frozen weight [V, H] (logits =
// hidden W^T, in hidden's dtype): logits are made a slice of about `slice_values` fp32 values at a
// time and never exist whole, nor does their gradient. The gradient with respect to hidden is
// computed beside the loss (backward only scales it): nothing is multiplied twice. With a weight
// that requires grad (and grad mode on), or fp16 (whose gradient needs the loss scale before it is
// rounded), the composite next_token_loss_sum(linear(hidden, weight), labels). Kit 1.1.
// Its slices are larger than the sliced loss's (2^26 fp32 values, about 512 rows of a 128k
// vocabulary) and a whole number of 128 rows where they hold that many: each is a product of the
// head, which runs at full speed only on rows enough.
inline constexpr std::int64_t kHeadLossSliceValues = std::int64_t{1} << 26;
LOOM_API at::Tensor next_token_loss_sum_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                                    std::int64_t slice_values = kHeadLossSliceValues);
// What a family does to the head's logits before the loss (kit 4.1): times `multiplier` (Granite's
// 1 / logits_scaling, Cohere's logit_scale), then soft-capped, cap tanh(z / cap), where `softcap` >
// 0 (Gemma 2's final_logit_softcapping); both in fp32, a slice at a time.
struct HeadLogits {
  double multiplier = 1.0;
  double softcap = 0;
};
// The head's product `logits` as the family's: times the multiplier, then soft_cap (blocks.hpp).
LOOM_API at::Tensor head_logits(const at::Tensor& logits, const HeadLogits& head);
// next_token_loss_sum_from_hidden of those logits: the same slices, the gradient through the
// multiplier and the cap made beside the loss. Equal to next_token_loss_sum(cap(m linear(hidden,
// weight))) within fp32's rounding (the composite rounds the scaled logits to hidden's dtype first).
LOOM_API at::Tensor next_token_loss_sum_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                                    const HeadLogits& head, std::int64_t slice_values = kHeadLossSliceValues);
// Each position's log-probability of its label from the head's input (kit 4.2), for objectives
// that compare them (DPO, GRPO, their reference passes): [B, T] fp32, position t holding log p of
// labels[t] given the positions before it under the family's logits divided by `temperature` (0 at
// t = 0 and where the label is -100), as log_softmax(head_logits(linear(hidden, weight)) /
// temperature) gives it, but made a slice of rows at a time as next_token_loss_sum_from_hidden makes
// the loss: no [tokens, vocabulary] tensor exists whole. Differentiable with respect to hidden (the
// derivative of each position's value made beside it); the weight must be frozen.
LOOM_API at::Tensor next_token_logps_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head,
                                                 double temperature = 1.0, std::int64_t slice_values = kHeadLossSliceValues);
// What next_token_loss_sum_from_hidden holds at once besides what scales with the tokens (the
// saved gradient of its input, and backward's output of the same size), for a head of `vocab` rows
// in a dtype of `dtype_bytes`: one slice's logits in that dtype and in fp32 and their gradient, and
// backward's fp32 chunk. For a planner (FrozenHeadWorkingSet). Kit 1.1.
LOOM_API std::uint64_t head_loss_slice_bytes(std::int64_t vocab, std::uint64_t dtype_bytes);

}  // namespace loom::kit
