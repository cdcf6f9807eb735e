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

// Every tokenizer also takes the common options add_bos, add_eos, padding_side, pad_token
// (see common_options("tokenizer")).
class LOOM_API Tokenizer : public Plugin {
 public:
  ~Tokenizer() override;  // defined in the SDK library: one typeinfo for host and plugins
  // add_special: add BOS/EOS as the add_bos/add_eos options say. Invalid input throws UserError.
  virtual Encoding encode(std::string_view text, bool add_special) const = 0;
  virtual std::string decode(const std::vector<std::int64_t>& ids, bool skip_special) const = 0;
  virtual std::int64_t vocab_size() const = 0;
  virtual SpecialTokens special_tokens() const = 0;
  virtual bool pad_left() const = 0;
};

}  // namespace loom
