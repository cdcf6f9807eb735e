// 4-bit quantization against tests/qlora/reference.py (plain Python from the QLoRA paper's
// definitions, sharing no code with loom): codes, scales and double quantization bit for bit on
// random and adversarial tensors (zeros, float32 extremes, values exactly on the thresholds,
// sizes no block divides, odd counts), and the dequantized values bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/safetensors.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;

const kit::SafetensorsFile& reference() {
  static const kit::SafetensorsFile file(source_dir() / "tests/fixtures/qlora/quantize.safetensors");
  return file;
}

// Equal bit for bit (so -0.0 differs from 0.0, and NaN equals a NaN of the same bits).
void expect_same_bits(const at::Tensor& mine, const at::Tensor& theirs, const std::string& what) {
  ASSERT_EQ(mine.numel(), theirs.numel()) << what;
  const at::Tensor a = mine.contiguous().reshape({-1}).to(at::kCPU), b = theirs.contiguous().reshape({-1}).to(at::kCPU);
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  const at::Tensor ab = a.scalar_type() == at::kFloat ? a.view(at::kInt) : a, bb = b.scalar_type() == at::kFloat ? b.view(at::kInt) : b;
  const at::Tensor differ = (ab != bb).nonzero();
  EXPECT_EQ(differ.size(0), 0) << what << ": " << differ.size(0) << " of " << a.numel() << " differ, first at "
                               << (differ.size(0) ? differ[0][0].item<std::int64_t>() : -1);
}

TEST(Quantize, CodesScalesAndDoubleQuantizationEqualTheReference) {
  const auto& file = reference();
  // The 8-bit map for the block scales, built the same way on both sides.
  const auto& map = kit::dynamic_map_8bit();
  expect_same_bits(at::tensor(std::vector<float>(map.begin(), map.end()), at::kFloat), file.tensor("map8"), "map8");
  int checked = 0;
  for (const auto& info : file.tensors()) {
    if (info.name.find('.') != std::string::npos || info.name == "map8") continue;
    const at::Tensor input = file.tensor(info.name);
    for (const auto type : {kit::QuantType::kNF4, kit::QuantType::kFP4})
      for (std::int64_t blocksize : {64, 128})
        for (bool dq : {false, true}) {
          const std::string key = info.name + "." + kit::quant_type_name(type) + "." + std::to_string(blocksize) + "." + (dq ? "dq" : "plain");
          SCOPED_TRACE(key);
          const kit::QuantizedTensor q = kit::quantize_4bit(input, type, blocksize, dq);
          expect_same_bits(q.packed, file.tensor(key + ".packed"), "codes");
          if (dq) {
            expect_same_bits(q.absmax, file.tensor(key + ".qabsmax"), "8-bit scales");
            expect_same_bits(q.nested_absmax, file.tensor(key + ".nested_absmax"), "nested absmax");
            expect_same_bits(at::tensor({q.offset}, at::kFloat), file.tensor(key + ".offset"), "offset");
          } else {
            expect_same_bits(q.absmax, file.tensor(key + ".absmax"), "absmax");
          }
          expect_same_bits(kit::dequantize_4bit(q, at::kFloat), file.tensor(key + ".dequantized"), "dequantized");
          ++checked;
        }
  }
  EXPECT_EQ(checked, 7 * 8);
}

// Dequantizing into bf16 or fp16 rounds each float32 value once, and a bf16 or fp16 input (exact in
// float32) quantizes as its float32 value does.
TEST(Quantize, EveryDtypeRoundsTheFloat32ValuesOnce) {
  at::manual_seed(3);
  const at::Tensor w = at::randn({37, 41});  // 1517 elements: odd, no block divides it
  for (const auto type : {kit::QuantType::kNF4, kit::QuantType::kFP4})
    for (bool dq : {false, true}) {
      SCOPED_TRACE(std::string(kit::quant_type_name(type)) + (dq ? " dq" : ""));
      const kit::QuantizedTensor q = kit::quantize_4bit(w, type, 64, dq);
      const at::Tensor full = kit::dequantize_4bit(q, at::kFloat);
      for (const auto dtype : {at::kBFloat16, at::kHalf, at::kDouble}) {
        const at::Tensor got = kit::dequantize_4bit(q, dtype);
        EXPECT_EQ(got.scalar_type(), dtype);
        EXPECT_TRUE(at::equal(got, full.to(dtype))) << c10::toString(dtype);
      }
      for (const auto dtype : {at::kBFloat16, at::kHalf}) {
        const at::Tensor narrow = w.to(dtype);
        const kit::QuantizedTensor a = kit::quantize_4bit(narrow, type, 64, dq), b = kit::quantize_4bit(narrow.to(at::kFloat), type, 64, dq);
        expect_same_bits(a.packed, b.packed, "codes");
        expect_same_bits(a.absmax, b.absmax, "scales");
        EXPECT_EQ(a.dtype, dtype);
      }
    }
}

// On a GPU the CUDA kernels give the CPU's bits: codes, scales, and dequantized values in every
// dtype, for both types, blocks that do (64) and do not (80, 17) divide the size, and an odd count.
LOOM_GPU_TEST(Quantize, CudaKernelsGiveTheCpuBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(5);
  const at::Tensor w = at::randn({1023, 77}) * 0.05;
  for (const auto type : {kit::QuantType::kNF4, kit::QuantType::kFP4})
    for (std::int64_t blocksize : {64, 80, 17})
      for (bool dq : {false, true})
        for (const auto input : {at::kFloat, at::kBFloat16, at::kHalf}) {
          SCOPED_TRACE(std::string(kit::quant_type_name(type)) + " " + std::to_string(blocksize) + (dq ? " dq " : " ") + c10::toString(input));
          const at::Tensor x = w.to(input);
          const kit::QuantizedTensor cpu = kit::quantize_4bit(x, type, blocksize, dq), gpu = kit::quantize_4bit(x.to(at::kCUDA), type, blocksize, dq);
          EXPECT_TRUE(gpu.packed.is_cuda());
          expect_same_bits(gpu.packed, cpu.packed, "codes");
          expect_same_bits(gpu.absmax, cpu.absmax, "scales");
          if (dq) expect_same_bits(gpu.nested_absmax, cpu.nested_absmax, "nested absmax");
          for (const auto out : {at::kFloat, at::kBFloat16, at::kHalf}) {
            const at::Tensor a = kit::dequantize_4bit(gpu, out), b = kit::dequantize_4bit(cpu, out);
            EXPECT_TRUE(a.is_cuda());
            EXPECT_TRUE(at::equal(a.to(at::kCPU), b)) << "dequantized to " << c10::toString(out);
          }
        }
}

// On a GPU, products of 1 to 4 rows (a generation step) are computed from the codes: within the
// compute dtype's rounding of the exact product with the dequantized weight, for every dtype, both
// types, with and without double quantization, a feature count no warp's share divides and an
// input no warp's stride divides; more rows, the CPU, a block size that is no power of two or an
// input that is no multiple of 32 dequantize instead. kit::QuantizedWeight::forward takes that path without gradients.
LOOM_GPU_TEST(Quantize, FewRowProductsOnTheGpuComeFromTheCodes) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  torch::NoGradGuard no_grad;
  at::manual_seed(9);
  const std::int64_t out = 77;
  const auto tolerance = [](at::ScalarType t) { return t == at::kFloat ? 1e-6 : t == at::kHalf ? 2e-3 : 1e-2; };
  // 1,056 inputs: 33 steps of 32 codes, a lane stride and one more (the lanes' own products, for
  // float32); 1,088: 17 steps of 64 (tensor-core tiles for 16-bit dtypes from 3 rows). At 1 and 2
  // rows 16-bit dtypes take tiles with a column per quad, whose steps of 128 inputs end part-way
  // through both sizes (quads past the input read nothing).
  for (const std::int64_t in : {1056, 1088})
    for (const auto type : {kit::QuantType::kNF4, kit::QuantType::kFP4})
      for (bool dq : {false, true})
        for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
          SCOPED_TRACE(std::to_string(in) + " " + kit::quant_type_name(type) + (dq ? " dq " : " ") + c10::toString(dtype));
          const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
          kit::QuantizedWeight weight(in, out, type, 64, dq, options, dtype);
          weight.assign("weight", (at::randn({out, in}) * 0.05).to(options));
          weight.finish_load("layer");
          const kit::QuantizedTensor& q = weight.quantized();
          const at::Tensor exact_weight = kit::dequantize_4bit(q, at::kFloat).to(at::kCPU, at::kDouble);
          for (std::int64_t rows = 1; rows <= 5; ++rows) {
            SCOPED_TRACE("rows " + std::to_string(rows));
            const at::Tensor x = at::randn({1, rows, in}, options);
            const at::Tensor exact = at::matmul(x.to(at::kCPU, at::kDouble), exact_weight.t());
            const at::Tensor y = kit::linear_from_codes(x, q);
            if (rows > 4) {
              EXPECT_FALSE(y.defined());
              continue;
            }
            ASSERT_TRUE(y.defined());
            EXPECT_EQ(y.sizes(), (std::vector<std::int64_t>{1, rows, out}));
            EXPECT_EQ(y.scalar_type(), dtype);
            const double error = ((y.to(at::kCPU, at::kDouble) - exact).norm() / exact.norm()).item<double>();
            EXPECT_LT(error, tolerance(dtype));
            const at::Tensor through_layer = weight.forward(x, at::Tensor());
            EXPECT_TRUE(at::equal(through_layer, y));
            // A bias is added after the product.
            const at::Tensor bias = at::randn({out}, options);
            EXPECT_TRUE(at::allclose(weight.forward(x, bias), y + bias));
          }
        }
  // More tasks than the GPU's resident blocks take at once, and more steps than a lane's first
  // round: blocks go on to further tasks and lanes to further steps; no output is left out. The
  // tiles' teams at one row (products_cuda.cu's tile_team), on an H200's 264 resident blocks: 2,112
  // inputs and 7,000 features (438 tiles of 17 steps) take 4 warps a tile, 1,024 and 16,000 (1,000
  // tiles of 8 steps) 2.
  for (const auto& [big_in, big_out] : {std::pair<std::int64_t, std::int64_t>{2112, 7000}, {1024, 16000}}) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    kit::QuantizedWeight big(big_in, big_out, kit::QuantType::kNF4, 64, true, options, at::kBFloat16);
    big.assign("weight", (at::randn({big_out, big_in}) * 0.05).to(options));
    big.finish_load("big");
    const at::Tensor exact_weight = kit::dequantize_4bit(big.quantized(), at::kFloat).to(at::kCPU, at::kDouble);
    for (const std::int64_t rows : {1, 4}) {
      SCOPED_TRACE("big " + std::to_string(big_in) + " x " + std::to_string(big_out) + ", rows " + std::to_string(rows));
      const at::Tensor x = at::randn({rows, big_in}, options);
      const at::Tensor y = kit::linear_from_codes(x, big.quantized());
      ASSERT_TRUE(y.defined());
      const at::Tensor exact = at::matmul(x.to(at::kCPU, at::kDouble), exact_weight.t());
      const at::Tensor got = y.to(at::kCPU, at::kDouble);
      EXPECT_LT(((got - exact).norm() / exact.norm()).item<double>(), 1e-2);
      EXPECT_LT((got - exact).abs().max().item<double>(), 0.05 * exact.abs().max().item<double>()) << "an output left out";
    }
  }
  // What the kernel does not take: the CPU, a block size that is not a power of two, an input of
  // 80 (no whole number of 32-code steps).
  const at::Tensor w = at::randn({32, 96}) * 0.05;
  EXPECT_FALSE(kit::linear_from_codes(at::randn({1, 96}), kit::quantize_4bit(w, kit::QuantType::kNF4, 64, true)).defined());
  EXPECT_FALSE(kit::linear_from_codes(at::randn({1, 96}, at::kCUDA), kit::quantize_4bit(w.to(at::kCUDA), kit::QuantType::kNF4, 48, true)).defined());
  EXPECT_TRUE(kit::linear_from_codes(at::randn({1, 96}, at::kCUDA), kit::quantize_4bit(w.to(at::kCUDA), kit::QuantType::kNF4, 32, true)).defined());
  EXPECT_FALSE(kit::linear_from_codes(at::randn({1, 80}, at::kCUDA), kit::quantize_4bit(w.narrow(1, 0, 80).contiguous().to(at::kCUDA), kit::QuantType::kNF4, 64, true)).defined());
}

// NF4 with blocks of 64 and double quantization stores about half a byte per parameter.
// MXFP4 (gpt-oss's released experts): every E2M1 code of a byte, low nibble first, times its
// group's 2^(scale - 127), against the OCP format's table written out; shapes that do not match
// are one error.
TEST(Quantize, Mxfp4BlocksDequantizeAsTheOcpFormatSays) {
  const float e2m1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  // Two rows of two groups, each group's 16 bytes holding every code in both nibbles (j * 17 shifts
  // both by one), and scales below, at and above 127.
  at::Tensor blocks = at::empty({2, 2, 16}, at::kByte), scales = at::tensor({127, 128, 120, 131}, at::kByte).view({2, 2});
  auto b = blocks.accessor<std::uint8_t, 3>();
  for (int r = 0; r < 2; ++r)
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < 16; ++j) b[r][g][j] = static_cast<std::uint8_t>((j * 17 + 37 * (r * 2 + g)) % 256);
  const at::Tensor got = kit::dequantize_mxfp4(blocks, scales, at::kFloat);
  ASSERT_EQ(got.sizes(), (std::vector<std::int64_t>{2, 64}));
  for (int r = 0; r < 2; ++r)
    for (int g = 0; g < 2; ++g) {
      const double scale = std::ldexp(1.0, scales[r][g].item<int>() - 127);
      for (int j = 0; j < 16; ++j) {
        const int byte = b[r][g][j];
        EXPECT_EQ(got[r][g * 32 + 2 * j].item<float>(), e2m1[byte & 15] * scale) << r << " " << g << " " << j;
        EXPECT_EQ(got[r][g * 32 + 2 * j + 1].item<float>(), e2m1[byte >> 4] * scale) << r << " " << g << " " << j;
      }
    }
  EXPECT_EQ(kit::dequantize_mxfp4(blocks, scales, at::kBFloat16).scalar_type(), at::kBFloat16);
  for (const auto& [bad_blocks, bad_scales, expected] : std::vector<std::tuple<at::Tensor, at::Tensor, std::string>>{
           {blocks.narrow(-1, 0, 15), scales, "do not match: blocks are [..., groups, 16]"},
           {blocks, scales.narrow(1, 0, 1), "MXFP4 blocks [2, 2, 16] and scales [2, 1] do not match"},
           {blocks.to(at::kFloat), scales, "MXFP4 blocks and scales are bytes (U8)"}}) {
    try {
      kit::dequantize_mxfp4(bad_blocks, bad_scales, at::kFloat);
      ADD_FAILURE() << expected;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

TEST(Quantize, BytesPerParameter) {
  const at::Tensor w = at::randn({1024, 4096}) * 0.02;
  const kit::QuantizedTensor q = kit::quantize_4bit(w, kit::QuantType::kNF4, 64, true);
  const double per = static_cast<double>(q.bytes()) / static_cast<double>(w.numel());
  EXPECT_LT(per, 0.52);
  EXPECT_GT(per, 0.5);
  EXPECT_EQ(q.bytes(), kit::quantized_bytes(4096, 1024, 64, true));
  EXPECT_EQ(kit::quantize_4bit(w, kit::QuantType::kNF4, 64, false).bytes(), kit::quantized_bytes(4096, 1024, 64, false));
  // The error is what 16 levels per block allow and no more: each element dequantizes to the level
  // nearest it (no level times its block's absmax is closer; a float32 rounding of slack). Double
  // quantization changes how the scales are stored, not the codes.
  const kit::QuantizedTensor plain = kit::quantize_4bit(w, kit::QuantType::kNF4, 64, false);
  EXPECT_TRUE(at::equal(q.packed, plain.packed));
  const auto& table = kit::code_values(kit::QuantType::kNF4);
  const at::Tensor levels = at::tensor(std::vector<float>(table.begin(), table.end())).view({1, 1, 16});
  const std::int64_t blocks = 4096;  // the first 4096 blocks of 64
  const at::Tensor original = w.reshape({-1, 64}).narrow(0, 0, blocks);
  const at::Tensor absmax = plain.absmax.reshape({-1, 1}).narrow(0, 0, blocks);
  const at::Tensor got = kit::dequantize_4bit(plain, at::kFloat).reshape({-1, 64}).narrow(0, 0, blocks);
  const at::Tensor nearest = (levels * absmax.unsqueeze(-1) - original.unsqueeze(-1)).abs().amin(-1);
  const at::Tensor farther = (got - original).abs() > nearest + absmax * 1e-6;
  EXPECT_EQ(farther.sum().item<std::int64_t>(), 0) << "elements not at their nearest level";
}

// A 4-bit linear computes x W^T with W dequantized, and its input's gradient through the same W;
// a full-precision weight assigned to it is quantized on arrival.
TEST(Quantize, QuantizedLinearForwardAndBackward) {
  const at::Tensor w = at::randn({48, 80}) * 0.05;
  kit::QuantizedWeight weight(80, 48, kit::QuantType::kNF4, 64, true, at::TensorOptions().dtype(at::kFloat), at::kFloat);
  weight.assign("weight", w);
  weight.finish_load("layer");
  const at::Tensor dense = weight.dense();
  EXPECT_EQ(dense.sizes(), w.sizes());
  const at::Tensor x = at::randn({3, 5, 80}).set_requires_grad(true);
  const at::Tensor y = weight.forward(x, at::Tensor());
  EXPECT_TRUE(at::allclose(y, at::linear(x, dense), 1e-5, 1e-6));
  const at::Tensor g = at::randn_like(y);
  torch::autograd::backward({y}, {g});
  EXPECT_TRUE(at::allclose(x.grad(), at::matmul(g, dense), 1e-5, 1e-6));
  EXPECT_THROW(weight.add_(at::zeros_like(w)), UserError);
  EXPECT_THROW(weight.assign("weight", at::zeros({80, 48})), UserError);
  // What it stores is bitsandbytes' layout: the packed codes as [n / 2, 1] bytes, and the rest.
  std::vector<std::string> names;
  for (const auto& [name, t] : weight.stored()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
                                             "weight.quant_state.bitsandbytes__nf4"}));
  // Those parts, assigned to a fresh weight as a checkpoint holds them, give the same weight.
  kit::QuantizedWeight reread(80, 48, kit::QuantType::kNF4, 64, true, at::TensorOptions().dtype(at::kFloat), at::kFloat);
  for (const auto& [name, t] : weight.stored()) reread.assign(name, t);
  reread.finish_load("layer");
  EXPECT_TRUE(at::equal(reread.dense(), dense));
  kit::QuantizedWeight partial(80, 48, kit::QuantType::kNF4, 64, true, at::TensorOptions().dtype(at::kFloat), at::kFloat);
  partial.assign("weight", weight.stored()[0].second);
  try {
    partial.finish_load("model.layers.0.mlp.up_proj");
    ADD_FAILURE() << "incomplete parts were accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("the checkpoint lacks model.layers.0.mlp.up_proj.weight.absmax"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom::test
