#pragma once
// 4-bit weights as QLoRA defines them (Dettmers et al. 2023: NF4, blocks of 64, double
// quantization of the block scales in 8-bit blocks of 256), stored in bitsandbytes' layout so
// checkpoints move between loom and the Python ecosystem unchanged:
// - the row-major flattened weight in blocks of `blocksize` (the last may be short); absmax =
//   max |x| per block (float32); x normalised as x * (1 / absmax) in float32;
// - a code is the number of thresholds (midpoints of consecutive code values) x exceeds, so a tie
//   takes the lower code and a block of zeros (0 * inf = NaN) code 0; FP4 keeps the sign in bit 3;
// - two codes per byte, the even element in the high nibble (an odd count pads the code of 0);
// - double quantization: offset = mean(absmax); absmax - offset in blocks of 256 with their own
//   float32 absmax, coded on the signed 8-bit dynamic map (nearest, ties to the lower code);
// - dequantization: float32(code value * absmax) rounded once to the wanted dtype.
// tests/qlora/reference.py is an independent reference of exactly this.
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/layers.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

enum class QuantType { kNF4, kFP4 };
LOOM_API const char* quant_type_name(QuantType type);  // "nf4", "fp4"
LOOM_API QuantType parse_quant_type(const std::string& name);  // UserError for anything else

// The 16 values a code stands for (float32; index = code).
LOOM_API const std::array<float, 16>& code_values(QuantType type);
// bitsandbytes' signed 8-bit dynamic map (256 ascending float32 values), for the block scales.
LOOM_API const std::array<float, 256>& dynamic_map_8bit();
// Its unsigned form (twice the parts of each exponent, no negatives): 8-bit optimizers' second
// moments (kit 3.2).
LOOM_API const std::array<float, 256>& dynamic_map_8bit_unsigned();

// One AdamW step of `weights` (float32, contiguous, n values) whose moments are 8-bit codes, as
// bitsandbytes' blockwise 8-bit optimizer keeps them: m_codes and v_codes (uint8, n rounded up to
// blocks of 256), m_absmax and v_absmax (float32, one a block), on dynamic_map_8bit() and
// dynamic_map_8bit_unsigned(). Each block is decoded, updated with `grad` (n values: float32 or
// bfloat16, float16 too on CUDA) and coded again to its nearest codes under its new absmax, in one
// pass without temporaries: a CUDA kernel for tensors on a GPU, a CPU loop otherwise, the same bits
// (kit 3.2).
struct AdamW8bitStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  std::int64_t t = 1;  // the step's number, from 1 (bias correction)
};
LOOM_API void adamw_8bit_step(const at::Tensor& weights, const at::Tensor& grad, const at::Tensor& m_codes, const at::Tensor& m_absmax,
                              const at::Tensor& v_codes, const at::Tensor& v_absmax, const AdamW8bitStep& step);

struct LOOM_API QuantizedTensor {
  QuantType type = QuantType::kNF4;
  std::int64_t blocksize = 64;
  std::vector<std::int64_t> shape;   // of the full-precision tensor
  at::ScalarType dtype = at::kFloat; // the full-precision tensor's (dequantize()'s default)
  at::Tensor packed;                 // uint8 [ceil(n / 2)]
  at::Tensor absmax;                 // float32 [blocks]; uint8 [blocks] when double quantized
  at::Tensor nested_absmax;          // float32 [ceil(blocks / 256)], double quantization only
  at::Tensor nested_map;             // float32 [256], double quantization only
  float offset = 0;                  // double quantization only
  std::int64_t nested_blocksize = 256;

  bool double_quantized() const { return nested_absmax.defined(); }
  std::int64_t numel() const;
  std::int64_t blocks() const;
  std::uint64_t bytes() const;  // as stored
};

// Quantizes `w` (any float dtype) on its own device.
LOOM_API QuantizedTensor quantize_4bit(const at::Tensor& w, QuantType type, std::int64_t blocksize, bool double_quant);
// The full-precision tensor of `q`'s shape in `dtype`, on q's device.
LOOM_API at::Tensor dequantize_4bit(const QuantizedTensor& q, at::ScalarType dtype);

// x W^T straight from W's codes, with no dequantized copy of W, for at most 4 rows of x (a
// generation step) on a GPU, in x's dtype (float32 sums, one scale product per 16 codes); an
// undefined tensor where that does not apply (more rows, the CPU, a layout the kernel does not take).
// No gradient flows through it. SDK 2.2.
LOOM_API at::Tensor linear_from_codes(const at::Tensor& x, const QuantizedTensor& q);

// A frozen linear weight stored 4-bit. forward() dequantizes into the compute dtype and multiplies
// (the input cast to it, the output back), or without gradients uses linear_from_codes where it
// applies; backward recomputes the dequantized weight instead of keeping it. Filled by assign(): a
// full-precision "weight" is quantized at once (the full tensor is never kept); a checkpoint in
// bitsandbytes' layout ("weight" packed, "weight.absmax", "weight.quant_map", ...) is taken as
// stored.
class LOOM_API QuantizedWeight final : public LinearWeight {
 public:
  // `options`: the layer's dtype and device (what inputs, outputs and adapters use); `compute`: the
  // dtype products run in.
  QuantizedWeight(std::int64_t in_features, std::int64_t out_features, QuantType type, std::int64_t blocksize, bool double_quant,
                  const at::TensorOptions& options, at::ScalarType compute);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias) override;
  at::Tensor dense() const override;
  void add_(const at::Tensor& delta) override;  // refused: merge into a dense copy (dense())
  std::vector<std::pair<std::string, at::Tensor>> stored() override;
  at::TensorOptions options() const override { return options_; }
  std::uint64_t bytes() const override;
  void assign(const std::string& suffix, const at::Tensor& value) override;
  void finish_load(const std::string& name) override;

  const QuantizedTensor& quantized() const { return q_; }
  at::ScalarType compute_dtype() const { return compute_; }

 private:
  std::int64_t in_, out_;
  bool double_quant_;
  at::TensorOptions options_;
  at::ScalarType compute_;
  QuantizedTensor q_;
  bool filled_ = false;
  std::vector<std::string> parts_;  // bitsandbytes' parts read so far
};

// The bytes a [out, in] weight takes stored 4-bit (codes, scales, double quantization's tables).
// The values of an MXFP4 tensor (OCP microscaling FP4, as gpt-oss's released experts are stored):
// `blocks` uint8 [..., G, 16] holds 32 E2M1 codes a group, two a byte, the low nibble first; `scales`
// uint8 [..., G] one E8M0 exponent a group (value 2^(scale - 127)). Returns [..., G * 32] in
// `dtype`. UserError (what does not fit, without the tensor's name: the caller adds it) for other
// dtypes or shapes. Kit 3.8.
LOOM_API at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype);

LOOM_API std::uint64_t quantized_bytes(std::int64_t in_features, std::int64_t out_features, std::int64_t blocksize, bool double_quant);

}  // namespace loom::kit
