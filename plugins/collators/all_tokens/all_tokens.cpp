// Collator plugin `all-tokens`: the loss on every token of each sample, as a causal language model
// is pretrained: continued pretraining on plain text, or instruction data trained on its inputs
// too (axolotl's train_on_inputs, TRL's SFT without a completion mask). With `response_template`
// it still knows where an answer starts, for evaluation's exact-match, without masking anything.
#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/kit/collate.hpp"
#include "loom/plugin.hpp"

namespace loom::all_tokens {
namespace {

std::vector<OptionSpec> options() {
  return {OptionSpec::string("response_template", std::nullopt,
                             "text after which an answer starts, for evaluation's exact-match only (every token is trained either way)")};
}

class AllTokens final : public Collator {
 public:
  explicit AllTokens(std::optional<std::string> response) : response_(std::move(response)) {
    if (response_ && response_->empty()) throw UserError("response_template is empty; leave it out to train on every token without exact-match");
  }

  Batch collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer, const CollateSettings& settings) const override {
    const auto pad = tokenizer.special_tokens().pad;
    if (!pad) throw UserError("the tokenizer has no padding token; set [tokenizer] pad_token (e.g. \"eos\")");
    std::vector<kit::LabeledRow> rows;
    rows.reserve(samples.size());
    for (const auto& text : samples) {
      Encoding enc = tokenizer.encode(text, Specials::kSample);
      std::vector<std::int64_t> labels = enc.ids;
      rows.push_back({std::move(enc.ids), std::move(labels)});
    }
    return kit::pad_rows(std::move(rows), settings, *pad, tokenizer.pad_left());
  }

  std::optional<PromptSplit> split_for_generation(const std::string& sample) const override {
    if (!response_) return std::nullopt;
    const auto pos = sample.rfind(*response_);
    if (pos == std::string::npos) return std::nullopt;
    const auto end = pos + response_->size();
    return PromptSplit{sample.substr(0, end), sample.substr(end)};
  }

 private:
  std::optional<std::string> response_;
};

std::unique_ptr<Plugin> create(const Options& o) {
  return std::make_unique<AllTokens>(o.has("response_template") ? std::optional<std::string>(o.get_string("response_template")) : std::nullopt);
}

}  // namespace
}  // namespace loom::all_tokens

LOOM_PLUGIN(loom::kKindCollator, "all-tokens", "0.1.0", "labels every token: continued pretraining, or training on the inputs too",
            loom::all_tokens::options, loom::all_tokens::create)
