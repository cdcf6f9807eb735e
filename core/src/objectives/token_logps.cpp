#include "objectives/token_logps.hpp"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "loom/collator.hpp"

namespace loom::core {
namespace {

// Positions [from, from + count) of row b's predicting logits (those at t-1 for the token at t).
template <class Body>
void for_slices(const at::Tensor& logits, std::int64_t slice_values, Body&& body) {
  const std::int64_t rows = logits.size(0), steps = logits.size(1) - 1, vocab = logits.size(2);
  const std::int64_t span = std::max<std::int64_t>(1, slice_values / std::max<std::int64_t>(vocab, 1));
  for (std::int64_t b = 0; b < rows; ++b)
    for (std::int64_t from = 0; from < steps; from += span) body(b, from, std::min(span, steps - from));
}

struct NextTokenLogps : public torch::autograd::Function<NextTokenLogps> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& labels, std::int64_t slice_values) {
    const at::Tensor targets = labels.narrow(1, 1, labels.size(1) - 1);
    const at::Tensor valid = targets.ne(kIgnoreLabel);
    const at::Tensor safe = targets.clamp_min(0);
    at::Tensor out = at::zeros({logits.size(0), logits.size(1)}, logits.options().dtype(at::kFloat));
    at::Tensor lse = at::zeros({logits.size(0), logits.size(1) - 1}, logits.options().dtype(at::kFloat));
    for_slices(logits, slice_values, [&](std::int64_t b, std::int64_t from, std::int64_t count) {
      const at::Tensor part = logits[b].narrow(0, from, count).to(at::kFloat);
      const at::Tensor norm = part.logsumexp(-1);
      lse[b].narrow(0, from, count).copy_(norm);
      const at::Tensor picked = part.gather(1, safe[b].narrow(0, from, count).unsqueeze(1)).squeeze(1);
      out[b].narrow(0, from + 1, count).copy_((picked - norm) * valid[b].narrow(0, from, count));
    });
    ctx->save_for_backward({logits, labels, lse});
    ctx->saved_data["slice_values"] = slice_values;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &labels = saved[1], &lse = saved[2];
    const std::int64_t slice_values = ctx->saved_data["slice_values"].toInt();
    const at::Tensor targets = labels.narrow(1, 1, labels.size(1) - 1);
    const at::Tensor safe = targets.clamp_min(0);
    const at::Tensor g = grads[0].narrow(1, 1, labels.size(1) - 1).to(at::kFloat) * targets.ne(kIgnoreLabel);
    at::Tensor grad = at::zeros_like(logits);
    for_slices(logits, slice_values, [&](std::int64_t b, std::int64_t from, std::int64_t count) {
      const at::Tensor weight = g[b].narrow(0, from, count).unsqueeze(1);
      // d logp / d logits = onehot(target) - softmax
      at::Tensor part = (logits[b].narrow(0, from, count).to(at::kFloat) - lse[b].narrow(0, from, count).unsqueeze(1)).exp_().mul_(weight).neg_();
      part.scatter_add_(1, safe[b].narrow(0, from, count).unsqueeze(1), weight);
      grad[b].narrow(0, from, count).copy_(part);
    });
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor next_token_logps(const at::Tensor& logits, const at::Tensor& labels, std::int64_t slice_values) {
  if (logits.size(1) < 2) return at::zeros({logits.size(0), logits.size(1)}, logits.options().dtype(at::kFloat));
  return NextTokenLogps::apply(logits, labels.to(logits.device()), slice_values);
}

}  // namespace loom::core
