// The kit's pieces for blocks written as code (kit 3.8), each against its definition written out
// here in float64, as the families' code in transformers states it (tests/fixtures/families/FACTS.md);
// the families' parity tests then check them inside whole models.
#include <cmath>
#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "loom/kit/blocks.hpp"
#include "loom/kit/moe.hpp"

namespace loom::kit {
namespace {

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>(); }

// Rotary tables as the decoder makes them: [B, T, r], frequency i's angle at i and at i + r/2.
std::pair<at::Tensor, at::Tensor> rotary_tables(std::int64_t batch, std::int64_t len, std::int64_t turned) {
  const at::Tensor inv = at::pow(10000.0, -at::arange(0, turned, 2, at::kDouble) / static_cast<double>(turned));
  const at::Tensor positions = at::arange(len, at::kDouble).view({1, len, 1}).expand({batch, len, 1}) * 3.0;
  const at::Tensor freqs = positions * inv.view({1, 1, -1});
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {angles.cos().to(at::kFloat), angles.sin().to(at::kFloat)};
}

TEST(Pieces, LayerNormsAreTorchsAndCoheres) {
  at::manual_seed(0);
  const at::Tensor x = at::randn({3, 5, 16}) * 3 + 1, w = at::randn({16}), b = at::randn({16});
  const at::Tensor xd = x.to(at::kDouble), centred = xd - xd.mean(-1, true);
  const at::Tensor normed = centred / (centred.pow(2).mean(-1, true) + 1e-5).sqrt();
  EXPECT_LT(max_diff(layer_norm(x, w, b, 1e-5), normed * w.to(at::kDouble) + b.to(at::kDouble)), 1e-5);
  EXPECT_LT(max_diff(layer_norm(x, w, at::Tensor(), 1e-5), normed * w.to(at::kDouble)), 1e-5);
  EXPECT_LT(max_diff(layer_norm(x, at::Tensor(), at::Tensor(), 1e-5), normed), 1e-5);
  // Cohere's: fp32 through the weight, one rounding to the input's dtype.
  const at::Tensor xb = x.to(at::kBFloat16);
  const at::Tensor xbd = xb.to(at::kDouble), cb = xbd - xbd.mean(-1, true);
  const at::Tensor expected = (cb / (cb.pow(2).mean(-1, true) + 1e-5).sqrt() * w.to(at::kDouble)).to(at::kBFloat16);
  const at::Tensor got = layer_norm_float(xb, w, 1e-5);
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_LE(max_diff(got, expected), 0.0625) << "one bf16 step of values up to ~8";
  EXPECT_GT(max_diff(layer_norm_float(x, w, 1e-5), normed), 1e-2) << "the weight must apply";
}

// Pairs (2i, 2i + 1) turn by frequency i; the same as the half-split rotary of the dimensions
// reordered evens-then-odds (how transformers' DeepSeek applies rope_interleave), and a partial
// rotary passes the rest.
TEST(Pieces, InterleavedRotaryTurnsPairsOfNeighbours) {
  at::manual_seed(1);
  const std::int64_t batch = 2, heads = 3, len = 5, dim = 12, turned = 8;
  const at::Tensor x = at::randn({batch, heads, len, dim});
  const auto [cos, sin] = rotary_tables(batch, len, turned);
  const at::Tensor got = apply_rotary_interleaved(x, cos, sin);
  at::Tensor expected = x.to(at::kDouble).clone();
  const auto xa = x.accessor<float, 4>();
  const auto c = cos.accessor<float, 3>(), s = sin.accessor<float, 3>();
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t t = 0; t < len; ++t)
        for (std::int64_t i = 0; i < turned / 2; ++i) {
          const double x0 = xa[b][h][t][2 * i], x1 = xa[b][h][t][2 * i + 1], ci = c[b][t][i], si = s[b][t][i];
          expected[b][h][t][2 * i] = x0 * ci - x1 * si;
          expected[b][h][t][2 * i + 1] = x1 * ci + x0 * si;
        }
  EXPECT_LT(max_diff(got, expected), 1e-5);
  std::vector<std::int64_t> order;
  for (std::int64_t i = 0; i < turned; i += 2) order.push_back(i);
  for (std::int64_t i = 1; i < turned; i += 2) order.push_back(i);
  for (std::int64_t i = turned; i < dim; ++i) order.push_back(i);
  const at::Tensor perm = at::tensor(order, at::kLong);
  EXPECT_LT(max_diff(apply_rotary(x.index_select(-1, perm), cos, sin), got.index_select(-1, perm)), 1e-5);
  EXPECT_GT(max_diff(apply_rotary(x, cos, sin), got), 1e-1) << "the conventions differ";
}

// Scores soft-capped before the mask (Gemma 2), sinks that take a share of each softmax (gpt-oss),
// grouped-query heads, a window: each against the eager formula written out, gradients included.
TEST(Pieces, ExactAttentionTakesSoftCapsAndSinks) {
  at::manual_seed(2);
  const std::int64_t batch = 2, heads = 4, kv = 2, len = 6, dim = 8;
  const at::Tensor q = (at::randn({batch, heads, len, dim}, at::kDouble) * 2).requires_grad_();
  const at::Tensor k = (at::randn({batch, kv, len, dim}, at::kDouble) * 2).requires_grad_();
  const at::Tensor v = at::randn({batch, kv, len, dim}, at::kDouble).requires_grad_();
  const at::Tensor sinks = at::randn({heads}, at::kDouble).requires_grad_();
  at::Tensor mask = at::ones({batch, len}, at::kLong);
  mask[1].narrow(0, 0, 2).zero_();  // row 2 left-padded
  const at::Tensor allowed = attention_allowed(mask, len, /*window=*/3);
  const auto reference = [&](double cap, bool with_sinks) {
    const at::Tensor kk = k.repeat_interleave(heads / kv, 1), vv = v.repeat_interleave(heads / kv, 1);
    at::Tensor s = at::matmul(q, kk.transpose(-2, -1)) / std::sqrt(static_cast<double>(dim));
    if (cap > 0) s = cap * at::tanh(s / cap);
    s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    if (with_sinks) s = at::cat({s, sinks.view({1, heads, 1, 1}).expand({batch, heads, len, 1})}, -1);
    at::Tensor p = at::softmax(s, -1);
    if (with_sinks) p = p.narrow(-1, 0, len);
    return at::matmul(p, vv);
  };
  // No extras: what attention() gives (whose LibTorch path may take float32's softmax: its bound).
  EXPECT_LT(max_diff(attention_exact(q, k, v, allowed), attention(q, k, v, allowed)), 1e-5);
  EXPECT_LT(max_diff(attention_exact(q, k, v, allowed), reference(0, false)), 1e-10);
  for (const auto& [cap, with_sinks] : std::vector<std::pair<double, bool>>{{0, true}, {1.5, false}, {1.5, true}}) {
    AttentionExtras extras;
    extras.softcap = cap;
    if (with_sinks) extras.sinks = sinks;
    const at::Tensor got = attention_exact(q, k, v, allowed, extras), want = reference(cap, with_sinks);
    EXPECT_LT(max_diff(got, want), 1e-10) << cap << " " << with_sinks;
    EXPECT_GT(max_diff(got, reference(0, false)), 1e-2) << "the extras must show";
    const at::Tensor g = at::randn_like(want);
    std::vector<at::Tensor> inputs{q, k, v};
    if (with_sinks) inputs.push_back(sinks);
    const auto got_grads = torch::autograd::grad({got}, inputs, {g});
    const auto want_grads = torch::autograd::grad({want}, inputs, {g});
    for (std::size_t i = 0; i < inputs.size(); ++i) EXPECT_LT(max_diff(got_grads[i], want_grads[i]), 1e-10) << "gradient " << i;
  }
  // Causal without a pattern: a query sees itself and what came before it.
  const at::Tensor plain = attention_exact(q, k, v, at::Tensor(), AttentionExtras{0, sinks, 0});
  AttentionExtras with_sinks;
  with_sinks.sinks = sinks;
  const at::Tensor causal = at::ones({len, len}, at::kBool).tril().view({1, 1, len, len}).expand({batch, 1, len, len});
  EXPECT_LT(max_diff(plain, attention_exact(q, k, v, causal, with_sinks)), 1e-12);
}

TEST(Pieces, ClampedSwigluIsGptOsss) {
  at::manual_seed(3);
  const at::Tensor gate = at::randn({4, 32}, at::kDouble) * 6, up = at::randn({4, 32}, at::kDouble) * 6;
  const double alpha = 1.702, limit = 7.0;
  const at::Tensor g = at::minimum(gate, at::full_like(gate, limit)), u = at::clamp(up, -limit, limit);
  EXPECT_LT(max_diff(clamped_swiglu(gate, up, alpha, limit), g / (1 + at::exp(-alpha * g)) * (u + 1)), 1e-12);
  ASSERT_GT((gate > limit).sum().item<std::int64_t>(), 0) << "the clamp must bite somewhere";
  EXPECT_GT(max_diff(clamped_swiglu(gate, up, alpha, limit), clamped_swiglu(gate, up, alpha, 1e9)), 1.0);
}

// DeepSeek-V3's noaux_tc routing, written out row by row as transformers states it: groups ranked by
// their two best biased scores, the other groups' scores 0 (so a biased score below 0 in a kept
// group can lose to them), the unbiased scores of the chosen as weights.
TEST(Pieces, GroupedSigmoidRoutingIsDeepSeekV3s) {
  at::manual_seed(4);
  const std::int64_t rows = 64, hidden = 16, experts = 8, groups = 4, per_group = experts / groups;
  const at::Tensor x = at::randn({rows, hidden}), router = at::randn({experts, hidden}) * 0.5;
  // A bias of both signs, and one that pushes every biased score below zero: the masking quirk shows.
  const at::Tensor mixed = at::randn({experts}) * 0.8 - 0.2, negative = at::rand({experts}) * 0.5 - 2.0;  // scores in (0, 1): every biased one below 0
  std::int64_t quirk_rows = 0;
  for (const bool normalize : {true, false}) {
    const at::Tensor& bias = normalize ? mixed : negative;
    // With every score negative, three groups of four kept: the masked group's two zeros are both picked.
    const GroupedSigmoidRouting settings{2, groups, normalize ? 2 : 3, normalize, 2.5};
    const Routing r = route_sigmoid_grouped(x, router, bias, settings);
    const at::Tensor scores = at::sigmoid(at::matmul(x.to(at::kDouble), router.to(at::kDouble).t()));
    const auto sc = scores.accessor<double, 2>();
    const auto bi = bias.accessor<float, 1>();
    for (std::int64_t n = 0; n < rows; ++n) {
      std::vector<double> biased(experts), group_score(groups);
      for (std::int64_t e = 0; e < experts; ++e) biased[e] = sc[n][e] + bi[e];
      for (std::int64_t gi = 0; gi < groups; ++gi) {
        std::vector<double> in(biased.begin() + gi * per_group, biased.begin() + (gi + 1) * per_group);
        std::sort(in.rbegin(), in.rend());
        group_score[gi] = in[0] + in[1];
      }
      std::vector<std::int64_t> order(groups);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](auto a, auto b) { return group_score[a] > group_score[b]; });
      std::vector<double> choosable(experts, 0.0);
      for (std::int64_t i = 0; i < settings.top_groups; ++i)
        for (std::int64_t e = order[i] * per_group; e < (order[i] + 1) * per_group; ++e) choosable[e] = biased[e];
      std::vector<std::int64_t> picks(experts);
      std::iota(picks.begin(), picks.end(), 0);
      std::sort(picks.begin(), picks.end(), [&](auto a, auto b) { return choosable[a] > choosable[b]; });
      picks.resize(settings.top_k);
      for (const auto e : picks) quirk_rows += choosable[e] == 0.0 ? 1 : 0;  // a masked expert picked over a negative score
      double sum = 0;
      for (const auto e : picks) sum += sc[n][e];
      // The picks as a set (tied zeros come in any order), each with its weight.
      std::map<std::int64_t, double> got, want;
      for (std::int64_t j = 0; j < settings.top_k; ++j) {
        got[r.experts[n][j].item<std::int64_t>()] = r.weights[n][j].item<double>();
        want[picks[static_cast<std::size_t>(j)]] = sc[n][picks[static_cast<std::size_t>(j)]] / (normalize ? sum + 1e-20 : 1.0) * 2.5;
      }
      ASSERT_EQ(got.size(), want.size());
      for (auto g = got.begin(), w = want.begin(); g != got.end(); ++g, ++w) {
        EXPECT_EQ(g->first, w->first) << "row " << n;
        EXPECT_NEAR(g->second, w->second, 1e-5) << "row " << n;
      }
    }
  }
  EXPECT_GT(quirk_rows, 0) << "no row shows the masked groups' zeros winning";
  EXPECT_THROW(route_sigmoid_grouped(x, router, mixed, GroupedSigmoidRouting{2, 3, 1, true, 1}), std::logic_error);  // 8 experts in 3 groups
}

TEST(Pieces, TopKSoftmaxRoutingIsGptOsss) {
  at::manual_seed(5);
  const at::Tensor x = at::randn({10, 16}), router = at::randn({6, 16}), bias = at::randn({6});
  const Routing r = route_top_k_softmax(x, router, bias, 2);
  const at::Tensor logits = at::matmul(x.to(at::kDouble), router.to(at::kDouble).t()) + bias.to(at::kDouble);
  const auto [top, picks] = logits.topk(2, -1);
  EXPECT_TRUE(at::equal(r.experts, picks));
  EXPECT_LT(max_diff(r.weights, at::softmax(top, -1)), 1e-6);
  EXPECT_LT(max_diff(r.logits, logits), 1e-5);
}

}  // namespace
}  // namespace loom::kit
