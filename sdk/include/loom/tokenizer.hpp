#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/export.hpp"
#include "loom/plugin.hpp"

namespace loom {

struct SpecialTokens {
  std::optional<std::int64_t> bos;
  std::optional<std::int64_t> eos;
  std::optional<std::int64_t> pad;  // resolved from the `pad_token` option
  std::optional<std::int64_t> unk;
};

// Token ids and, for each, the byte span of the input text it came from. Added special tokens
// have an empty span at their position. Collators use the spans to find templates in context.
struct Encoding {
  std::vector<std::int64_t> ids;
  std::vector<std::pair<std::size_t, std::size_t>> offsets;
};

// Which special tokens encode() adds, as the add_bos / add_eos options configure them.
enum class Specials {
  kNone,    // the text alone
  kSample,  // BOS and EOS: a whole training sample
  kPrompt,  // BOS only: a prompt the model continues
};

// Every tokenizer also takes the common options add_bos, add_eos, padding_side, pad_token
// (see common_options("tokenizer")).
class LOOM_API Tokenizer : public Plugin {
 public:
  ~Tokenizer() override;  // defined in the SDK library: one typeinfo for host and plugins
  // Invalid input (e.g. text the vocabulary cannot represent) throws UserError.
  virtual Encoding encode(std::string_view text, Specials specials) const = 0;
  virtual std::string decode(const std::vector<std::int64_t>& ids, bool skip_special) const = 0;
  virtual std::int64_t vocab_size() const = 0;
  virtual SpecialTokens special_tokens() const = 0;
  virtual bool pad_left() const = 0;
};

}  // namespace loom
