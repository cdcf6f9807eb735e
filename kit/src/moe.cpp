#include "loom/kit/moe.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/version.h>

#include <numeric>
#include <stdexcept>

#include <torch/csrc/autograd/custom_function.h>

#include "loom/communicator.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/torch_compat.hpp"

// LibTorch 2.8 on has a grouped GEMM with a derivative (bf16 on Hopper; 2.9 widened it to
// compute capability 8.0): every expert's group in one launch, with no count read back to the host.
#if defined(LOOM_WITH_CUDA) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9))
#define LOOM_GROUPED_MM 1
#endif

namespace loom::kit {
namespace {

#ifdef LOOM_GROUPED_MM
bool grouped_mm_serves(const at::Tensor& x, const ExpertsMatrix& gate_up, const ExpertsMatrix& down, const ExpertsLowRank& gate_up_delta,
                       const ExpertsLowRank& down_delta) {
  if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || gate_up.dtype() != at::kBFloat16 || down.dtype() != at::kBFloat16) return false;
  // Rows of 16-byte multiples, as the kernel's TMA loads need.
  if (x.size(1) % 8 != 0 || down.in % 8 != 0) return false;
  for (const ExpertsLowRank* d : {&gate_up_delta, &down_delta})
    if (d->defined() && (d->a.scalar_type() != at::kBFloat16 || d->b.scalar_type() != at::kBFloat16 || d->a.size(1) % 8 != 0)) return false;
  return compat::cuda_device_capability(static_cast<int>(x.device().index())) >= 80;
}
#endif

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// x W[e]^T over each expert's run of the sorted rows `x` (counts [E] on the CPU), by one product an
// expert. With no rows at all, expert 0's product runs on none, so the output still comes from the
// weight's graph: every rank of an expert group must run the same backward.
at::Tensor looped_values(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& counts) {
  const auto* count = counts.data_ptr<std::int64_t>();
  std::vector<at::Tensor> outputs;
  std::int64_t at = 0;
  for (std::int64_t e = 0; e < weight.size(0); ++e) {
    if (count[e] == 0 && !(e == 0 && x.size(0) == 0)) continue;
    outputs.push_back(at::linear(x.narrow(0, at, count[e]), weight[e]));
    at += count[e];
  }
  return at::cat(outputs, 0);
}

// x W[e]^T over a frozen stored weight, each expert's rows given by `groups` (its row counts [E] on
// the CPU for the loop; the groups' ends on the GPU for the grouped GEMM): dequantized for the
// products and again for the input's gradient, so no dense copy outlives either.
template <bool kGrouped>
struct StoredProduct : public torch::autograd::Function<StoredProduct<kGrouped>> {
  static at::Tensor product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& groups) {
#ifdef LOOM_GROUPED_MM
    if constexpr (kGrouped) return at::_grouped_mm(x, w.transpose(1, 2), groups);
#endif
    return looped_values(x, w, groups);
  }
  static at::Tensor values(AutogradContext* ctx) {
    auto& weight = *reinterpret_cast<LinearWeight*>(static_cast<std::intptr_t>(ctx->saved_data["weight"].toInt()));
    return ExpertsMatrix(weight, ctx->saved_data["experts"].toInt(), ctx->saved_data["out"].toInt(), ctx->saved_data["in"].toInt()).values();
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& groups, std::int64_t weight, std::int64_t experts,
                            std::int64_t out, std::int64_t in) {
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["experts"] = experts;
    ctx->saved_data["out"] = out;
    ctx->saved_data["in"] = in;
    ctx->save_for_backward({groups});
    return product(x, values(ctx), groups);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor groups = ctx->get_saved_variables()[0];
    return {product(grads[0].contiguous(), values(ctx).transpose(1, 2), groups), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
template <bool kGrouped>
at::Tensor stored_product(const at::Tensor& x, const ExpertsMatrix& weight, const at::Tensor& groups) {
  return StoredProduct<kGrouped>::apply(x, groups, static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(weight.stored)), weight.experts, weight.out,
                                        weight.in);
}

// x W[e]^T by one product an expert, the low-rank delta beside it in the same loop, added scaled.
at::Tensor looped_product(const at::Tensor& x, const ExpertsMatrix& weight, const ExpertsLowRank& delta, const at::Tensor& counts) {
  at::Tensor y = weight.stored == nullptr ? looped_values(x, weight.tensor, counts) : stored_product<false>(x, weight, counts);
  if (delta.defined()) y = at::add(y, looped_values(looped_values(x, delta.a, counts), delta.b, counts), delta.scale);
  return y;
}

#ifdef LOOM_GROUPED_MM
// x W[e]^T for every group at once, the low-rank delta as two more grouped products of rank r.
at::Tensor grouped_product(const at::Tensor& x, const ExpertsMatrix& weight, const ExpertsLowRank& delta, const at::Tensor& ends) {
  at::Tensor y = weight.stored == nullptr ? at::_grouped_mm(x, weight.tensor.transpose(1, 2), ends) : stored_product<true>(x, weight, ends);
  // The delta scaled as it is added: one pass over the output, forward and backward.
  if (delta.defined()) y = at::add(y, at::_grouped_mm(at::_grouped_mm(x, delta.a.transpose(1, 2), ends), delta.b.transpose(1, 2), ends), delta.scale);
  return y;
}
#endif

// What each expert's gate_up product gives down (ExpertActivation): the fused halves' kernel where
// the form is transformers' own.
at::Tensor expert_activation(const at::Tensor& both, const ExpertActivation& a) {
  if (!a.interleaved && a.limit <= 0) return swiglu_halves(both);
  const std::int64_t width = both.size(-1) / 2;
  const at::Tensor gate = a.interleaved ? both.slice(-1, 0, c10::nullopt, 2) : both.narrow(-1, 0, width);
  const at::Tensor up = a.interleaved ? both.slice(-1, 1, c10::nullopt, 2) : both.narrow(-1, width, width);
  return a.limit > 0 ? clamped_swiglu(gate, up, a.alpha, a.limit) : swiglu(gate, up);
}

// The experts' biases and activation, for the sorted products.
struct ExpertsExtras {
  const ExpertActivation& activation;
  const at::Tensor& gate_up_bias;
  const at::Tensor& down_bias;
};

// y plus each sorted row's expert's bias [E, width] (none where undefined); `counts` [E] rows each
// and `rows` of them (given: no count read back to the host).
at::Tensor with_bias(const at::Tensor& y, const at::Tensor& bias, const at::Tensor& counts) {
  if (!bias.defined()) return y;
  // Each expert's index repeated its count of times (the output size given: the repeats' overload, not one count for all).
  const at::Tensor row_experts = at::repeat_interleave(counts.to(bias.device()), c10::optional<std::int64_t>(y.size(0)));
  return y + bias.index_select(0, row_experts);
}

// The experts on rows `x` sorted by expert, `counts` [E] rows each (any device).
at::Tensor sorted_products(const at::Tensor& x, const at::Tensor& counts, const ExpertsMatrix& gate_up, const ExpertsMatrix& down,
                           const ExpertsLowRank& gate_up_delta, const ExpertsLowRank& down_delta, const ExpertsExtras& extras) {
#ifdef LOOM_GROUPED_MM
  if (grouped_mm_serves(x, gate_up, down, gate_up_delta, down_delta)) {
    const at::Tensor ends = at::cumsum(counts.to(x.device()), 0, at::kInt);
    const at::Tensor both = with_bias(grouped_product(x, gate_up, gate_up_delta, ends), extras.gate_up_bias, counts);
    return with_bias(grouped_product(expert_activation(both, extras.activation), down, down_delta, ends), extras.down_bias, counts);
  }
#endif
  // Elsewhere (the CPU; a GPU without the grouped GEMM) one product pair an expert.
  const at::Tensor on_host = counts.to(at::kCPU);
  const at::Tensor both = with_bias(looped_product(x, gate_up, gate_up_delta, on_host), extras.gate_up_bias, on_host);
  return with_bias(looped_product(expert_activation(both, extras.activation), down, down_delta, on_host), extras.down_bias, on_host);
}

void check_experts(const ExpertsMatrix& gate_up, const ExpertsMatrix& down, const ExpertsLowRank& gate_up_delta, const ExpertsLowRank& down_delta,
                   const at::Tensor& gate_up_bias, const at::Tensor& down_bias) {
  const std::int64_t experts = gate_up.experts, width = down.in;
  if (gate_up.out != 2 * width || down.experts != experts || gate_up.in != down.out) throw std::logic_error("grouped_experts: gate_up and down do not match");
  if ((gate_up_bias.defined() && gate_up_bias.sizes() != at::IntArrayRef{experts, gate_up.out}) ||
      (down_bias.defined() && down_bias.sizes() != at::IntArrayRef{experts, down.out}))
    throw std::logic_error("grouped_experts: a bias does not match its weight");
  for (const auto& [delta, weight] : {std::pair{&gate_up_delta, &gate_up}, std::pair{&down_delta, &down}})
    if (delta->defined() && (delta->a.size(0) != experts || delta->b.size(0) != experts || delta->a.size(2) != weight->in ||
                             delta->b.size(1) != weight->out || delta->b.size(2) != delta->a.size(1)))
      throw std::logic_error("grouped_experts: a low-rank delta does not match its weight");
}

// Every (row, pick) of a routing sorted by expert once, so the groups lie back to back: the picks'
// experts in row-major order, the permutation, each sorted pick's row and routing weight.
struct SortedPicks {
  at::Tensor flat, order, rows, weights;
  std::int64_t k = 0;
};
SortedPicks sort_picks(const Routing& routing) {
  SortedPicks p;
  p.flat = routing.experts.reshape({-1});
  p.order = at::argsort(p.flat, /*stable=*/true);
  p.rows = at::div(p.order, routing.experts.size(1), "floor");
  p.weights = routing.weights.reshape({-1}).index_select(0, p.order);
  p.k = routing.experts.size(1);
  return p;
}

// The permutation that undoes `order`.
at::Tensor inverse_of(const at::Tensor& order) { return at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options())); }

// The sorted picks' outputs y weighted in the routing weights' dtype (fp32 for Mixtral), then
// summed into their rows in hidden's: each row's k outputs put back in pick order and summed there,
// not added into the row by atomics, so the bits are the same on every run (as an expert group's
// ranks decoding in lockstep need).
at::Tensor scatter_weighted(const at::Tensor& hidden, const SortedPicks& p, const at::Tensor& y) {
  const at::Tensor weighted = (y * p.weights.unsqueeze(-1)).to(hidden.scalar_type());
  return weighted.index_select(0, inverse_of(p.order)).view({hidden.size(0), p.k, hidden.size(1)}).sum(1);
}

// How many picks each of `experts` experts got, counted on the device without a host sync
// (bincount reads the largest pick back): a GPU's grouped products then run without one, so a
// decode step can be recorded as a CUDA graph.
at::Tensor pick_counts(const SortedPicks& p, std::int64_t experts) {
  return at::zeros({experts}, p.flat.options()).scatter_add_(0, p.flat, at::ones_like(p.flat));
}

// Rows over an expert group: runs of `send[i]` rows to rank i, `receive[i]` rows from rank i back.
at::Tensor exchange(const at::Tensor& x, const std::vector<std::int64_t>& send, const std::vector<std::int64_t>& receive, Communicator& group) {
  auto* all_to_all = dynamic_cast<AllToAll*>(&group);
  if (all_to_all == nullptr) throw std::logic_error("grouped_experts: the expert group offers no all-to-all");
  auto shape = x.sizes().vec();
  shape[0] = std::accumulate(receive.begin(), receive.end(), std::int64_t{0});
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor in = x.contiguous();
  all_to_all->all_to_all(out, in, receive, send)->wait();
  return out;
}

// The exchange as an autograd step: the gradients go back the way the rows came.
struct ExchangeRows : public torch::autograd::Function<ExchangeRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::int64_t group, const std::vector<std::int64_t>& send,
                            const std::vector<std::int64_t>& receive) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send;
    ctx->saved_data["receive"] = receive;
    return exchange(x, send, receive, *reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(group)));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& group = *reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt()));
    return {exchange(grads[0], ctx->saved_data["receive"].toIntVector(), ctx->saved_data["send"].toIntVector(), group), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor exchange_rows(const at::Tensor& x, const std::vector<std::int64_t>& send, const std::vector<std::int64_t>& receive, Communicator& group) {
  return ExchangeRows::apply(x, static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&group)), send, receive);
}

}  // namespace

Routing route(const at::Tensor& hidden, const at::Tensor& router, const RouterSettings& settings) {
  Routing r;
  r.logits = at::linear(hidden, router);
  const at::Tensor probabilities = at::softmax(r.logits, -1, at::kFloat);
  auto [top, experts] = at::topk(probabilities, settings.top_k, -1);
  if (settings.normalize) top = top / top.sum(-1, true);
  r.weights = settings.weights_in_hidden_dtype ? top.to(hidden.scalar_type()) : top;
  r.experts = experts;
  return r;
}

Routing route_sigmoid_grouped(const at::Tensor& hidden, const at::Tensor& router, const at::Tensor& correction_bias, const GroupedSigmoidRouting& s) {
  const auto experts = router.size(0);
  if (s.groups < 1 || experts % s.groups != 0 || s.top_groups < 1 || s.top_groups > s.groups || s.top_k < 1 ||
      s.top_k > s.top_groups * (experts / s.groups))
    throw std::logic_error("route_sigmoid_grouped: " + std::to_string(experts) + " experts in " + std::to_string(s.groups) + " groups, " +
                           std::to_string(s.top_groups) + " kept, top " + std::to_string(s.top_k));
  Routing r;
  r.logits = at::linear(hidden.to(at::kFloat), router.to(at::kFloat));
  const at::Tensor scores = at::sigmoid(r.logits);
  const at::Tensor biased = scores + correction_bias.to(at::kFloat);
  const auto rows = biased.size(0), per_group = experts / s.groups;
  // A group's rank: the sum of its two best biased scores (its one where a group holds one).
  const at::Tensor grouped = biased.view({rows, s.groups, per_group});
  const at::Tensor group_scores = std::get<0>(grouped.topk(std::min<std::int64_t>(2, per_group), -1)).sum(-1);
  const at::Tensor kept_groups = std::get<1>(group_scores.topk(s.top_groups, -1));
  const at::Tensor kept = at::zeros({rows, s.groups}, biased.options().dtype(at::kBool)).scatter_(1, kept_groups, true);
  const at::Tensor choosable = biased.masked_fill(kept.unsqueeze(-1).expand({rows, s.groups, per_group}).reshape({rows, experts}).logical_not(), 0.0);
  r.experts = std::get<1>(choosable.topk(s.top_k, -1));
  at::Tensor weights = scores.gather(1, r.experts);
  if (s.normalize) weights = weights / (weights.sum(-1, true) + 1e-20);
  r.weights = weights * s.scale;
  r.logits = r.logits.to(hidden.scalar_type());
  return r;
}

Routing route_top_k_softmax(const at::Tensor& hidden, const at::Tensor& router, const at::Tensor& bias, std::int64_t top_k) {
  Routing r;
  r.logits = at::linear(hidden, router, bias);
  auto [top, experts] = r.logits.topk(top_k, -1);
  r.weights = at::softmax(top, -1);
  r.experts = experts;
  return r;
}

bool experts_run_on_device(const at::Tensor& weight, const ExpertsDelta* delta) {
#ifdef LOOM_GROUPED_MM
  if (!weight.defined()) return true;
  const at::Tensor x = at::empty({0, weight.size(2)}, weight.options());
  const ExpertsMatrix w(weight);
  return grouped_mm_serves(x, w, w, delta != nullptr ? *delta : ExpertsLowRank{}, {});
#else
  (void)weight;
  (void)delta;
  return false;
#endif
}

at::Tensor ExpertsMatrix::values() const {
  if (stored == nullptr) return tensor;
  return stored->dense().view({experts, out, in});
}
at::ScalarType ExpertsMatrix::dtype() const { return stored == nullptr ? tensor.scalar_type() : stored->options().dtype().toScalarType(); }

at::Tensor grouped_experts(const at::Tensor& hidden, const Routing& routing, const ExpertsMatrix& gate_up, const ExpertsMatrix& down,
                           const ExpertsLowRank& gate_up_delta, const ExpertsLowRank& down_delta, const ExpertActivation& activation,
                           const at::Tensor& gate_up_bias, const at::Tensor& down_bias) {
  check_experts(gate_up, down, gate_up_delta, down_delta, gate_up_bias, down_bias);
  const SortedPicks p = sort_picks(routing);
  const at::Tensor y = sorted_products(hidden.index_select(0, p.rows), pick_counts(p, gate_up.experts), gate_up, down, gate_up_delta, down_delta,
                                       {activation, gate_up_bias, down_bias});
  return scatter_weighted(hidden, p, y);
}

at::Tensor grouped_experts(const at::Tensor& hidden, const Routing& routing, const ExpertsMatrix& gate_up, const ExpertsMatrix& down,
                           const ExpertsLowRank& gate_up_delta, const ExpertsLowRank& down_delta, Communicator& group,
                           const ExpertActivation& activation, const at::Tensor& gate_up_bias, const at::Tensor& down_bias) {
  if (group.size() == 1) return grouped_experts(hidden, routing, gate_up, down, gate_up_delta, down_delta, activation, gate_up_bias, down_bias);
  check_experts(gate_up, down, gate_up_delta, down_delta, gate_up_bias, down_bias);
  const int ranks = group.size();
  const std::int64_t local = gate_up.experts, experts = local * ranks;
  const SortedPicks p = sort_picks(routing);
  // How many picks each expert got here, then how many each of this rank's experts got from every
  // rank (in rank order, then expert order): the exchange's sizes, read on the host.
  const at::Tensor counts = pick_counts(p, experts);
  const std::vector<std::int64_t> evenly(static_cast<std::size_t>(ranks), local);
  const at::Tensor from_each = exchange(counts, evenly, evenly, group);
  const at::Tensor sent = counts.view({ranks, local}).sum(1).to(at::kCPU), got = from_each.to(at::kCPU);
  const std::vector<std::int64_t> send(sent.data_ptr<std::int64_t>(), sent.data_ptr<std::int64_t>() + ranks);
  std::vector<std::int64_t> receive(static_cast<std::size_t>(ranks), 0), local_expert;
  const auto* g = got.data_ptr<std::int64_t>();
  for (int r = 0; r < ranks; ++r)
    for (std::int64_t e = 0; e < local; ++e) {
      receive[static_cast<std::size_t>(r)] += g[r * local + e];
      local_expert.insert(local_expert.end(), static_cast<std::size_t>(g[r * local + e]), e);
    }
  // The rows arrive by sender, each sender's by expert: sorted once more by expert alone.
  const at::Tensor arrived = exchange_rows(hidden.index_select(0, p.rows), send, receive, group);
  const at::Tensor by_expert = at::argsort(at::tensor(local_expert, at::TensorOptions().dtype(at::kLong)), /*stable=*/true).to(hidden.device());
  const at::Tensor y = sorted_products(arrived.index_select(0, by_expert), got.view({ranks, local}).sum(0), gate_up, down, gate_up_delta, down_delta,
                                       {activation, gate_up_bias, down_bias});
  const at::Tensor back = exchange_rows(y.index_select(0, inverse_of(by_expert)), receive, send, group);
  return scatter_weighted(hidden, p, back);
}

ExpertsLowRank experts_low_rank_from_peft(const at::Tensor& lora_a, const at::Tensor& lora_b, std::int64_t experts, double scale) {
  if (lora_a.dim() != 2 || lora_b.dim() != 2 || experts < 1 || lora_a.size(0) % experts != 0 || lora_b.size(1) != lora_a.size(0))
    throw std::logic_error("experts_low_rank_from_peft: lora_A and lora_B are not the factors of one rank over the experts");
  const std::int64_t rank = lora_a.size(0) / experts;
  return {lora_a.reshape({experts, rank, lora_a.size(1)}), lora_b.reshape({lora_b.size(0), rank, experts}).permute({2, 0, 1}), scale};
}

std::pair<at::Tensor, at::Tensor> experts_low_rank_to_peft(const ExpertsLowRank& d) {
  const std::int64_t experts = d.a.size(0), rank = d.a.size(1);
  return {d.a.reshape({experts * rank, d.a.size(2)}), d.b.permute({1, 2, 0}).reshape({d.b.size(1), rank * experts})};
}

RouterSums RouterSums::operator+(const RouterSums& o) const {
  if (!picks.defined()) return o;
  if (!o.picks.defined()) return *this;
  return {picks + o.picks, probabilities + o.probabilities, rows + o.rows};
}

RouterSums router_sums(const at::Tensor& logits, const at::Tensor& experts, const at::Tensor& mask) {
  const std::int64_t num_experts = logits.size(-1), k = experts.size(-1);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(logits.device());
  const at::Tensor p = at::softmax(logits.to(at::kFloat), -1);
  const at::Tensor chosen = experts.reshape({-1});
  if (!mask.defined())
    return {at::bincount(chosen, {}, num_experts).to(at::kFloat), p.sum(0), at::full({}, static_cast<double>(p.size(0)), f32)};
  const at::Tensor real = mask.reshape({-1}).ne(0).to(at::kFloat);
  return {at::zeros({num_experts}, f32).scatter_add(0, chosen, real.repeat_interleave(k)), (p * real.unsqueeze(-1)).sum(0), real.sum()};
}

at::Tensor load_balancing_loss(const RouterSums& s) {
  const auto num_experts = static_cast<double>(s.picks.size(0));
  return (s.picks / s.rows * (s.probabilities / s.rows)).sum() * num_experts;
}

at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, std::int64_t num_experts, std::int64_t top_k, const at::Tensor& mask) {
  if (router_logits.empty()) throw std::logic_error("load_balancing_loss: no router logits");
  RouterSums sums;
  for (const auto& logits : router_logits) {
    if (logits.size(-1) != num_experts) throw std::logic_error("load_balancing_loss: router logits of another expert count");
    const at::Tensor chosen = std::get<1>(at::topk(at::softmax(logits.to(at::kFloat), -1), top_k, -1));
    sums = sums + router_sums(logits, chosen, mask);
  }
  return load_balancing_loss(sums);
}

}  // namespace loom::kit
