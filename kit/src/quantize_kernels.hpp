#pragma once
// The arithmetic of 4-bit quantization and dequantization, one element at a time, compiled both
// for the CPU loops (quantize.cpp) and the CUDA kernels (quantize_cuda.cu): one definition, so both
// devices agree bit for bit (float32 products rounded once each, never fused into an FMA; one
// rounding to the output dtype). No LibTorch here: nvcc compiles this without its headers.
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define LOOM_HD __host__ __device__ __forceinline__
#else
#define LOOM_HD inline
#endif

namespace loom::kit::detail {

enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Rounded products and sums, never contracted into an FMA (whose single rounding would differ).
LOOM_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;  // ISO C++ mode: GCC and Clang do not contract across statements or here
#endif
}
LOOM_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
LOOM_HD float reciprocal_rn(float a) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

LOOM_HD std::uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
LOOM_HD float bits_float(std::uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// float32 -> bfloat16 bits, rounding to nearest with ties to even (what LibTorch's conversion does).
LOOM_HD std::uint16_t bfloat16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
LOOM_HD float bfloat16_value(std::uint16_t bits) { return bits_float(static_cast<std::uint32_t>(bits) << 16); }

// What a 4-bit tensor is dequantized from. Pointers are on the device that runs the arithmetic.
struct DequantizeArgs {
  const std::uint8_t* packed = nullptr;        // two codes per byte, the even element in the high nibble
  const float* absmax = nullptr;               // per block; null when the scales are double quantized
  const std::uint8_t* absmax_codes = nullptr;  // per block, on nested_map, when double quantized
  const float* nested_absmax = nullptr;        // per nested block
  const float* nested_map = nullptr;           // 256 values
  float offset = 0;
  std::int64_t nested_blocksize = 256;
  std::int64_t blocksize = 64;
  std::int64_t n = 0;
  float values[16] = {};  // what each code stands for
};

// The float32 scale of block `block`: double quantization gives it back as map value x nested
// absmax + offset, rounded after each step. `nested_block` is block / nested_blocksize, which
// callers that know a cheaper division than a 64-bit one pass.
LOOM_HD float block_scale(const DequantizeArgs& a, std::int64_t block, std::int64_t nested_block) {
  if (a.absmax != nullptr) return a.absmax[block];
  return add_rn(mul_rn(a.nested_map[a.absmax_codes[block]], a.nested_absmax[nested_block]), a.offset);
}
LOOM_HD float block_scale(const DequantizeArgs& a, std::int64_t block) { return block_scale(a, block, block / a.nested_blocksize); }

// The element a packed byte holds (the odd one in the low nibble), given what each code stands for.
LOOM_HD float dequantized_code(const float* values, unsigned byte, bool odd, float scale) {
  return mul_rn(values[odd ? (byte & 15u) : (byte >> 4)], scale);
}

LOOM_HD float dequantized(const DequantizeArgs& a, std::int64_t i, float scale) {
  return dequantized_code(a.values, a.packed[i >> 1], (i & 1) != 0, scale);
}

// What quantization needs besides the input: the code of a value normalised into [-1, 1] is the
// number of thresholds (ascending float32 midpoints of the code values) it exceeds; NaN (a block of
// zeros scaled by 1 / 0) exceeds none. FP4 ranks |x| among its magnitudes and keeps the sign in bit 3.
struct QuantizeArgs {
  const void* x = nullptr;  // n elements of `dtype` (the CPU loop is given float32 or bfloat16)
  Dtype dtype = Dtype::kFloat32;
  std::int64_t n = 0;
  std::int64_t blocksize = 64;
  float* absmax = nullptr;           // out: per block, max |x| in float32
  std::uint8_t* packed = nullptr;    // out: (n + 1) / 2 bytes
  bool fp4 = false;
  float thresholds[15] = {};         // NF4: of the 16 values; FP4: of the 8 magnitudes (7 used)
  std::uint8_t fp4_code_of_rank[8] = {};
  std::uint8_t pad_code = 0;         // the code of 0, padding an odd count
};

// Element i of x as float32: float32 or bfloat16 (float16 on CUDA).
LOOM_HD float value_at(const void* x, Dtype dtype, std::int64_t i) {
  switch (dtype) {
    case Dtype::kBFloat16: return bfloat16_value(static_cast<const std::uint16_t*>(x)[i]);
#ifdef __CUDA_ARCH__
    case Dtype::kFloat16: return __half2float(static_cast<const __half*>(x)[i]);
#endif
    default: return static_cast<const float*>(x)[i];
  }
}

LOOM_HD float input_at(const QuantizeArgs& a, std::int64_t i) { return value_at(a.x, a.dtype, i); }

LOOM_HD std::uint8_t code_of(const QuantizeArgs& a, float normalised) {
  std::uint8_t rank = 0;
  if (!a.fp4) {
    for (int t = 0; t < 15; ++t) rank += normalised > a.thresholds[t] ? 1 : 0;
    return rank;
  }
  const float magnitude = normalised < 0 ? -normalised : normalised;  // NaN stays NaN: rank 0
  for (int t = 0; t < 7; ++t) rank += magnitude > a.thresholds[t] ? 1 : 0;
  return static_cast<std::uint8_t>(a.fp4_code_of_rank[rank] + (normalised < 0 ? 8 : 0));
}

// Byte j of the packed codes: elements 2j and 2j + 1, each normalised by its own block's scale.
LOOM_HD std::uint8_t packed_byte(const QuantizeArgs& a, std::int64_t j, float first, float second) {
  const std::int64_t i = 2 * j;
  const std::uint8_t high = code_of(a, mul_rn(first, reciprocal_rn(a.absmax[i / a.blocksize])));
  const std::uint8_t low = i + 1 < a.n ? code_of(a, mul_rn(second, reciprocal_rn(a.absmax[(i + 1) / a.blocksize]))) : a.pad_code;
  return static_cast<std::uint8_t>(high * 16 + low);
}

LOOM_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
LOOM_HD float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// 8-bit AdamW, bitsandbytes' blockwise kind: per block of 256 values each moment is a code of its
// dynamic map (signed for the first, unsigned for the second) times the block's absmax; a step
// decodes both, updates them and the float32 weights, and codes each again against its new absmax
// (the nearest code: the number of map midpoints below the normalised value).
constexpr int kAdam8Block = 256;
struct AdamW8bitArgs {
  float* weights = nullptr;  // n float32 values, updated
  const void* grad = nullptr;
  Dtype grad_dtype = Dtype::kFloat32;  // float32 or bfloat16 (float16 on CUDA)
  std::uint8_t* m_codes = nullptr;     // blocks x 256
  float* m_absmax = nullptr;           // blocks
  std::uint8_t* v_codes = nullptr;
  float* v_absmax = nullptr;
  const float* signed_map = nullptr;    // 256 ascending values
  const float* unsigned_map = nullptr;  // 256 ascending values
  std::int64_t n = 0;
  float beta1 = 0, beta2 = 0, one_minus_beta1 = 0, one_minus_beta2 = 0, eps = 0;
  float decay = 1;  // 1 - lr x weight decay
  float step = 0;   // lr / (1 - beta1^t)
  float c2 = 1;     // 1 - beta2^t
};

// Value i's decoded moments after the step, with its weight updated (decoupled decay, then the
// bias-corrected step).
LOOM_HD void adam8_update(const AdamW8bitArgs& a, std::int64_t i, float& m, float& v) {
  const float g = value_at(a.grad, a.grad_dtype, i);
  m = add_rn(mul_rn(m, a.beta1), mul_rn(g, a.one_minus_beta1));
  v = add_rn(mul_rn(v, a.beta2), mul_rn(mul_rn(g, g), a.one_minus_beta2));
  const float denominator = add_rn(sqrt_rn(div_rn(v, a.c2)), a.eps);
  a.weights[i] = add_rn(mul_rn(a.weights[i], a.decay), -mul_rn(a.step, div_rn(m, denominator)));
}

LOOM_HD std::uint8_t adam8_code(const float* map, float x, float absmax) {
  const float normalised = div_rn(x, absmax > 0 ? absmax : 1.0f);
  int lo = 0, hi = 255;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (mul_rn(add_rn(map[mid], map[mid + 1]), 0.5f) < normalised) lo = mid + 1;
    else hi = mid;
  }
  return static_cast<std::uint8_t>(lo);
}

#ifdef LOOM_WITH_CUDA
// CUDA launchers (quantize_cuda.cu), on `stream` of the current device. They return null, or
// the CUDA error's text.
const char* dequantize_4bit_cuda(const DequantizeArgs& args, void* out, Dtype out_dtype, void* stream);
const char* quantize_4bit_cuda(const QuantizeArgs& args, void* stream);
const char* adamw_8bit_cuda(const AdamW8bitArgs& args, void* stream);

#endif

}  // namespace loom::kit::detail
