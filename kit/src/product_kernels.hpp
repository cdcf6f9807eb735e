#pragma once
// Products of generation's few rows with the weights that read them (a decode step's q/k/v,
// gate/up, o, down and the head): one kernel per group of projections sharing an input, reading
// each weight once with wide loads, dense or straight from 4-bit codes, and finishing what follows
// the product (the residual's sum, SwiGLU) before anything is written. cuBLAS at one row splits a
// short matrix's inner dimension and reduces in a second kernel; these do neither. No LibTorch
// here: nvcc compiles this without it.
#include <cstdint>

#include "quantize_kernels.hpp"

namespace loom::kit::detail {

constexpr std::int64_t kFewRowsMax = 4;      // rows of x a product takes (a step's batch)
constexpr int kMaxGroupedWeights = 3;        // q, k and v
constexpr int kProductWarps = 8;             // warps a block, a task each
constexpr int kCodesTileStep = 64;           // inputs a warp's 4-bit tile step takes: 16 codes (8 bytes) a lane
constexpr int kStagedTilesBlockBytes = 172032;  // dynamic shared memory of a staged-tiles block: its ring and partial sums

enum class ProductFinish : int {
  kNone,         // y[s] = x W[s]^T, rounded to the dtype
  kAddResidual,  // y[0] = residual + round(x W[0]^T), rounded again (LibTorch's add after the product)
  kSwiGLU,       // y[0] = round(silu(round(x W[0]^T))) * round(x W[1]^T), rounded: gate and up
};

// Weights of one [out, in] product each, all read by the same x [rows, in]: dense in the x's dtype
// (`dense`, contiguous, 16-byte aligned) or 4-bit (`codes`, `quantized` true for the whole group).
struct ProductGroup {
  int count = 0;
  bool quantized = false;
  ProductFinish finish = ProductFinish::kNone;
  const void* dense[kMaxGroupedWeights] = {};
  DequantizeArgs codes[kMaxGroupedWeights];
  std::int64_t out[kMaxGroupedWeights] = {};
  void* y[kMaxGroupedWeights] = {};  // [rows, out[s]] each, contiguous; kSwiGLU writes y[0] only
  const void* residual = nullptr;    // [rows, out[0]] for kAddResidual
};

// Whether few_row_products_cuda takes the group: 1 to kFewRowsMax rows; `in` a multiple of 8 (dense)
// or 32 (4-bit) and x 16-byte aligned; dense rows 16-byte aligned; codes 16-byte aligned in
// power-of-two blocks of at least 32 (every bitsandbytes layout), every weight of the group on the
// same code values; kSwiGLU's two weights of equal size.
bool few_row_products_supported(const ProductGroup& group, const void* x, std::int64_t rows, std::int64_t in, Dtype dtype);

// Runs the group on `stream` of the current device, products summed in float32 (4-bit: the code
// values' sum over a step of 16 to 32 codes times their block's scale), by the kernel the table
// picks (loom/kit/kernels.hpp). Returns null, or the CUDA error's text.
const char* few_row_products_cuda(const ProductGroup& group, const void* x, std::int64_t rows, std::int64_t in, Dtype dtype, void* stream);

}  // namespace loom::kit::detail
