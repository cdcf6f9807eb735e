// A model's config.json, read by the llama plugin and turned into its block structure.
#include "fuzz_support.hpp"
#include "loom/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto dir = fuzz::scratch();
  fuzz::write(dir / "config.json", std::string(reinterpret_cast<const char*>(data), size));
  try {
    fuzz::plugin<Model>("model", "llama", {{"path", dir.string()}, {"init", std::string("random")}})->structure();
  } catch (const UserError&) {
  }
  return 0;
}
