#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace loom::core {

// Each labelled token's log-probability under logits [B, T, V]: out[b][t] = log_softmax(logits[b][t-1])[labels[b][t]],
// float32 [B, T], 0 at t = 0 and where labels hold kIgnoreLabel. Differentiable in the logits; a
// slice of about `slice_values` values is made float32 at a time, and backward recomputes the
// softmax from the logits and one saved log-sum-exp a position, so no float32 copy of the logits,
// nor their log-softmax, exists whole.
at::Tensor next_token_logps(const at::Tensor& logits, const at::Tensor& labels, std::int64_t slice_values = std::int64_t{1} << 24);

}  // namespace loom::core
