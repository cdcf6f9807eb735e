#pragma once
// Which device loom's own CUDA kernels run as, and which kernel computes generation's few-row
// products: one table, read from the device's traits and pinnable by tests, so each kernel is
// checked against its reference on any card and the choice on a T4, an A100 or an RTX card is
// checked without one.
#include <cstdint>
#include <optional>
#include <string>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// A compute capability as major * 10 + minor (75: a T4, 90: an H100); "7.5" and back. Parsing
// throws UserError on anything but MAJOR.MINOR with one digit of minor, from 3.0 to 15.9.
LOOM_API int parse_capability(const std::string& text);
LOOM_API std::string capability_name(int capability);

// LOOM_DEVICE_CAPABILITY, a test mode: "7.5" makes loom choose kernels and dtypes as on a device of
// compute capability 7.5 (never above the device's own). 0 where unset; UserError where malformed.
LOOM_API int capability_override();

// What the product table reads of a device.
struct DeviceTraits {
  int capability = 0;          // what the kernels may use: the device's (or the override's), never past the code's
  int multiprocessors = 0;
  int shared_bytes_optin = 0;  // the most dynamic shared memory one block may have
};

// The current CUDA device as the table reads it (all zero on a CPU build).
LOOM_API DeviceTraits current_cuda_device_traits();

// Named cards' traits (NVIDIA's published figures), for checking the table's choice on each.
struct NamedCard {
  const char* name;
  DeviceTraits traits;
};
LOOM_API const NamedCard* named_cards(std::size_t& count);

// The few-row product kernels (products_cuda.cu) and the path taken where none is.
enum class ProductKernel : int {
  kLibTorch,           // no few-row kernel: LibTorch's matmul (4-bit: dequantized first, then the GEMM)
  kDenseLanes,         // a warp two output features, lanes striding the input; any device
  kDenseLanesOneLine,  // a warp one feature: one row over a group too small to fill the device
  kDenseStagedTiles,   // tensor-core tiles fed from shared memory by cp.async: 8.0 on, 3 or 4 rows, 168 KB a block
  kCodeLanes,          // 4-bit, a warp two features from the codes; any device
  kCodeTilesBlocks,    // 4-bit tensor-core tiles, a column per block of codes: 8.0 on, 1 or 2 rows
  kCodeTilesRows,      // 4-bit tensor-core tiles, a column per row: 8.0 on, 3 or 4 rows
};
inline constexpr ProductKernel kProductKernels[] = {ProductKernel::kLibTorch,         ProductKernel::kDenseLanes,       ProductKernel::kDenseLanesOneLine,
                                                    ProductKernel::kDenseStagedTiles, ProductKernel::kCodeLanes,        ProductKernel::kCodeTilesBlocks,
                                                    ProductKernel::kCodeTilesRows};
LOOM_API const char* product_kernel_name(ProductKernel kernel);

inline constexpr int kMaxProductWeights = 3;  // q, k and v

// What the table reads of a group of products sharing an input.
struct ProductShape {
  bool quantized = false;   // 4-bit weights (else dense in x's dtype)
  bool sixteen_bit = true;  // x is bf16 or fp16 (tensor cores take no float32)
  bool swiglu = false;      // gate and up, finished as SwiGLU
  std::int64_t rows = 0, in = 0;
  int count = 0;
  std::int64_t out[kMaxProductWeights] = {};
  std::int64_t largest_codes = 0;    // 4-bit: the most codes one weight has
  std::int64_t smallest_block = 0;   // 4-bit: the smallest block of codes sharing a scale
};

// Whether `kernel` can compute the shape on such a device; the kernel the table picks (the
// fastest measured that can, bench/RESULTS.md); or the pinned one (pin_product_kernel) where it can.
LOOM_API bool product_kernel_takes(ProductKernel kernel, const ProductShape& shape, const DeviceTraits& device);
LOOM_API ProductKernel choose_product_kernel(const ProductShape& shape, const DeviceTraits& device);

// For tests: every group goes to `kernel` where it takes the group and to LibTorch where it does
// not (nullopt: the table decides). Process-wide.
LOOM_API void pin_product_kernel(std::optional<ProductKernel> kernel);

// The CUDA architectures this build's kernels were compiled for ("75-real;80-real;90": cubins,
// and PTX where no "-real"); empty on a CPU build.
LOOM_API std::string cuda_architectures();

}  // namespace loom::kit
