#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/capability.hpp"
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

// Capability of a Tokenizer that carries its model's chat templates (SDK 3.1; Hugging Face keeps
// them in tokenizer_config.json or chat_template.jinja). The host renders conversations with them
// ([data] format = "messages", `loom generate --chat`) as transformers' apply_chat_template does.
class LOOM_API ChatTemplateSource : public Capability {
 public:
  ~ChatTemplateSource() override;
  // The names of the templates it carries, the default one first ("default" when unnamed); empty
  // when it carries none.
  virtual std::vector<std::string> chat_template_names() const = 0;
  // The Jinja source of template `name`; UserError when it carries none of that name.
  virtual std::string chat_template(const std::string& name) const = 0;
  // What a template sees besides the conversation, as a JSON object: the special tokens as text
  // (bos_token, eos_token, unk_token, pad_token, ..., additional_special_tokens).
  virtual std::string chat_template_variables() const = 0;
};

}  // namespace loom
