// The kit's mixture-of-experts pieces against what transformers 5.17 computes
// (tests/fixtures/moe/make_reference.py, float64 on the CPU): Qwen3-MoE's and Mixtral's sparse
// blocks (router, top-2 of 8, with and without renormalisation) forward and backward, and the
// load-balancing loss with and without padding.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "loom/kit/moe.hpp"
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

}  // namespace
}  // namespace loom::kit
