// A 4-bit weight in bitsandbytes' layout as loading reads it: the input's first part is the
// quant_state JSON, the second the name's type ("nf4" or "fp4"); codes and scales sized for the
// [8, 64] weight the state should describe follow, then the weight is finished and dequantized.
#include <cstring>

#include <ATen/ATen.h>

#include "fuzz_support.hpp"
#include "loom/kit/quantize.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto parts = fuzz::split(data, size, "\n=====\n", 2);
  try {
    kit::QuantizedWeight w(64, 8, kit::QuantType::kNF4, 64, false, at::TensorOptions().dtype(at::kFloat), at::kFloat);
    const std::string& state = parts[0];
    const at::Tensor bytes = at::empty({static_cast<std::int64_t>(state.size())}, at::kByte);
    if (!state.empty()) std::memcpy(bytes.data_ptr(), state.data(), state.size());  // an empty tensor's data pointer may be null
    w.assign("weight.quant_state.bitsandbytes__" + parts[1], bytes);
    const std::int64_t blocksize = w.quantized().blocksize, blocks = (8 * 64 + blocksize - 1) / blocksize;
    w.assign("weight", at::zeros({8 * 64 / 2}, at::kByte));
    w.assign("weight.absmax", at::ones({blocks}));
    w.finish_load("w");
    (void)w.dense().sum();
  } catch (const UserError&) {
  }
  return 0;
}
