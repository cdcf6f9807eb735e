#include "loom/kit/loss.hpp"

#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "loom/kit/blocks.hpp"
#include "loom/kit/tensor_parallel.hpp"
#ifdef LOOM_WITH_CUDA
#include "decode_kernels.hpp"
#include "kernel_launch.hpp"
#endif

namespace loom::kit {
namespace {

// A slice of rows at a time: each slice's fp32 copy holds about `slice_values` values.
std::int64_t loss_rows_per_slice(std::int64_t vocab, std::int64_t slice_values) {
  return std::max<std::int64_t>(1, slice_values / std::max<std::int64_t>(vocab, 1));
}

// The slices of [B, T - 1] rows the loss visits: whole batch rows when they fit, else runs of
// positions within one batch row. Each is a view of the logits; its fp32 copy stays small.
struct Slice {
  std::int64_t b, nb, t, nt;
};
std::vector<Slice> loss_slices(std::int64_t batch, std::int64_t positions, std::int64_t vocab, std::int64_t slice_values) {
  const auto rows = loss_rows_per_slice(vocab, slice_values);
  std::vector<Slice> out;
  if (positions <= 0) return out;
  if (positions <= rows) {
    const auto nb = std::max<std::int64_t>(1, rows / positions);
    for (std::int64_t b = 0; b < batch; b += nb) out.push_back({b, std::min(nb, batch - b), 0, positions});
  } else {
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t t = 0; t < positions; t += rows) out.push_back({b, 1, t, std::min(rows, positions - t)});
  }
  return out;
}

// The loss over logits whose vocabulary is split over `group` (null: whole here): this rank holds
// columns [start, start + V_local). The row statistics (maximum, sum of exponentials, target logit)
// are reduced over the group, a slice at a time; every rank slices alike (by the whole vocabulary).
struct NextTokenLoss : public torch::autograd::Function<NextTokenLoss> {
  static at::Tensor view(const at::Tensor& x, const Slice& s) { return x.narrow(0, s.b, s.nb).narrow(1, s.t, s.nt); }

  // logits [B, T, V_local]; targets [B, T - 1] (the labels shifted left), long, on the logits' device.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, std::int64_t start,
                            std::int64_t vocab, std::int64_t group_pointer, std::int64_t slice_values) {
    auto* group = reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(group_pointer));
    const auto local = logits.size(2);
    at::Tensor lse = at::empty(targets.sizes(), logits.options().dtype(at::kFloat));
    at::Tensor total = at::zeros({}, logits.options().dtype(at::kFloat));
    for (const auto& s : loss_slices(logits.size(0), targets.size(1), vocab, slice_values)) {
      const at::Tensor z = view(logits, s).to(at::kFloat).reshape({-1, local});
      const at::Tensor target = view(targets, s).reshape({-1});
      at::Tensor l, picked;
      if (group == nullptr) {
        l = at::logsumexp(z, -1);
        picked = z.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1);
      } else {
        // log sum exp over the whole vocabulary = max + log sum exp(z - max), the max and the sum
        // taken over every rank's columns; the target's logit lives on one rank, zeros elsewhere.
        at::Tensor max = std::get<0>(z.max(-1)).contiguous();
        group->all_reduce_now({max}, ReduceOp::kMax);
        const at::Tensor here = (target >= start) & (target < start + local);
        const at::Tensor index = (target - start).clamp(0, local - 1).unsqueeze(1);
        at::Tensor sums = at::stack({(z - max.unsqueeze(1)).exp().sum(-1), z.gather(1, index).squeeze(1) * here}).contiguous();
        group->all_reduce_now({sums}, ReduceOp::kSum);
        l = sums[0].log() + max;
        picked = sums[1];
      }
      view(lse, s).copy_(l.view({s.nb, s.nt}));
      total += ((l - picked) * (target != -100)).sum();
    }
    ctx->save_for_backward({logits, targets, lse});
    ctx->saved_data["start"] = start;
    ctx->saved_data["vocab"] = vocab;
    ctx->saved_data["slice_values"] = slice_values;
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &targets = saved[1], &lse = saved[2];
    const auto local = logits.size(2);
    const auto start = ctx->saved_data["start"].toInt(), vocab = ctx->saved_data["vocab"].toInt();
    const auto slice_values = ctx->saved_data["slice_values"].toInt();
    const at::Tensor scale = grads[0].to(at::kFloat);
    at::Tensor grad = at::zeros_like(logits);  // the last position predicts nothing: zero
    for (const auto& s : loss_slices(logits.size(0), targets.size(1), vocab, slice_values)) {
      const at::Tensor target = view(targets, s).reshape({-1});
      // d(lse - z[target])/dz = softmax(z) - onehot(target), for counted rows; a rank subtracts
      // the one-hot only where the target is among its columns.
      at::Tensor g = (view(logits, s).to(at::kFloat).reshape({-1, local}) - view(lse, s).reshape({-1, 1})).exp_();
      const at::Tensor here = ((target >= start) & (target < start + local)).to(at::kFloat).unsqueeze(1);
      g.scatter_add_(1, (target - start).clamp(0, local - 1).unsqueeze(1), -here);
      g.mul_((target != -100).to(at::kFloat).unsqueeze(1) * scale);
      view(grad, s).copy_(g.view({s.nb, s.nt, local}));
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Rows of a slice of the loss from the head's input: whole tiles of 128 for the head's product
// where a slice holds that many.
std::int64_t head_loss_rows(std::int64_t vocab, std::int64_t slice_values) {
  const auto rows = loss_rows_per_slice(vocab, slice_values);
  return rows >= 128 ? rows - rows % 128 : rows;
}
constexpr std::int64_t kScaleChunkValues = std::int64_t{1} << 22;  // backward's fp32 chunk

// The loss from the head's input: logits are made a slice of rows at a time and never exist
// whole, nor does their gradient. The loss ends the graph, so its gradient with respect to the
// head's input is computed in the same pass and backward only scales it: no product is done twice.
// The head's weight is frozen (no gradient for it). Every position is visited, counted or not, as
// the sliced loss does: choosing the counted ones would need their number on the host, a wait for
// the whole forward pass.
struct NextTokenLossFromHidden : public torch::autograd::Function<NextTokenLossFromHidden> {
  // hidden [B, T, H], weight [V, H], targets [B, T - 1] (the labels shifted left), long.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                            std::int64_t slice_values, bool with_gradient, double multiplier, double softcap) {
    [[maybe_unused]] const bool plain = multiplier == 1.0 && softcap <= 0;  // the GPU kernel takes plain logits only
    const auto length = hidden.size(1), width = hidden.size(2), vocab = weight.size(0);
    const at::Tensor flat = hidden.contiguous().view({-1, width});
    const at::Tensor flat_targets = targets.reshape({-1});
    const auto positions = flat_targets.size(0);
    // Position i = b (T - 1) + t predicts from hidden row b T + t = i + b.
    const at::Tensor index = at::arange(positions, flat_targets.options());
    const at::Tensor rows = index + at::floor_divide(index, length - 1);
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    at::Tensor gradient = with_gradient ? at::zeros_like(flat) : at::Tensor();
    const auto per_slice = head_loss_rows(vocab, slice_values);
    for (std::int64_t first = 0; first < positions; first += per_slice) {
      const auto n = std::min(per_slice, positions - first);
      const at::Tensor slice_rows = rows.narrow(0, first, n);
      const at::Tensor target = flat_targets.narrow(0, first, n).unsqueeze(1);
#ifdef LOOM_WITH_CUDA
      // On a GPU the slice's loss and gradient come from one kernel over the logits as the head's
      // product makes them, with the composite's float32 arithmetic.
      const auto dtype = launch::kernel_dtype(hidden.scalar_type());
      if (plain && hidden.is_cuda() && launch::kernels_take(hidden) && detail::next_token_loss_cuda_takes(vocab, dtype, {})) {
        const at::Tensor logits = at::matmul(flat.index_select(0, slice_rows), weight.t()).contiguous();
        at::Tensor g = with_gradient ? at::empty_like(logits) : at::Tensor();
        const at::Tensor row_targets = target.reshape({-1}).contiguous();
        at::Tensor row_loss = at::empty({n}, logits.options().dtype(at::kFloat));
        launch::check_cuda(detail::next_token_loss_cuda(logits.data_ptr(), row_targets.data_ptr<std::int64_t>(), row_loss.data_ptr<float>(),
                                                        g.defined() ? g.data_ptr() : nullptr, n, vocab, dtype, launch::current_stream(logits)),
                           "next-token loss");
        total += row_loss.sum();
        if (with_gradient) gradient.index_copy_(0, slice_rows, at::matmul(g, weight));
        continue;
      }
#endif
      const at::Tensor counted = (target != -100).to(at::kFloat);
      const at::Tensor safe = target.clamp_min(0);
      at::Tensor z = at::matmul(flat.index_select(0, slice_rows), weight.t()).to(at::kFloat);  // the head's logits, then fp32
      if (multiplier != 1.0) z.mul_(multiplier);
      if (softcap > 0) z.div_(softcap).tanh_().mul_(softcap);
      const at::Tensor lse = at::logsumexp(z, -1, true);
      total += ((lse - z.gather(1, safe)) * counted).sum();
      if (!with_gradient) continue;
      // The cap's derivative, 1 - tanh², from the capped logits before they are overwritten.
      const at::Tensor capped_slope = softcap > 0 ? 1 - (z / softcap).square() : at::Tensor();
      // d(lse - z[target])/dz = softmax(z) - onehot(target) on counted rows, in the head's dtype as
      // the composite's backward hands it to the head's product.
      z.sub_(lse).exp_().scatter_add_(1, safe, at::full({n, 1}, -1.0f, z.options())).mul_(counted);
      if (softcap > 0) z.mul_(capped_slope);
      if (multiplier != 1.0) z.mul_(multiplier);
      gradient.index_copy_(0, slice_rows, at::matmul(z.to(hidden.scalar_type()), weight));
    }
    if (with_gradient) ctx->save_for_backward({gradient});
    ctx->saved_data["with_gradient"] = with_gradient;
    ctx->saved_data["sizes"] = hidden.sizes().vec();
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    if (!ctx->saved_data["with_gradient"].toBool())
      throw std::logic_error("next_token_loss_sum_from_hidden: backward through a loss made without its gradient");
    const at::Tensor gradient = ctx->get_saved_variables()[0];
    const at::Tensor scale = grads[0].to(at::kFloat);
    // Scaled in fp32 a chunk of rows at a time: no fp32 copy of the whole gradient.
    at::Tensor scaled = at::empty_like(gradient);
    const auto rows = gradient.size(0), chunk = std::max<std::int64_t>(1, kScaleChunkValues / std::max<std::int64_t>(gradient.size(1), 1));
    for (std::int64_t first = 0; first < rows; first += chunk) {
      const auto n = std::min(chunk, rows - first);
      scaled.narrow(0, first, n).copy_(gradient.narrow(0, first, n).to(at::kFloat) * scale);
    }
    return {scaled.view(ctx->saved_data["sizes"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor next_token_loss_sum(const at::Tensor& logits, const at::Tensor& labels) { return next_token_loss_sum(logits, labels, kLossSliceValues); }

std::uint64_t head_loss_slice_bytes(std::int64_t vocab, std::uint64_t dtype_bytes) {
  const auto rows = static_cast<std::uint64_t>(head_loss_rows(vocab, kHeadLossSliceValues));
  // The slice's logits in the dtype and in fp32 (the gradient is made in place of the fp32 ones),
  // that gradient in the dtype; backward's chunk in fp32, twice (the copy and its product).
  return rows * static_cast<std::uint64_t>(vocab) * (2 * dtype_bytes + 4) + 2 * static_cast<std::uint64_t>(kScaleChunkValues) * 4;
}

at::Tensor head_logits(const at::Tensor& logits, const HeadLogits& head) {
  const at::Tensor scaled = head.multiplier != 1.0 ? logits * head.multiplier : logits;
  return head.softcap > 0 ? soft_cap(scaled, head.softcap) : scaled;
}

at::Tensor next_token_loss_sum_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, std::int64_t slice_values) {
  return next_token_loss_sum_from_hidden(hidden, weight, labels, HeadLogits{}, slice_values);
}

at::Tensor next_token_loss_sum_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head,
                                           std::int64_t slice_values) {
  if (slice_values < 1) throw std::invalid_argument("next_token_loss_sum_from_hidden: slice_values must be at least 1");
  if (hidden.dim() != 3 || weight.dim() != 2 || weight.size(1) != hidden.size(2) || labels.dim() != 2 || labels.size(0) != hidden.size(0) ||
      labels.size(1) != hidden.size(1))
    throw std::invalid_argument("next_token_loss_sum_from_hidden: hidden [B, T, H], weight [V, H] and labels [B, T] expected");
  const bool grad_mode = at::GradMode::is_enabled();
  // A weight that learns needs its own gradient, and fp16 its loss scale before the gradient is
  // rounded to fp16 (probabilities of a large vocabulary are below fp16's normal range): the
  // composite serves both.
  if ((grad_mode && weight.requires_grad()) || hidden.scalar_type() == at::kHalf)
    return next_token_loss_sum(head_logits(at::linear(hidden, weight), head), labels, kLossSliceValues);
  if (hidden.size(1) < 2) return at::zeros({}, hidden.options().dtype(at::kFloat));
  const at::Tensor targets = labels.narrow(1, 1, labels.size(1) - 1).to(hidden.device()).contiguous();
  return NextTokenLossFromHidden::apply(hidden, weight, targets, slice_values, grad_mode && hidden.requires_grad(), head.multiplier, head.softcap);
}

at::Tensor next_token_loss_sum(const at::Tensor& logits, const at::Tensor& labels, std::int64_t slice_values) {
  if (slice_values < 1) throw std::invalid_argument("next_token_loss_sum: slice_values must be at least 1");
  if (logits.size(1) < 2) return at::zeros({}, logits.options().dtype(at::kFloat));
  return NextTokenLoss::apply(logits, labels.narrow(1, 1, labels.size(1) - 1).contiguous(), 0, logits.size(2), 0, slice_values);
}

at::Tensor vocab_parallel_loss_sum(const at::Tensor& logits_shard, std::int64_t start, std::int64_t vocab, const at::Tensor& labels, Communicator& group) {
  if (group.size() == 1) return next_token_loss_sum(logits_shard, labels);
  if (logits_shard.size(1) < 2) return at::zeros({}, logits_shard.options().dtype(at::kFloat));
  return NextTokenLoss::apply(logits_shard, labels.narrow(1, 1, labels.size(1) - 1).contiguous(), start, vocab,
                              static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&group)), kLossSliceValues);
}


}  // namespace loom::kit
