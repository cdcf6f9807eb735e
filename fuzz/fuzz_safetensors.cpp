// A safetensors file: the header parsed and every tensor it describes read.
#include <ATen/ATen.h>

#include "fuzz_support.hpp"
#include "loom/kit/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto dir = fuzz::scratch();
  fuzz::write(dir / "model.safetensors", std::string(reinterpret_cast<const char*>(data), size));
  try {
    const kit::SafetensorsFile file(dir / "model.safetensors");
    for (const auto& info : file.tensors()) (void)file.tensor(info.name).sum();
  } catch (const UserError&) {
  }
  return 0;
}
