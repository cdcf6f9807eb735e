#pragma once
// The summed next-token cross-entropy an SDK-only test model's loss_sum returns (what the kit's
// next_token_loss_sum gives, written without the kit): logits [B, T, V] at position t against
// labels at t + 1, -100 left out.
#include <ATen/ATen.h>

namespace loom_test_plugins {

inline at::Tensor next_token_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  const auto positions = logits.size(1) - 1, vocab = logits.size(2);
  return at::cross_entropy_loss(logits.narrow(1, 0, positions).reshape({-1, vocab}).to(at::kFloat), labels.narrow(1, 1, positions).reshape({-1}), {},
                                at::Reduction::Sum, -100);
}

}  // namespace loom_test_plugins
