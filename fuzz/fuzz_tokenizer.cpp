// tokenizer.json, tokenizer_config.json and a text, separated by "\n=====\n": the hf-json
// plugin loads them, encodes the text with and without specials, and decodes what it gave.
#include "fuzz_support.hpp"
#include "loom/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto parts = fuzz::split(data, size, "\n=====\n", 3);
  const auto dir = fuzz::scratch();
  fuzz::write(dir / "tokenizer.json", parts[0]);
  if (!parts[1].empty()) fuzz::write(dir / "tokenizer_config.json", parts[1]);
  std::unique_ptr<Tokenizer> tokenizer;
  try {
    tokenizer = fuzz::plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  } catch (const UserError&) {
    return 0;
  }
  for (const auto specials : {Specials::kNone, Specials::kSample}) {
    try {
      const auto encoding = tokenizer->encode(parts[2], specials);
      tokenizer->decode(encoding.ids, false);
      tokenizer->decode(encoding.ids, true);
    } catch (const UserError&) {
    }
  }
  return 0;
}
