// On a GPU, per weight shape (NF4, blocks of 64, double quantization, bf16):
// - dequantization and quantization, beside a device copy of the dequantized bytes (the floor any
//   kernel that writes them pays);
// - a generation step's product (1 and 4 rows) from the codes (kit::linear_from_codes), beside
//   dequantizing then multiplying (what it replaces) and the bf16 product with the dense weight.
// Run by bench/run_qlora.sh.
//   loom_dequantize_bench [ITERATIONS]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include "loom/kit/quantize.hpp"

namespace {

// Mean seconds per call over `iterations` calls after a warm-up, cycling through `sets` inputs so
// the 60 MB L2 does not serve them.
double seconds_per_call(int iterations, int sets, const std::function<void(int)>& call) {
  for (int i = 0; i < sets; ++i) call(i);
  torch::cuda::synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) call(i % sets);
  torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
}

}  // namespace

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "loom_dequantize_bench: no CUDA device\n");
    return 1;
  }
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 200;
  struct Shape {
    const char* name;
    std::int64_t out, in;
  };
  const std::vector<Shape> shapes = {{"8B q_proj", 4096, 4096}, {"8B gate_proj", 14336, 4096}, {"70B gate_proj", 28672, 8192}};
  const int sets = 4;
  struct Product {
    const char* name;
    std::int64_t rows;
    double codes, dequantized, dense, bytes;  // seconds per product; the 4-bit weight's bytes
  };
  std::vector<Product> products;
  std::printf("%-14s %12s %10s %10s %10s %10s %9s %12s\n", "shape", "parameters", "dequant us", "GB/s", "copy us", "GB/s", "vs copy",
              "quantize us");
  for (const auto& shape : shapes) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    std::vector<at::Tensor> weights, copies;
    std::vector<loom::kit::QuantizedTensor> quantized;
    for (int i = 0; i < sets; ++i) {
      weights.push_back(at::randn({shape.out, shape.in}, options) * 0.02);
      copies.push_back(at::empty_like(weights.back()));
      quantized.push_back(loom::kit::quantize_4bit(weights.back(), loom::kit::QuantType::kNF4, 64, true));
    }
    const double dequant = seconds_per_call(iterations, sets, [&](int i) { (void)loom::kit::dequantize_4bit(quantized[i], at::kBFloat16); });
    const double copy = seconds_per_call(iterations, sets, [&](int i) { copies[i].copy_(weights[(i + 1) % sets]); });
    const double quantize = seconds_per_call(iterations / 10 + 1, sets, [&](int i) {
      (void)loom::kit::quantize_4bit(weights[i], loom::kit::QuantType::kNF4, 64, true);
    });
    const double n = static_cast<double>(shape.out * shape.in);
    const double dequant_bytes = static_cast<double>(quantized[0].bytes()) + 2 * n, copy_bytes = 4 * n;
    std::printf("%-14s %12.0f %10.1f %10.0f %10.1f %10.0f %8.2fx %12.1f\n", shape.name, n, dequant * 1e6, dequant_bytes / dequant / 1e9,
                copy * 1e6, copy_bytes / copy / 1e9, dequant / copy, quantize * 1e6);
    for (const std::int64_t rows : {1, 4}) {
      const at::Tensor x = at::randn({rows, shape.in}, options);
      const double codes = seconds_per_call(iterations, sets, [&](int i) { (void)loom::kit::linear_from_codes(x, quantized[i]); });
      const double dequantized = seconds_per_call(iterations, sets, [&](int i) {
        (void)at::linear(x, loom::kit::dequantize_4bit(quantized[i], at::kBFloat16));
      });
      const double dense = seconds_per_call(iterations, sets, [&](int i) { (void)at::linear(x, weights[i]); });
      products.push_back({shape.name, rows, codes, dequantized, dense, static_cast<double>(quantized[0].bytes())});
    }
  }
  std::printf("\n%-14s %5s %10s %10s %12s %10s %10s %10s\n", "shape", "rows", "codes us", "GB/s", "dequant+mm", "bf16 us", "vs dequant",
              "vs bf16");
  for (const auto& p : products)
    std::printf("%-14s %5lld %10.1f %10.0f %12.1f %10.1f %9.2fx %9.2fx\n", p.name, static_cast<long long>(p.rows), p.codes * 1e6,
                p.bytes / p.codes / 1e9, p.dequantized * 1e6, p.dense * 1e6, p.dequantized / p.codes, p.dense / p.codes);
  return 0;
}
