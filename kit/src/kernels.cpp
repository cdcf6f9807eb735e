// The kernel table (loom/kit/kernels.hpp): plain C++, so CI checks its choices on a CPU build.
#include "loom/kit/kernels.hpp"

#include <atomic>
#include <cstdlib>
#include <limits>

#include "loom/error.hpp"
#include "product_kernels.hpp"

namespace loom::kit {

#ifdef LOOM_WITH_CUDA
namespace detail {
DeviceTraits current_device_traits_of_kernels();  // quantize_cuda.cu
}
DeviceTraits current_cuda_device_traits() { return detail::current_device_traits_of_kernels(); }
#else
DeviceTraits current_cuda_device_traits() { return {}; }
#endif

int parse_capability(const std::string& text) {
  const bool shaped = (text.size() == 3 || text.size() == 4) && text[text.size() - 2] == '.' &&
                      text.find_first_not_of("0123456789.") == std::string::npos && text.find('.') == text.size() - 2;
  const int capability = shaped ? std::stoi(text.substr(0, text.size() - 2)) * 10 + (text.back() - '0') : 0;
  if (capability < 30 || capability > 159)
    throw UserError("compute capability \"" + text.substr(0, 16) + "\": write MAJOR.MINOR as NVIDIA lists it, e.g. 7.5 (T4) or 8.0 (A100)");
  return capability;
}

std::string capability_name(int capability) { return std::to_string(capability / 10) + "." + std::to_string(capability % 10); }

int capability_override() {
  const char* text = std::getenv("LOOM_DEVICE_CAPABILITY");
  if (text == nullptr || *text == '\0') return 0;
  try {
    return parse_capability(text);
  } catch (const UserError& e) {
    throw UserError(std::string("LOOM_DEVICE_CAPABILITY: ") + e.what() + "; or unset it");
  }
}

const NamedCard* named_cards(std::size_t& count) {
  // Multiprocessors and a block's opt-in shared memory, from NVIDIA's tuning guides.
  static const NamedCard cards[] = {
      {"V100", {70, 80, 98304}},     {"T4", {75, 40, 65536}},      {"A100", {80, 108, 166912}}, {"RTX 3090", {86, 82, 101376}},
      {"RTX 4090", {89, 128, 101376}}, {"L4", {89, 58, 101376}},   {"H100 SXM", {90, 132, 232448}}, {"H200", {90, 132, 232448}},
  };
  count = sizeof(cards) / sizeof(cards[0]);
  return cards;
}

const char* product_kernel_name(ProductKernel kernel) {
  switch (kernel) {
    case ProductKernel::kLibTorch: return "libtorch";
    case ProductKernel::kDenseLanes: return "dense-lanes";
    case ProductKernel::kDenseLanesOneLine: return "dense-lanes-one-line";
    case ProductKernel::kDenseStagedTiles: return "dense-staged-tiles";
    case ProductKernel::kCodeLanes: return "code-lanes";
    case ProductKernel::kCodeTilesBlocks: return "code-tiles-blocks";
    case ProductKernel::kCodeTilesRows: return "code-tiles-rows";
  }
  return "unknown";
}

bool product_kernel_takes(ProductKernel kernel, const ProductShape& s, const DeviceTraits& device) {
  if (kernel == ProductKernel::kLibTorch) return true;
  if (s.rows < 1 || s.rows > detail::kFewRowsMax || s.count < 1 || s.count > kMaxProductWeights) return false;
  const bool tensor_cores = device.capability >= 80 && s.sixteen_bit;  // mma.m16n8k16 and cp.async
  // A tile lane's element offsets are 32-bit.
  const bool small_codes = s.largest_codes <= std::numeric_limits<std::int32_t>::max();
  switch (kernel) {
    case ProductKernel::kDenseLanes: return !s.quantized;
    case ProductKernel::kDenseLanesOneLine: return !s.quantized && s.rows == 1 && !s.swiglu;
    case ProductKernel::kDenseStagedTiles:
      return !s.quantized && tensor_cores && s.rows >= 3 && device.shared_bytes_optin >= detail::kStagedTilesBlockBytes;
    case ProductKernel::kCodeLanes: return s.quantized;
    case ProductKernel::kCodeTilesBlocks: return s.quantized && tensor_cores && small_codes && s.rows <= 2;
    case ProductKernel::kCodeTilesRows:
      return s.quantized && tensor_cores && small_codes && s.rows >= 3 && s.in % detail::kCodesTileStep == 0 && s.smallest_block >= detail::kCodesTileStep;
    case ProductKernel::kLibTorch: break;
  }
  return false;
}

namespace {
std::atomic<int> pinned{-1};
}

void pin_product_kernel(std::optional<ProductKernel> kernel) { pinned.store(kernel ? static_cast<int>(*kernel) : -1); }

ProductKernel choose_product_kernel(const ProductShape& s, const DeviceTraits& device) {
  if (const int p = pinned.load(); p >= 0) {
    const auto kernel = static_cast<ProductKernel>(p);
    return product_kernel_takes(kernel, s, device) ? kernel : ProductKernel::kLibTorch;
  }
  if (s.rows < 1 || s.rows > detail::kFewRowsMax) return ProductKernel::kLibTorch;
  // One H200's 8B decode step (ms; lanes / tiles): bf16 1 row 4.58 / 4.90, 2 rows 4.94 / about 5.0,
  // 4 rows 5.85 / 5.10; 4-bit 1 row 3.81-3.84 / 3.36-3.39 (kBlocks, 3.27 with SwiGLU's offsets shared;
  // kRows took 3.91), 2 rows 4.09-4.17 / 3.67-3.72 (3.46), 4 rows 6.53 / 4.00: 4-bit tiles from one
  // row, dense tiles from three. At one row the dense lanes' own loads stream a line a warp faster
  // than a tile's 16 rows do. Dense tiles take 168 KB of shared memory: an H100's or H200's block, not
  // an A100's (163 KB) or a GeForce's (99 KB).
  const auto first_taking = [&](std::initializer_list<ProductKernel> order) {
    for (const auto k : order)
      if (product_kernel_takes(k, s, device)) return k;
    return ProductKernel::kLibTorch;
  };
  if (s.quantized) return first_taking({ProductKernel::kCodeTilesBlocks, ProductKernel::kCodeTilesRows, ProductKernel::kCodeLanes});
  if (product_kernel_takes(ProductKernel::kDenseStagedTiles, s, device)) return ProductKernel::kDenseStagedTiles;
  // At one row, pairs of lines in at most two blocks a multiprocessor (the 8B's o and down: 256
  // blocks on 132) leave each a few warps and stream at 2.0 to 2.4 TB/s (ncu, H200) where gate/up's
  // 1,792 blocks reach 3.5: such groups take one line a warp, twice the blocks (the 8B step 4.65 ->
  // 4.56 ms; at 4 rows 5.85 -> 5.92, so not there).
  std::int64_t pairs = 0;
  for (int i = 0; i < s.count && i < kMaxProductWeights; ++i) pairs += (s.out[i] + 1) / 2;
  const std::int64_t blocks = (pairs + detail::kProductWarps - 1) / detail::kProductWarps;
  if (product_kernel_takes(ProductKernel::kDenseLanesOneLine, s, device) && device.multiprocessors > 0 && blocks <= 2 * device.multiprocessors)
    return ProductKernel::kDenseLanesOneLine;
  return ProductKernel::kDenseLanes;
}

std::string cuda_architectures() {
#ifdef LOOM_CUDA_ARCHITECTURES
  return LOOM_CUDA_ARCHITECTURES;
#else
  return "";
#endif
}

}  // namespace loom::kit
