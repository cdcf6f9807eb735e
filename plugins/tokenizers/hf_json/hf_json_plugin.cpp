// Tokenizer plugin `hf-json`: Hugging Face tokenizer.json files (BPE: byte-level as in GPT-2,
// Llama 3 and Qwen; SentencePiece-style with byte fallback as in Llama 2, Mistral and Gemma),
// giving the ids the `tokenizers` library gives.
#include "hf_tokenizer.hpp"
#include "loom/error.hpp"
#include "loom/kit/hub_cache.hpp"
#include "loom/plugin.hpp"
#include "loom/tokenizer.hpp"

namespace loom::hf {
namespace {

std::vector<OptionSpec> options() {
  return {OptionSpec::string("path", std::nullopt,
                             "a Hugging Face model folder holding tokenizer.json (and tokenizer_config.json), the tokenizer.json file, or a hub id "
                             "(\"org/name\") found in the local Hugging Face cache")
              .require()
              .path(),
          OptionSpec::string("revision", "", "a hub id's branch, tag or commit in the cache (\"\": main)")};
}

class HfJsonTokenizer final : public Tokenizer, public ChatTemplateSource {
 public:
  explicit HfJsonTokenizer(const Options& o)
      : tok_(kit::model_folder(o.get_string("path"), o.has("revision") ? o.get_string("revision") : "", "[tokenizer] path").string()),
        add_bos_(o.get_bool("add_bos")),
        add_eos_(o.get_bool("add_eos")),
        pad_left_(o.get_string("padding_side") == "left") {
    const auto& pad = o.get("pad_token");
    if (const auto* id = std::get_if<std::int64_t>(&pad)) {
      if (*id < 0 || *id >= tok_.vocab_size())
        throw UserError("pad_token = " + std::to_string(*id) + " is not a token id of this tokenizer (0.." + std::to_string(tok_.vocab_size() - 1) + ")");
      pad_ = *id;
    } else {
      const auto& name = std::get<std::string>(pad);
      if (name == "pad") pad_ = tok_.pad;
      else if (name == "eos") pad_ = tok_.eos;
      else if (name == "bos") pad_ = bos();
      else throw UserError("pad_token = \"" + name + "\": use \"pad\", \"eos\", \"bos\" or a token id");
      // No pad token under the default "pad" is fine until something pads (the collator says so then).
      if (!pad_ && name != "pad")
        throw UserError("pad_token = \"" + name + "\": " + o.get_string("path") + " names no " + name +
                        " token (tokenizer_config.json); use pad_token = \"eos\" or a token id");
    }
  }

  // kPrompt is what HF's encode(text) gives: the post-processor's special tokens around the text.
  // kSample also ends with EOS, so a fine-tuned model learns where an answer stops.
  Encoding encode(std::string_view text, Specials specials) const override {
    std::vector<std::int64_t> prefix, suffix;
    if (specials != Specials::kNone) {
      if (add_bos_) prefix = tok_.template_prefix();
      if (add_eos_) suffix = tok_.template_suffix();
    }
    if (specials == Specials::kSample && add_eos_ && (suffix.empty() || suffix.back() != tok_.eos)) {
      if (!tok_.eos) throw UserError("add_eos = true, but the tokenizer names no eos_token (tokenizer_config.json); set add_eos = false");
      suffix.push_back(*tok_.eos);
    }
    auto e = tok_.encode(text, prefix, suffix);
    return Encoding{std::move(e.ids), std::move(e.offsets)};
  }

  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special) const override { return tok_.decode(ids, skip_special); }
  std::int64_t vocab_size() const override { return tok_.vocab_size(); }
  SpecialTokens special_tokens() const override { return {bos(), tok_.eos, pad_, tok_.unk}; }
  bool pad_left() const override { return pad_left_; }

  std::vector<std::string> chat_template_names() const override {
    std::vector<std::string> names;
    for (const auto& [name, source] : tok_.chat_templates) names.push_back(name);
    return names;
  }
  std::string chat_template(const std::string& name) const override {
    for (const auto& [n, source] : tok_.chat_templates)
      if (n == name) return source;
    std::string known;
    for (const auto& [n, source] : tok_.chat_templates) known += (known.empty() ? "" : ", ") + n;
    throw UserError("the tokenizer carries no chat template named \"" + name + "\"" +
                    (known.empty() ? std::string(" (it carries none: give [data] chat_template a template file)") : " (it carries: " + known + ")"));
  }
  std::string chat_template_variables() const override { return tok_.chat_template_variables; }

 private:
  std::optional<std::int64_t> bos() const {
    if (tok_.bos) return tok_.bos;
    if (tok_.template_prefix().size() == 1) return tok_.template_prefix().front();
    return std::nullopt;
  }

  HfTokenizer tok_;
  bool add_bos_, add_eos_, pad_left_;
  std::optional<std::int64_t> pad_;
};

std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<HfJsonTokenizer>(o); }

}  // namespace
}  // namespace loom::hf

LOOM_PLUGIN(loom::kKindTokenizer, "hf-json", "0.1.0", "Hugging Face tokenizer.json (BPE: byte-level and SentencePiece-style), ids as HF tokenizers gives",
            loom::hf::options, loom::hf::create)
