// The kit's mixture-of-experts pieces against what transformers 5.17 computes
// (tests/fixtures/moe/make_reference.py, float64 on the CPU): Qwen3-MoE's and Mixtral's sparse
// blocks (router, top-2 of 8, with and without renormalisation) forward and backward, and the
// load-balancing loss with and without padding; experts shared out over ranks against one process.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "loom/kit/moe.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/safetensors.hpp"
#include "test_support.hpp"

namespace loom::kit {
namespace {

const SafetensorsFile& reference() {
  static const SafetensorsFile file(test::source_dir() / "tests/fixtures/moe/reference.safetensors");
  return file;
}
at::Tensor fixture(const std::string& name) { return reference().tensor(name).clone(); }

// The router's softmax is fp32 in both (transformers' dtype=torch.float), and LibTorch's fp32 exp and
// softmax kernels differ from torch 2.11's by an ulp here and there: agreement is to fp32's
// precision, relative to each tensor's largest value (a wrong route or weight is off by 1e-1).
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what, double tolerance = 1e-6) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double error = (got - want).abs().max().item<double>(), scale = want.abs().max().item<double>();
  EXPECT_LE(error, tolerance * std::max(1.0, scale)) << what << ": largest difference " << error;
}

TEST(Moe, SparseBlocksEqualTransformersForwardAndBackward) {
  struct Case {
    const char* name;
    RouterSettings router;
  };
  for (const Case& c : {Case{"qwen3_moe", {2, false, true}}, Case{"qwen3_moe.norm", {2, true, true}}, Case{"mixtral", {2, true, false}}}) {
    SCOPED_TRACE(c.name);
    const at::Tensor hidden = fixture("hidden").requires_grad_(true), router = fixture("router").requires_grad_(true);
    const at::Tensor gate_up = fixture("gate_up").requires_grad_(true), down = fixture("down").requires_grad_(true);
    const Routing routing = route(hidden, router, c.router);
    const at::Tensor out = grouped_experts(hidden, routing, gate_up, down);
    const std::string n = c.name;
    expect_close(out, fixture(n + ".output"), "output");
    torch::autograd::backward({(out * fixture("probe")).sum()});
    expect_close(hidden.grad(), fixture(n + ".grad_hidden"), "gradient of the hidden states");
    expect_close(router.grad(), fixture(n + ".grad_router"), "gradient of the router");
    expect_close(gate_up.grad(), fixture(n + ".grad_gate_up"), "gradient of gate_up");
    expect_close(down.grad(), fixture(n + ".grad_down"), "gradient of down");
  }
}

// Both sum in fp32 (transformers' accumulators are fp32 whatever the logits' dtype).
TEST(Moe, LoadBalancingLossEqualsTransformers) {
  const std::vector<at::Tensor> logits = {fixture("aux.logits.0"), fixture("aux.logits.1"), fixture("aux.logits.2")};
  expect_close(load_balancing_loss(logits, 8, 2).reshape({1}).to(at::kDouble), fixture("aux.loss"), "loss");
  expect_close(load_balancing_loss(logits, 8, 2, fixture("aux.mask")).reshape({1}).to(at::kDouble), fixture("aux.loss_masked"), "loss without padding");
}

// On a GPU in bf16 the experts run as grouped GEMMs (LibTorch 2.9 and later, compute capability 8.0
// up): forward and gradients equal the same bf16 values computed per expert in fp32 on the CPU, to
// bf16's precision. 300 rows over 8 experts, two of them left without a row.
LOOM_GPU_TEST(Moe, GroupedProductsOnTheGpuEqualPerExpertProducts) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(3);
  const std::int64_t n = 300, h = 64, width = 32, experts = 8;
  const at::Tensor hidden = at::randn({n, h}).to(at::kBFloat16);
  const at::Tensor gate_up = (at::randn({experts, 2 * width, h}) / 8).to(at::kBFloat16), down = (at::randn({experts, h, width}) / 8).to(at::kBFloat16);
  const at::Tensor probe = at::randn({n, h}).to(at::kBFloat16);
  // Each row's two picks, distinct, from experts 0-2 and 3-5: 6 and 7 get no row.
  const Routing routing{at::Tensor(), at::softmax(at::randn({n, 2}), -1), at::stack({at::randint(0, 3, {n}), at::randint(3, 6, {n})}, 1)};
  const auto run = [&](const at::Device& device, at::ScalarType dtype) {
    std::vector<at::Tensor> leaves;
    for (const auto& t : {hidden, routing.weights, gate_up, down}) leaves.push_back(t.to(device, dtype).requires_grad_(true));
    const at::Tensor out = grouped_experts(leaves[0], Routing{at::Tensor(), leaves[1], routing.experts.to(device)}, leaves[2], leaves[3]);
    torch::autograd::backward({(out * probe.to(device, dtype)).sum()});
    std::vector<at::Tensor> results = {out.detach().to(at::kCPU, at::kFloat)};
    for (const auto& l : leaves) results.push_back(l.grad().to(at::kCPU, at::kFloat));
    return results;
  };
  const auto gpu = run(at::Device(at::kCUDA, 0), at::kBFloat16), cpu = run(at::Device(at::kCPU), at::kFloat);
  const char* names[] = {"output", "gradient of the hidden states", "gradient of the routing weights", "gradient of gate_up", "gradient of down"};
  for (std::size_t i = 0; i < gpu.size(); ++i) expect_close(gpu[i], cpu[i], names[i], 3e-2);
}

// gpt-oss's experts (ExpertActivation: gate and up rows interleaved, a clamped SwiGLU; each
// expert's biases) against the formula written out pick by pick in float64, as transformers'
// GptOssExperts computes it: gu = W_gu[e] x + b_gu[e]; gate = gu[0::2] clamped at most `limit`, up =
// gu[1::2] within +-limit; y = W_d[e] (gate sigmoid(alpha gate) (up + 1)) + b_d[e]; the row's picks'
// y weighted and summed. Values and every gradient (biases included), on the CPU, and on a GPU in
// bf16 through the grouped GEMMs against the CPU to bf16's precision.
struct GptOssCase {
  at::Tensor hidden, weights, gate_up, down, gate_up_bias, down_bias, probe;
  at::Tensor experts;
  ExpertActivation activation{true, 1.5, 1.702};
};
GptOssCase gpt_oss_case() {
  at::manual_seed(11);
  const std::int64_t n = 90, h = 16, width = 8, experts = 5;
  GptOssCase c;
  c.hidden = at::randn({n, h}, at::kDouble);
  c.weights = at::softmax(at::randn({n, 2}, at::kDouble), -1);
  c.gate_up = at::randn({experts, 2 * width, h}, at::kDouble) / 2;  // large enough that the clamp bites
  c.down = at::randn({experts, h, width}, at::kDouble) / 3;
  c.gate_up_bias = at::randn({experts, 2 * width}, at::kDouble) / 2;
  c.down_bias = at::randn({experts, h}, at::kDouble) / 2;
  c.probe = at::randn({n, h}, at::kDouble);
  c.experts = at::stack({at::randint(0, 2, {n}), at::randint(2, 4, {n})}, 1);  // expert 4 gets no row
  return c;
}
std::vector<at::Tensor> gpt_oss_results(const GptOssCase& c, const at::Device& device, at::ScalarType dtype, bool written_out) {
  std::vector<at::Tensor> leaves;
  for (const auto& t : {c.hidden, c.weights, c.gate_up, c.down, c.gate_up_bias, c.down_bias}) leaves.push_back(t.to(device, dtype).requires_grad_(true));
  const at::Tensor experts = c.experts.to(device);
  at::Tensor out;
  if (written_out) {
    const at::Tensor picks = experts.reshape({-1});
    const at::Tensor x = leaves[0].repeat_interleave(2, 0).unsqueeze(-1);  // [N k, H, 1]
    const at::Tensor gu = at::bmm(leaves[2].index_select(0, picks), x).squeeze(-1) + leaves[4].index_select(0, picks);
    const at::Tensor gate = gu.slice(1, 0, c10::nullopt, 2).clamp_max(c.activation.limit);
    const at::Tensor up = gu.slice(1, 1, c10::nullopt, 2).clamp(-c.activation.limit, c.activation.limit);
    const at::Tensor act = gate * at::sigmoid(gate * c.activation.alpha) * (up + 1);
    const at::Tensor y = at::bmm(leaves[3].index_select(0, picks), act.unsqueeze(-1)).squeeze(-1) + leaves[5].index_select(0, picks);
    out = (y.view({-1, 2, y.size(1)}) * leaves[1].unsqueeze(-1)).sum(1);
  } else {
    out = grouped_experts(leaves[0], Routing{at::Tensor(), leaves[1], experts}, leaves[2], leaves[3], {}, {}, c.activation, leaves[4], leaves[5]);
  }
  torch::autograd::backward({(out * c.probe.to(device, dtype)).sum()});
  std::vector<at::Tensor> results = {out.detach().to(at::kCPU, at::kDouble)};
  for (const auto& l : leaves) results.push_back(l.grad().to(at::kCPU, at::kDouble));
  return results;
}
const char* const kGptOssNames[] = {"output", "gradient of the hidden states", "gradient of the routing weights", "gradient of gate_up",
                                    "gradient of down", "gradient of gate_up's bias", "gradient of down's bias"};

TEST(Moe, GptOssExpertsArePerPickProductsWithBiasesAndTheClampedSwiglu) {
  const GptOssCase c = gpt_oss_case();
  const auto got = gpt_oss_results(c, at::kCPU, at::kDouble, false), want = gpt_oss_results(c, at::kCPU, at::kDouble, true);
  for (std::size_t i = 0; i < got.size(); ++i) expect_close(got[i], want[i], kGptOssNames[i], 1e-12);
  // The clamp bites on both sides: some gate above the limit, some up outside it.
  const at::Tensor gu = at::matmul(c.gate_up, c.hidden.t());
  EXPECT_GT((gu.slice(1, 0, c10::nullopt, 2) > c.activation.limit).sum().item<int>(), 0);
  EXPECT_GT((gu.slice(1, 1, c10::nullopt, 2).abs() > c.activation.limit).sum().item<int>(), 0);
}

LOOM_GPU_TEST(Moe, GptOssExpertsOnTheGpuEqualTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const GptOssCase c = gpt_oss_case();
  const auto gpu = gpt_oss_results(c, at::Device(at::kCUDA, 0), at::kBFloat16, false), cpu = gpt_oss_results(c, at::kCPU, at::kFloat, false);
  for (std::size_t i = 0; i < gpu.size(); ++i) expect_close(gpu[i], cpu[i], kGptOssNames[i], 3e-2);
}

// Experts with random rows routed to them, their weights and low-rank deltas (rank 4), for the
// low-rank tests below.
struct LowRankCase {
  at::Tensor hidden, probe, gate_up, down;
  Routing routing;
  ExpertsLowRank gate_up_delta, down_delta;
};
LowRankCase low_rank_case(at::ScalarType dtype) {
  at::manual_seed(5);
  const std::int64_t n = 120, h = 16, width = 8, experts = 6, rank = 4;
  const auto o = at::TensorOptions().dtype(dtype);
  LowRankCase c;
  c.hidden = at::randn({n, h}, o);
  c.probe = at::randn({n, h}, o);
  c.gate_up = at::randn({experts, 2 * width, h}, o) / 4;
  c.down = at::randn({experts, h, width}, o) / 4;
  // Picks from experts 0-4: expert 5 gets no row.
  c.routing = Routing{at::Tensor(), at::softmax(at::randn({n, 2}, o), -1), at::stack({at::randint(0, 2, {n}), at::randint(2, 5, {n})}, 1)};
  c.gate_up_delta = {at::randn({experts, rank, h}, o) / 2, at::randn({experts, 2 * width, rank}, o) / 2, 0.75};
  c.down_delta = {at::randn({experts, rank, width}, o) / 2, at::randn({experts, h, rank}, o) / 2, 0.75};
  return c;
}

// Each expert's low-rank delta inside the grouped products, (x A^T) B^T, gives what the merged
// weight W + scale B A gives, forward and backward (hidden, routing weights, A and B: the gradients
// through the merge are the reference), with no B A made.
TEST(Moe, LowRankDeltasGiveTheMergedWeightsValuesAndGradients) {
  const LowRankCase c = low_rank_case(at::kDouble);
  const auto leaves = [&] {
    std::vector<at::Tensor> out;
    for (const auto& t : {c.hidden, c.routing.weights, c.gate_up_delta.a, c.gate_up_delta.b, c.down_delta.a, c.down_delta.b})
      out.push_back(t.clone().requires_grad_(true));
    return out;
  };
  const auto grads = [&](const at::Tensor& out, const std::vector<at::Tensor>& l) {
    torch::autograd::backward({(out * c.probe).sum()});
    std::vector<at::Tensor> g{out.detach()};
    for (const auto& t : l) g.push_back(t.grad());
    return g;
  };
  const auto split = leaves(), merged = leaves();
  const at::Tensor split_out = grouped_experts(split[0], Routing{at::Tensor(), split[1], c.routing.experts}, c.gate_up, c.down,
                                               {split[2], split[3], 0.75}, {split[4], split[5], 0.75});
  const at::Tensor merged_out = grouped_experts(merged[0], Routing{at::Tensor(), merged[1], c.routing.experts},
                                                c.gate_up + at::matmul(merged[3], merged[2]) * 0.75, c.down + at::matmul(merged[5], merged[4]) * 0.75);
  const auto a = grads(split_out, split), b = grads(merged_out, merged);
  const char* names[] = {"output", "hidden", "routing weights", "gate_up's A", "gate_up's B", "down's A", "down's B"};
  for (std::size_t i = 0; i < a.size(); ++i) expect_close(a[i], b[i], names[i], 1e-12);
  EXPECT_EQ(a[3][5].abs().max().item<double>(), 0.0) << "an expert without rows got a gradient";
  // PEFT's layout (lora_A [E*r, in] expert-major, lora_B [out, E*r] rank-major) and back.
  const auto [lora_a, lora_b] = experts_low_rank_to_peft(c.gate_up_delta);
  EXPECT_EQ(lora_a.sizes(), (std::vector<std::int64_t>{24, 16}));
  EXPECT_EQ(lora_b.sizes(), (std::vector<std::int64_t>{16, 24}));
  EXPECT_TRUE(at::equal(lora_a.narrow(0, 4, 4), c.gate_up_delta.a[1]));          // expert 1's rows
  EXPECT_TRUE(at::equal(lora_b.select(1, 6 + 1), c.gate_up_delta.b[1].select(1, 1)));  // its rank 1: column 1 x 6 + 1
  const ExpertsLowRank back = experts_low_rank_from_peft(lora_a, lora_b, 6, 0.75);
  EXPECT_TRUE(at::equal(back.a, c.gate_up_delta.a));
  EXPECT_TRUE(at::equal(back.b, c.gate_up_delta.b));
}

// Experts shared out over two ranks (Gloo): each rank's rows travel to the rank of their experts
// and back. Outputs and the gradients of the rows and routing weights equal one process's on those
// rows; each rank's experts' A and B get the gradient of every rank's rows that picked them. Once
// with picks on both ranks' experts, once with every pick on rank 0's (rank 1 gets no row, and
// still runs its part of the backward's exchange).
TEST(Moe, ExpertsSharedOutOverRanksEqualOneProcess) {
  for (const bool one_sided : {false, true}) {
    const LowRankCase c = low_rank_case(at::kDouble);
    const at::Tensor picks = one_sided ? c.routing.experts.remainder(3) : c.routing.experts;
    const auto leaves = [&](std::int64_t row, std::int64_t rows, std::int64_t expert, std::int64_t experts) {
      std::vector<at::Tensor> out{c.hidden.narrow(0, row, rows), c.routing.weights.narrow(0, row, rows)};
      for (const auto& t : {c.gate_up_delta.a, c.gate_up_delta.b, c.down_delta.a, c.down_delta.b}) out.push_back(t.narrow(0, expert, experts));
      for (auto& t : out) t = t.clone().requires_grad_(true);
      return out;
    };
    const auto run = [&](const std::vector<at::Tensor>& l, std::int64_t row, std::int64_t expert, Communicator* group) {
      const std::int64_t rows = l[0].size(0), experts = l[2].size(0);
      const Routing routing{at::Tensor(), l[1], picks.narrow(0, row, rows)};
      const at::Tensor gate_up = c.gate_up.narrow(0, expert, experts), down = c.down.narrow(0, expert, experts);
      const at::Tensor out = group ? grouped_experts(l[0], routing, gate_up, down, {l[2], l[3], 0.75}, {l[4], l[5], 0.75}, *group)
                                   : grouped_experts(l[0], routing, gate_up, down, {l[2], l[3], 0.75}, {l[4], l[5], 0.75});
      torch::autograd::backward({(out * c.probe.narrow(0, row, rows)).sum()});
      std::vector<at::Tensor> g{out.detach()};
      for (const auto& t : l) g.push_back(t.grad());
      return g;
    };
    const auto whole = run(leaves(0, 120, 0, 6), 0, 0, nullptr);
    const char* names[] = {"output", "hidden", "routing weights", "gate_up's A", "gate_up's B", "down's A", "down's B"};
    test::on_ranks(Mesh{2, 1, 1}, [&](Parallel& parallel) {
      const int r = parallel.data().rank();
      const auto got = run(leaves(r * 60, 60, r * 3, 3), r * 60, r * 3, &parallel.data());
      for (std::size_t i = 0; i < got.size(); ++i) {
        const at::Tensor want = i < 3 ? whole[i].narrow(0, r * 60, 60) : whole[i].narrow(0, r * 3, 3);
        if (one_sided && r == 1 && i >= 3) {  // no row picked rank 1's experts
          EXPECT_EQ(got[i].abs().max().item<double>(), 0.0) << names[i];
          continue;
        }
        expect_close(got[i], want, std::string(names[i]) + (one_sided ? " (one-sided)" : "") + " on rank " + std::to_string(r), 1e-12);
      }
    });
  }
}

// Experts stored 4-bit (a LinearWeight holding each stacked weight as the matrix of its experts'
// rows, as qlora stores them) compute what their dequantized values compute: outputs and the
// gradients of the rows, routing weights and the LoRA's A and B, on the CPU in float32 and, where
// there is a GPU, through its grouped GEMMs in bf16 (the stored weight dequantized again for the
// backward, never kept).
TEST(Moe, StoredExpertsEqualTheirDenseValues) {
  std::vector<c10::Device> devices{c10::Device(at::kCPU)};
  if (at::hasCUDA()) devices.emplace_back(at::kCUDA);
  for (const auto& device : devices) {
    const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
    const LowRankCase c = low_rank_case(at::kFloat);
    const auto o = at::TensorOptions().dtype(dtype).device(device);
    // Widths of 16-byte rows, as the GPU's grouped GEMM takes them.
    const std::int64_t experts = 6, h = 16, width = 8;
    QuantizedWeight gate_up(h, experts * 2 * width, QuantType::kNF4, 16, false, o, dtype), down(width, experts * h, QuantType::kNF4, 16, false, o, dtype);
    gate_up.assign("weight", c.gate_up.reshape({-1, h}).to(o));
    down.assign("weight", c.down.reshape({-1, width}).to(o));
    const at::Tensor gate_up_values = gate_up.dense().view({experts, 2 * width, h}), down_values = down.dense().view({experts, h, width});
    const auto run = [&](const ExpertsMatrix& gu, const ExpertsMatrix& dn) {
      std::vector<at::Tensor> l;
      for (const auto& t : {c.hidden, c.routing.weights, c.gate_up_delta.a, c.gate_up_delta.b, c.down_delta.a, c.down_delta.b})
        l.push_back(t.to(o).clone().requires_grad_(true));
      // On the GPU rank 4 is padded to 8 with zeros: the grouped GEMM takes 16-byte rows.
      const auto pad_a = [&](const at::Tensor& a) { return device.is_cuda() ? at::cat({a, at::zeros_like(a)}, 1) : a; };
      const auto pad_b = [&](const at::Tensor& b) { return device.is_cuda() ? at::cat({b, at::zeros_like(b)}, 2) : b; };
      const at::Tensor out = grouped_experts(l[0], Routing{at::Tensor(), l[1], c.routing.experts.to(device)}, gu, dn, {pad_a(l[2]), pad_b(l[3]), 0.75},
                                             {pad_a(l[4]), pad_b(l[5]), 0.75});
      torch::autograd::backward({(out * c.probe.to(o)).sum()});
      std::vector<at::Tensor> g{out.detach().to(at::kFloat).cpu()};
      for (const auto& t : l) g.push_back(t.grad().to(at::kFloat).cpu());
      return g;
    };
    const auto stored = run(ExpertsMatrix(gate_up, experts, 2 * width, h), ExpertsMatrix(down, experts, h, width));
    const auto dense = run(gate_up_values, down_values);
    const char* names[] = {"output", "hidden", "routing weights", "gate_up's A", "gate_up's B", "down's A", "down's B"};
    for (std::size_t i = 0; i < dense.size(); ++i) expect_close(stored[i], dense[i], std::string(names[i]) + " on " + device.str(), device.is_cuda() ? 1e-2 : 1e-6);
    EXPECT_GT((gate_up_values.to(at::kFloat).cpu() - c.gate_up).abs().max().item<double>(), 1e-3) << "the stored weight is not 4-bit";
  }
}

// The same through the GPU's grouped GEMMs in bf16 against fp32 on the CPU.
LOOM_GPU_TEST(Moe, LowRankDeltasOnTheGpuEqualTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const LowRankCase c = low_rank_case(at::kFloat);
  const auto run = [&](const at::Device& device, at::ScalarType dtype) {
    std::vector<at::Tensor> leaves;
    for (const auto& t : {c.hidden, c.gate_up_delta.a, c.gate_up_delta.b, c.down_delta.a, c.down_delta.b})
      leaves.push_back(t.to(device, dtype).requires_grad_(true));
    // Rank 4 rows are 8 bytes: padded to rank 8 with zeros, as the grouped GEMM needs 16-byte rows.
    const auto pad_a = [](const at::Tensor& a) { return at::cat({a, at::zeros_like(a)}, 1); };
    const auto pad_b = [](const at::Tensor& b) { return at::cat({b, at::zeros_like(b)}, 2); };
    const at::Tensor out = grouped_experts(leaves[0], Routing{at::Tensor(), c.routing.weights.to(device, dtype), c.routing.experts.to(device)},
                                           c.gate_up.to(device, dtype), c.down.to(device, dtype), {pad_a(leaves[1]), pad_b(leaves[2]), 0.75},
                                           {pad_a(leaves[3]), pad_b(leaves[4]), 0.75});
    torch::autograd::backward({(out * c.probe.to(device, dtype)).sum()});
    std::vector<at::Tensor> results = {out.detach().to(at::kCPU, at::kFloat)};
    for (const auto& l : leaves) results.push_back(l.grad().to(at::kCPU, at::kFloat));
    return results;
  };
  const auto gpu = run(at::Device(at::kCUDA, 0), at::kBFloat16), cpu = run(at::Device(at::kCPU), at::kFloat);
  const char* names[] = {"output", "hidden", "gate_up's A", "gate_up's B", "down's A", "down's B"};
  for (std::size_t i = 0; i < gpu.size(); ++i) expect_close(gpu[i], cpu[i], names[i], 3e-2);
}

}  // namespace
}  // namespace loom::kit
