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
bool grouped_mm_serves(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down) {
  if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || gate_up.scalar_type() != at::kBFloat16 || down.scalar_type() != at::kBFloat16) return false;
  // Rows of 16-byte multiples, as the kernel's TMA loads need.
  if (x.size(1) % 8 != 0 || down.size(2) % 8 != 0) return false;
  return compat::cuda_device_capability(static_cast<int>(x.device().index())) >= 80;
}
#endif

// One gate_up and one down product per expert's group of the sorted rows `x`.
at::Tensor per_expert_products(const at::Tensor& x, const at::Tensor& picks, const at::Tensor& gate_up, const at::Tensor& down) {
  const std::int64_t experts = gate_up.size(0), width = down.size(2);
  const at::Tensor counts = at::bincount(picks, {}, experts).to(at::kCPU);
  const auto* count = counts.data_ptr<std::int64_t>();
  std::vector<at::Tensor> outputs;
  std::int64_t at = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    if (count[e] == 0) continue;
    const at::Tensor both = at::linear(x.narrow(0, at, count[e]), gate_up[e]);
    outputs.push_back(at::linear(at::silu(both.narrow(-1, 0, width)) * both.narrow(-1, width, width), down[e]));
    at += count[e];
  }
  return at::cat(outputs, 0);
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

at::Tensor grouped_experts(const at::Tensor& hidden, const Routing& routing, const at::Tensor& gate_up, const at::Tensor& down) {
  const std::int64_t experts = gate_up.size(0), width = down.size(2), k = routing.experts.size(1);
  if (gate_up.size(1) != 2 * width || down.size(0) != experts) throw std::logic_error("grouped_experts: gate_up and down do not match");
  // Every (row, pick) sorted by expert once: the groups lie back to back.
  const at::Tensor flat = routing.experts.reshape({-1});
  const at::Tensor order = at::argsort(flat, /*stable=*/true);
  const at::Tensor rows = at::div(order, k, "floor");
  const at::Tensor x = hidden.index_select(0, rows);
  const at::Tensor weights = routing.weights.reshape({-1}).index_select(0, order);
  at::Tensor y;
#ifdef LOOM_GROUPED_MM
  if (grouped_mm_serves(x, gate_up, down)) {
    const at::Tensor ends = at::cumsum(at::bincount(flat, {}, experts), 0, at::kInt);
    const at::Tensor both = at::_grouped_mm(x, gate_up.transpose(1, 2), ends);
    y = at::_grouped_mm(at::silu(both.narrow(-1, 0, width)) * both.narrow(-1, width, width), down.transpose(1, 2), ends);
  }
#endif
  if (!y.defined()) y = per_expert_products(x, flat, gate_up, down);
  // Weighted in the routing weights' dtype (fp32 for Mixtral), then summed in hidden's.
  const at::Tensor weighted = (y * weights.unsqueeze(-1)).to(hidden.scalar_type());
  return at::zeros_like(hidden).index_add(0, rows, weighted);
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
