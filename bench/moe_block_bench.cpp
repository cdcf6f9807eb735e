// On a GPU: one mixture-of-experts layer's experts, forward and backward (every weight and the
// hidden states take gradients), through the kit's route and grouped_experts, at a given shape in
// bf16. The peer, transformers' Qwen3MoeSparseMoeBlock with grouped_mm and eager experts, is
// bench/hf_moe_block.py at the same shape; bench/run_moe_block.sh runs both.
//   loom_moe_block_bench TOKENS HIDDEN WIDTH EXPERTS TOP_K [ITERATIONS]
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include "loom/kit/moe.hpp"

int main(int argc, char** argv) {
  if (!torch::cuda::is_available() || argc < 6) {
    std::fprintf(stderr, "usage (on a GPU): loom_moe_block_bench TOKENS HIDDEN WIDTH EXPERTS TOP_K [ITERATIONS]\n");
    return 1;
  }
  const std::int64_t n = std::atoll(argv[1]), h = std::atoll(argv[2]), width = std::atoll(argv[3]), experts = std::atoll(argv[4]), k = std::atoll(argv[5]);
  const int iterations = argc > 6 ? std::atoi(argv[6]) : 20;
  const auto o = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  at::manual_seed(0);
  const at::Tensor hidden = at::randn({n, h}, o).requires_grad_(true);
  const at::Tensor router = (at::randn({experts, h}, o) * 0.02).requires_grad_(true);
  const at::Tensor gate_up = (at::randn({experts, 2 * width, h}, o) * 0.02).requires_grad_(true);
  const at::Tensor down = (at::randn({experts, h, width}, o) * 0.02).requires_grad_(true);
  const at::Tensor probe = at::randn({n, h}, o);
  const auto step = [&] {
    const auto routing = loom::kit::route(hidden, router, {k, true, true});
    const at::Tensor out = loom::kit::grouped_experts(hidden, routing, gate_up, down);
    torch::autograd::backward({(out * probe).sum()});
  };
  for (int i = 0; i < 3; ++i) step();
  torch::cuda::synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) step();
  torch::cuda::synchronize();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / iterations;
  std::printf("loom grouped_experts: %lld tokens, hidden %lld, %lld experts of width %lld, top-%lld: %.2f ms forward+backward\n", static_cast<long long>(n),
              static_cast<long long>(h), static_cast<long long>(experts), static_cast<long long>(width), static_cast<long long>(k), ms);
  return 0;
}
