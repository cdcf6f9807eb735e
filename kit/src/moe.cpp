#include "loom/kit/moe.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/version.h>

#include <stdexcept>

#include "loom/kit/torch_compat.hpp"

// LibTorch 2.8 on has a grouped GEMM with a derivative (bf16 on Hopper; 2.9 widened it to
// compute capability 8.0): every expert's group in one launch, with no count read back to the host.
#if defined(LOOM_WITH_CUDA) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9))
#define LOOM_GROUPED_MM 1
#endif

namespace loom::kit {
namespace {

#ifdef LOOM_GROUPED_MM
bool grouped_mm_serves(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, const ExpertsLowRank& gate_up_delta,
                       const ExpertsLowRank& down_delta) {
  if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || gate_up.scalar_type() != at::kBFloat16 || down.scalar_type() != at::kBFloat16) return false;
  // Rows of 16-byte multiples, as the kernel's TMA loads need.
  if (x.size(1) % 8 != 0 || down.size(2) % 8 != 0) return false;
  for (const ExpertsLowRank* d : {&gate_up_delta, &down_delta})
    if (d->defined() && (d->a.scalar_type() != at::kBFloat16 || d->b.scalar_type() != at::kBFloat16 || d->a.size(1) % 8 != 0)) return false;
  return compat::cuda_device_capability(static_cast<int>(x.device().index())) >= 80;
}
#endif

// x W[e]^T over one expert's rows, with its low-rank delta where there is one.
at::Tensor expert_product(const at::Tensor& x, const at::Tensor& weight, const ExpertsLowRank& delta, std::int64_t e) {
  at::Tensor y = at::linear(x, weight[e]);
  if (delta.defined()) y = y + at::linear(at::linear(x, delta.a[e]), delta.b[e]) * delta.scale;
  return y;
}

// One gate_up and one down product per expert's group of the sorted rows `x`.
at::Tensor per_expert_products(const at::Tensor& x, const at::Tensor& picks, const at::Tensor& gate_up, const at::Tensor& down,
                               const ExpertsLowRank& gate_up_delta, const ExpertsLowRank& down_delta) {
  const std::int64_t experts = gate_up.size(0), width = down.size(2);
  const at::Tensor counts = at::bincount(picks, {}, experts).to(at::kCPU);
  const auto* count = counts.data_ptr<std::int64_t>();
  std::vector<at::Tensor> outputs;
  std::int64_t at = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    if (count[e] == 0) continue;
    const at::Tensor both = expert_product(x.narrow(0, at, count[e]), gate_up, gate_up_delta, e);
    outputs.push_back(expert_product(at::silu(both.narrow(-1, 0, width)) * both.narrow(-1, width, width), down, down_delta, e));
    at += count[e];
  }
  return at::cat(outputs, 0);
}

#ifdef LOOM_GROUPED_MM
// x W[e]^T for every group at once, the low-rank delta as two more grouped products of rank r.
at::Tensor grouped_product(const at::Tensor& x, const at::Tensor& weight, const ExpertsLowRank& delta, const at::Tensor& ends) {
  at::Tensor y = at::_grouped_mm(x, weight.transpose(1, 2), ends);
  if (delta.defined()) y = y + at::_grouped_mm(at::_grouped_mm(x, delta.a.transpose(1, 2), ends), delta.b.transpose(1, 2), ends) * delta.scale;
  return y;
}
#endif

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

at::Tensor grouped_experts(const at::Tensor& hidden, const Routing& routing, const at::Tensor& gate_up, const at::Tensor& down,
                           const ExpertsLowRank& gate_up_delta, const ExpertsLowRank& down_delta) {
  const std::int64_t experts = gate_up.size(0), width = down.size(2), k = routing.experts.size(1);
  if (gate_up.size(1) != 2 * width || down.size(0) != experts) throw std::logic_error("grouped_experts: gate_up and down do not match");
  for (const auto& [delta, weight] : {std::pair{&gate_up_delta, &gate_up}, std::pair{&down_delta, &down}})
    if (delta->defined() && (delta->a.size(0) != experts || delta->b.size(0) != experts || delta->a.size(2) != weight->size(2) ||
                             delta->b.size(1) != weight->size(1) || delta->b.size(2) != delta->a.size(1)))
      throw std::logic_error("grouped_experts: a low-rank delta does not match its weight");
  // Every (row, pick) sorted by expert once: the groups lie back to back.
  const at::Tensor flat = routing.experts.reshape({-1});
  const at::Tensor order = at::argsort(flat, /*stable=*/true);
  const at::Tensor rows = at::div(order, k, "floor");
  const at::Tensor x = hidden.index_select(0, rows);
  const at::Tensor weights = routing.weights.reshape({-1}).index_select(0, order);
  at::Tensor y;
#ifdef LOOM_GROUPED_MM
  if (grouped_mm_serves(x, gate_up, down, gate_up_delta, down_delta)) {
    const at::Tensor ends = at::cumsum(at::bincount(flat, {}, experts), 0, at::kInt);
    const at::Tensor both = grouped_product(x, gate_up, gate_up_delta, ends);
    y = grouped_product(at::silu(both.narrow(-1, 0, width)) * both.narrow(-1, width, width), down, down_delta, ends);
  }
#endif
  if (!y.defined()) y = per_expert_products(x, flat, gate_up, down, gate_up_delta, down_delta);
  // Weighted in the routing weights' dtype (fp32 for Mixtral), then summed in hidden's.
  const at::Tensor weighted = (y * weights.unsqueeze(-1)).to(hidden.scalar_type());
  return at::zeros_like(hidden).index_add(0, rows, weighted);
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
