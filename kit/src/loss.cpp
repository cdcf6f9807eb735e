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

// Each row's log-sum-exp over the whole vocabulary and its target's logit, of fp32 logits z
// [n, V_local] holding columns [start, start + V_local) of the vocabulary (all of them without a
// group). Over a group: log sum exp = max + log sum exp(z - max), the max and the sum taken over
// every rank's columns; the target's logit lives on one rank, zeros elsewhere. Returns [n] each.
std::pair<at::Tensor, at::Tensor> row_statistics(const at::Tensor& z, const at::Tensor& target, std::int64_t start, Communicator* group) {
  if (group == nullptr) return {at::logsumexp(z, -1), z.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1)};
  const auto local = z.size(1);
  at::Tensor max = std::get<0>(z.max(-1)).contiguous();
  group->all_reduce_now({max}, ReduceOp::kMax);
  const at::Tensor here = (target >= start) & (target < start + local);
  const at::Tensor index = (target - start).clamp(0, local - 1).unsqueeze(1);
  at::Tensor sums = at::stack({(z - max.unsqueeze(1)).exp().sum(-1), z.gather(1, index).squeeze(1) * here}).contiguous();
  group->all_reduce_now({sums}, ReduceOp::kSum);
  return {sums[0].log() + max, sums[1]};
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
      const auto [l, picked] = row_statistics(z, target, start, group);
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

// A slice of the head's logits as the family makes them, in fp32: the head's product of `rows`,
// times the multiplier, soft-capped, then divided by `temperature` (a sampling objective's).
at::Tensor family_logits(const at::Tensor& rows, const at::Tensor& weight, const HeadLogits& head, double temperature) {
  at::Tensor z = at::matmul(rows, weight.t()).to(at::kFloat);
  if (head.multiplier != 1.0) z.mul_(head.multiplier);
  if (head.softcap > 0) z.div_(head.softcap).tanh_().mul_(head.softcap);
  if (temperature != 1.0) z.div_(temperature);
  return z;
}

// Turns `z` (family_logits of a slice [n, V_local], each row's log-sum-exp `lse` [n, 1], targets
// [n, 1]) in place into the derivative of sum_i w_i (lse_i - z_i[target_i]) with respect to the
// head's product, for rows of weight `row_weight` [n, 1]: (softmax - onehot) w through the
// temperature, the cap (1 - tanh²) and the multiplier. The loss weighs counted rows 1; a row's
// log-probability is that with weight -1. With `z` holding vocabulary columns [start, start +
// V_local), the one-hot is subtracted only on the rank that holds the target. (In place, not
// head_logits' copies: a slice's fp32 logits are the largest tensor the loss makes.)
void to_product_gradient(at::Tensor& z, const at::Tensor& lse, const at::Tensor& target, std::int64_t start, const at::Tensor& row_weight,
                         const HeadLogits& head, double temperature) {
  // The cap's derivative from the capped logits before they are overwritten.
  const at::Tensor capped_slope = head.softcap > 0 ? 1 - (z * (temperature / head.softcap)).square() : at::Tensor();
  const auto local = z.size(1);
  const at::Tensor here = ((target >= start) & (target < start + local)).to(at::kFloat);
  z.sub_(lse).exp_().scatter_add_(1, (target - start).clamp(0, local - 1), -here).mul_(row_weight);
  const double factor = head.multiplier / temperature;
  if (head.softcap > 0) z.mul_(capped_slope);
  if (factor != 1.0) z.mul_(factor);
}

// Backward's product of a saved per-row gradient [rows, H] (in the head's dtype) with each row's
// weight [rows] (fp32), a chunk of rows at a time in fp32: no fp32 copy of the whole gradient.
at::Tensor scale_rows(const at::Tensor& gradient, const at::Tensor& row_weight) {
  at::Tensor scaled = at::empty_like(gradient);
  const auto rows = gradient.size(0), chunk = std::max<std::int64_t>(1, kScaleChunkValues / std::max<std::int64_t>(gradient.size(1), 1));
  for (std::int64_t first = 0; first < rows; first += chunk) {
    const auto n = std::min(chunk, rows - first);
    const at::Tensor w = row_weight.dim() == 0 ? row_weight : row_weight.narrow(0, first, n).unsqueeze(1);
    scaled.narrow(0, first, n).copy_(gradient.narrow(0, first, n).to(at::kFloat) * w);
  }
  return scaled;
}

// Position i = b (T - 1) + t of targets [B, T - 1] predicts from hidden row b T + t = i + b.
at::Tensor predicting_rows(const at::Tensor& flat_targets, std::int64_t length) {
  const at::Tensor index = at::arange(flat_targets.size(0), flat_targets.options());
  return index + at::floor_divide(index, length - 1);
}

// The slices both functions below visit: `body(first, n, rows, input, target)` for positions
// [first, first + n) of targets [B, T - 1] (every rank of a group alike: by the whole vocabulary),
// with `rows` the indices of the head input's rows that predict them, `input` those rows [n, H]
// and `target` [n, 1].
template <class Body>
void for_head_slices(const at::Tensor& hidden, const at::Tensor& targets, std::int64_t vocab, std::int64_t slice_values, Body&& body) {
  const at::Tensor flat = hidden.contiguous().view({-1, hidden.size(2)});
  const at::Tensor flat_targets = targets.reshape({-1});
  const auto positions = flat_targets.size(0);
  const at::Tensor rows = predicting_rows(flat_targets, hidden.size(1));
  const auto per_slice = head_loss_rows(vocab, slice_values);
  for (std::int64_t first = 0; first < positions; first += per_slice) {
    const auto n = std::min(per_slice, positions - first);
    body(first, n, rows.narrow(0, first, n), flat.index_select(0, rows.narrow(0, first, n)), flat_targets.narrow(0, first, n).unsqueeze(1));
  }
}

// The loss from the head's input: logits are made a slice of rows at a time and never exist
// whole, nor does their gradient. The loss ends the graph, so its gradient with respect to the
// head's input is computed in the same pass and backward only scales it: no product is done twice.
// The head's weight is frozen (no gradient for it). Every position is visited, counted or not, as
// the sliced loss does: choosing the counted ones would need their number on the host, a wait for
// the whole forward pass.
// Over a head whose vocabulary is split over `group` (`group_pointer`, 0: whole here), this rank's
// rows [start, start + weight rows) of `vocab`: the row statistics are reduced over the group a
// slice at a time (every rank slices alike, by the whole vocabulary), and the gradient is this
// rank's part, which the caller sums over the group (copy_to_tensor_region).
struct NextTokenLossFromHidden : public torch::autograd::Function<NextTokenLossFromHidden> {
  // hidden [B, T, H], weight [V_local, H], targets [B, T - 1] (the labels shifted left), long.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                            std::int64_t slice_values, bool with_gradient, double multiplier, double softcap, std::int64_t start, std::int64_t vocab,
                            std::int64_t group_pointer) {
    auto* group = reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(group_pointer));
    [[maybe_unused]] const bool plain = multiplier == 1.0 && softcap <= 0 && group == nullptr;  // the GPU kernel takes whole plain logits only
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    at::Tensor gradient = with_gradient ? at::zeros({hidden.size(0) * hidden.size(1), hidden.size(2)}, hidden.options()) : at::Tensor();
    for_head_slices(hidden, targets, vocab, slice_values, [&](std::int64_t, [[maybe_unused]] std::int64_t n, const at::Tensor& slice_rows, const at::Tensor& input,
                                                              const at::Tensor& target) {
#ifdef LOOM_WITH_CUDA
      // On a GPU the slice's loss and gradient come from one kernel over the logits as the head's
      // product makes them, with the composite's float32 arithmetic.
      const auto dtype = launch::kernel_dtype(hidden.scalar_type());
      if (plain && hidden.is_cuda() && launch::kernels_take(hidden) && detail::next_token_loss_cuda_takes(vocab, dtype, {})) {
        const at::Tensor logits = at::matmul(input, weight.t()).contiguous();
        at::Tensor g = with_gradient ? at::empty_like(logits) : at::Tensor();
        const at::Tensor row_targets = target.reshape({-1}).contiguous();
        at::Tensor row_loss = at::empty({n}, logits.options().dtype(at::kFloat));
        launch::check_cuda(detail::next_token_loss_cuda(logits.data_ptr(), row_targets.data_ptr<std::int64_t>(), row_loss.data_ptr<float>(),
                                                        g.defined() ? g.data_ptr() : nullptr, n, vocab, dtype, launch::current_stream(logits)),
                           "next-token loss");
        total += row_loss.sum();
        if (with_gradient) gradient.index_copy_(0, slice_rows, at::matmul(g, weight));
        return;
      }
#endif
      const at::Tensor counted = (target != -100).to(at::kFloat);
      const HeadLogits head{multiplier, softcap};
      at::Tensor z = family_logits(input, weight, head, 1.0);
      const auto [lse, picked] = row_statistics(z, target.squeeze(1), start, group);
      total += ((lse - picked) * counted.squeeze(1)).sum();
      if (!with_gradient) return;
      // In the head's dtype, as the composite's backward hands it to the head's product.
      to_product_gradient(z, lse.unsqueeze(1), target, start, counted, head, 1.0);
      gradient.index_copy_(0, slice_rows, at::matmul(z.to(hidden.scalar_type()), weight));
    });
    if (with_gradient) ctx->save_for_backward({gradient});
    ctx->saved_data["with_gradient"] = with_gradient;
    ctx->saved_data["sizes"] = hidden.sizes().vec();
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    if (!ctx->saved_data["with_gradient"].toBool())
      throw std::logic_error("next_token_loss_sum_from_hidden: backward through a loss made without its gradient");
    const at::Tensor scaled = scale_rows(ctx->get_saved_variables()[0], grads[0].to(at::kFloat));
    return {scaled.view(ctx->saved_data["sizes"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Each position's log-probability of its label from the head's input, a slice of rows at a time
// as the loss from the head's input (and over a split vocabulary as it is): out [B, T] fp32,
// position t the label at t given the rows before it (0 at t = 0 and where the label is -100). The
// derivative of each position's value with respect to its predicting row of the head's input is
// made beside it; backward weighs those by the incoming gradient. Every position is visited,
// counted or not, as the loss does.
struct NextTokenLogpsFromHidden : public torch::autograd::Function<NextTokenLogpsFromHidden> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                            std::int64_t slice_values, bool with_gradient, double multiplier, double softcap, double temperature, std::int64_t start,
                            std::int64_t vocab, std::int64_t group_pointer) {
    auto* group = reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(group_pointer));
    const auto batch = hidden.size(0), length = hidden.size(1);
    const HeadLogits head{multiplier, softcap};
    at::Tensor logps = at::zeros({targets.numel()}, hidden.options().dtype(at::kFloat));
    at::Tensor derivative = with_gradient ? at::zeros({batch * length, hidden.size(2)}, hidden.options()) : at::Tensor();
    for_head_slices(hidden, targets, vocab, slice_values, [&](std::int64_t first, std::int64_t n, const at::Tensor& slice_rows, const at::Tensor& input,
                                                              const at::Tensor& target) {
      const at::Tensor counted = (target != -100).to(at::kFloat);
      at::Tensor z = family_logits(input, weight, head, temperature);
      const auto [lse, picked] = row_statistics(z, target.squeeze(1), start, group);
      logps.narrow(0, first, n).copy_((picked - lse) * counted.squeeze(1));
      if (!with_gradient) return;
      to_product_gradient(z, lse.unsqueeze(1), target, start, -counted, head, temperature);  // d logp = -d(lse - z[target])
      derivative.index_copy_(0, slice_rows, at::matmul(z.to(hidden.scalar_type()), weight));
    });
    if (with_gradient) ctx->save_for_backward({derivative});
    ctx->saved_data["with_gradient"] = with_gradient;
    ctx->saved_data["sizes"] = hidden.sizes().vec();
    // Position t + 1 of row b holds target t's.
    return at::cat({at::zeros({batch, 1}, logps.options()), logps.view({batch, length - 1})}, 1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    if (!ctx->saved_data["with_gradient"].toBool())
      throw std::logic_error("next_token_logps_from_hidden: backward through log-probabilities made without their gradient");
    const at::Tensor g = grads[0].to(at::kFloat);
    // Hidden row b T + t predicts position t + 1: its weight; the last row of each predicts nothing.
    const at::Tensor row_weight = at::cat({g.narrow(1, 1, g.size(1) - 1), at::zeros({g.size(0), 1}, g.options())}, 1).reshape({-1});
    const at::Tensor scaled = scale_rows(ctx->get_saved_variables()[0], row_weight);
    return {scaled.view(ctx->saved_data["sizes"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The checks both take, and the targets (labels shifted left) on hidden's device.
at::Tensor checked_targets(const char* who, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, std::int64_t slice_values) {
  if (slice_values < 1) throw std::invalid_argument(std::string(who) + ": slice_values must be at least 1");
  if (hidden.dim() != 3 || weight.dim() != 2 || weight.size(1) != hidden.size(2) || labels.dim() != 2 || labels.size(0) != hidden.size(0) ||
      labels.size(1) != hidden.size(1))
    throw std::invalid_argument(std::string(who) + ": hidden [B, T, H], weight [V, H] and labels [B, T] expected");
  return labels.narrow(1, 1, std::max<std::int64_t>(0, labels.size(1) - 1)).to(hidden.device()).contiguous();
}

std::int64_t group_address(Communicator* group) { return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(group)); }

at::Tensor loss_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head, std::int64_t start,
                            std::int64_t vocab, Communicator* group, std::int64_t slice_values) {
  const at::Tensor targets = checked_targets("next_token_loss_sum_from_hidden", hidden, weight, labels, slice_values);
  if (hidden.size(1) < 2) return at::zeros({}, hidden.options().dtype(at::kFloat));
  return NextTokenLossFromHidden::apply(hidden, weight, targets, slice_values, at::GradMode::is_enabled() && hidden.requires_grad(), head.multiplier,
                                        head.softcap, start, vocab, group_address(group));
}

at::Tensor logps_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head, double temperature,
                             std::int64_t start, std::int64_t vocab, Communicator* group, std::int64_t slice_values) {
  const at::Tensor targets = checked_targets("next_token_logps_from_hidden", hidden, weight, labels, slice_values);
  if (!(temperature > 0)) throw std::invalid_argument("next_token_logps_from_hidden: temperature must be above 0");
  if (at::GradMode::is_enabled() && weight.requires_grad())
    throw std::invalid_argument("next_token_logps_from_hidden: the head's weight trains; take log-probabilities from its logits");
  if (hidden.size(1) < 2) return at::zeros({hidden.size(0), hidden.size(1)}, hidden.options().dtype(at::kFloat));
  return NextTokenLogpsFromHidden::apply(hidden, weight, targets, slice_values, at::GradMode::is_enabled() && hidden.requires_grad(), head.multiplier,
                                         head.softcap, temperature, start, vocab, group_address(group));
}

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
  // A weight that learns needs its own gradient, and fp16 its loss scale before the gradient is
  // rounded to fp16 (probabilities of a large vocabulary are below fp16's normal range): the
  // composite serves both.
  if ((at::GradMode::is_enabled() && weight.requires_grad()) || hidden.scalar_type() == at::kHalf)
    return next_token_loss_sum(head_logits(at::linear(hidden, weight), head), labels, kLossSliceValues);
  return loss_from_hidden(hidden, weight, labels, head, 0, weight.size(0), nullptr, slice_values);
}

at::Tensor next_token_logps_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head,
                                        double temperature, std::int64_t slice_values) {
  return logps_from_hidden(hidden, weight, labels, head, temperature, 0, weight.size(0), nullptr, slice_values);
}

at::Tensor vocab_parallel_loss_sum_from_hidden(const at::Tensor& hidden, const at::Tensor& weight_rows, std::int64_t start, std::int64_t vocab,
                                               const at::Tensor& labels, const HeadLogits& head, Communicator& group, std::int64_t slice_values) {
  if (group.size() == 1) return next_token_loss_sum_from_hidden(hidden, weight_rows, labels, head, slice_values);
  return loss_from_hidden(copy_to_tensor_region(hidden, &group), weight_rows, labels, head, start, vocab, &group, slice_values);
}

at::Tensor vocab_parallel_logps_from_hidden(const at::Tensor& hidden, const at::Tensor& weight_rows, std::int64_t start, std::int64_t vocab,
                                            const at::Tensor& labels, const HeadLogits& head, double temperature, Communicator& group,
                                            std::int64_t slice_values) {
  if (group.size() == 1) return next_token_logps_from_hidden(hidden, weight_rows, labels, head, temperature, slice_values);
  return logps_from_hidden(copy_to_tensor_region(hidden, &group), weight_rows, labels, head, temperature, start, vocab, &group, slice_values);
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
