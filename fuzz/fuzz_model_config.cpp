// A model's config.json, read by each built-in model family (each refuses another's model_type in
// one error) and turned into its block structure.
#include "fuzz_support.hpp"
#include "loom/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto dir = fuzz::scratch();
  fuzz::write(dir / "config.json", std::string(reinterpret_cast<const char*>(data), size));
  for (const char* family : {"llama", "qwen3", "gemma3", "olmo2", "phi3", "mixtral", "qwen3_moe"}) {
    try {
      fuzz::plugin<Model>("model", family, {{"path", dir.string()}, {"init", std::string("random")}})->structure();
    } catch (const UserError&) {
    }
  }
  return 0;
}
