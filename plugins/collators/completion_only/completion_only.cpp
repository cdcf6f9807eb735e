// Collator plugin `completion-only`: trains on the responses only. The response template is found
// in the sample as it is tokenized in context (by the tokens' byte offsets, or by an id sequence
// the user gives), never by tokenizing the template alone: in context a tokenizer may split it
// differently, which is how TRL's collator silently masks everything.
#include <algorithm>

#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/kit/collate.hpp"
#include "loom/plugin.hpp"

namespace loom::completion_only {
namespace {

std::vector<OptionSpec> options() {
  return {
      OptionSpec::any_of("response_template", kString | kIntList, std::nullopt,
                         "text (or in-context token ids) after which the answer starts; labels begin after it")
          .require(),
      OptionSpec::any_of("instruction_template", kString | kIntList, std::nullopt,
                         "text (or token ids) that starts a user turn; with it, every response of a multi-turn sample is trained"),
      OptionSpec::string("on_missing_template", "skip", "a sample without the response template: \"skip\" it (counted) or stop with an \"error\"")
          .one_of({"skip", "error"}),
  };
}

// Each match of `tmpl` in the sample, as [first token, token after it): by byte offsets for text,
// by id search for ids. A token straddling the template's end belongs to the template; an EOS at
// the end of the text starts there and is after it.
std::vector<std::pair<std::size_t, std::size_t>> template_matches(const OptionValue& tmpl, const std::string& text, const Encoding& enc) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  if (const auto* s = std::get_if<std::string>(&tmpl)) {
    for (std::size_t pos = text.find(*s); pos != std::string::npos; pos = text.find(*s, pos + 1)) {
      std::size_t first = 0;
      while (first < enc.ids.size() && enc.offsets[first].second <= pos) ++first;
      std::size_t after = 0;
      while (after < enc.ids.size() && enc.offsets[after].first < pos + s->size()) ++after;
      out.emplace_back(first, after);
    }
    return out;
  }
  const auto& ids = std::get<IntList>(tmpl);
  for (std::size_t i = 0; !ids.empty() && i + ids.size() <= enc.ids.size(); ++i)
    if (std::equal(ids.begin(), ids.end(), enc.ids.begin() + static_cast<std::ptrdiff_t>(i))) out.emplace_back(i, i + ids.size());
  return out;
}

class CompletionOnly final : public Collator {
 public:
  CompletionOnly(OptionValue response, std::optional<OptionValue> instruction, bool skip_missing)
      : response_(std::move(response)), instruction_(std::move(instruction)), skip_missing_(skip_missing) {
    if (const auto* s = std::get_if<std::string>(&response_); s && s->empty()) throw UserError("response_template is empty");
    if (const auto* l = std::get_if<IntList>(&response_); l && l->empty()) throw UserError("response_template is an empty id list");
    for_each_template_id([](const char* name, std::int64_t id) {
      if (id < 0) throw UserError(std::string(name) + ": " + std::to_string(id) + " is not a token id (ids are 0 or more)");
    });
  }

  // Calls f(option name, id) for every id of a template given as token ids.
  template <class F>
  void for_each_template_id(F f) const {
    for (const auto& [name, tmpl] : {std::pair{"response_template", &response_}, std::pair{"instruction_template", instruction_ ? &*instruction_ : nullptr}})
      if (const auto* ids = tmpl ? std::get_if<IntList>(tmpl) : nullptr)
        for (const auto id : *ids) f(name, id);
  }

  Batch collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer, const CollateSettings& settings) const override {
    const auto pad = tokenizer.special_tokens().pad;
    if (!pad) throw UserError("the tokenizer has no padding token; set [tokenizer] pad_token (e.g. \"eos\")");
    for_each_template_id([&](const char* name, std::int64_t id) {
      if (id >= tokenizer.vocab_size())
        throw UserError(std::string(name) + ": " + std::to_string(id) + " is not a token id of this tokenizer (0.." +
                        std::to_string(tokenizer.vocab_size() - 1) + ")");
    });
    std::vector<kit::LabeledRow> rows;
    std::int64_t skipped = 0;
    for (std::size_t n = 0; n < samples.size(); ++n) {
      const std::string& text = samples[n];
      Encoding enc = tokenizer.encode(text, Specials::kSample);
      std::vector<std::int64_t> labels = mask(text, enc);
      const bool found = std::any_of(labels.begin(), labels.end(), [](std::int64_t l) { return l != kIgnoreLabel; });
      if (!found) {
        if (!skip_missing_) throw UserError("a sample has no response template " + describe(response_) + " (or nothing after it): \"" + excerpt(text) + "\"");
        ++skipped;
        continue;
      }
      rows.push_back({std::move(enc.ids), std::move(labels)});
    }
    return kit::pad_rows(std::move(rows), settings, *pad, tokenizer.pad_left(), skipped);
  }

  std::optional<PromptSplit> split_for_generation(const std::string& sample) const override {
    const auto* tmpl = std::get_if<std::string>(&response_);
    if (tmpl == nullptr) return std::nullopt;  // id templates have no text position
    const auto pos = sample.rfind(*tmpl);
    if (pos == std::string::npos) return std::nullopt;
    const auto end = pos + tmpl->size();
    return PromptSplit{sample.substr(0, end), sample.substr(end)};
  }

 private:
  // Labels: the ids inside responses, kIgnoreLabel elsewhere. A response runs from the end of a
  // response template to the start of the next instruction template (or the end).
  std::vector<std::int64_t> mask(const std::string& text, const Encoding& enc) const {
    std::vector<std::int64_t> labels(enc.ids.size(), kIgnoreLabel);
    const auto responses = template_matches(response_, text, enc);
    if (responses.empty()) return labels;
    if (!instruction_) {
      for (std::size_t i = responses.front().second; i < enc.ids.size(); ++i) labels[i] = enc.ids[i];
      return labels;
    }
    const auto instructions = template_matches(*instruction_, text, enc);
    for (const auto& response : responses) {
      const std::size_t start = response.second;
      std::size_t stop = enc.ids.size();
      for (const auto& instruction : instructions)
        if (instruction.first >= start) {
          stop = instruction.first;
          break;
        }
      for (std::size_t i = start; i < stop; ++i) labels[i] = enc.ids[i];
    }
    return labels;
  }

  static std::string describe(const OptionValue& v) { return format_option_value(v); }
  static std::string excerpt(const std::string& text) { return text.size() <= 60 ? text : text.substr(0, 57) + "..."; }

  OptionValue response_;
  std::optional<OptionValue> instruction_;
  bool skip_missing_;
};

std::unique_ptr<Plugin> create(const Options& o) {
  std::optional<OptionValue> instruction;
  if (o.has("instruction_template")) instruction = o.get("instruction_template");
  return std::make_unique<CompletionOnly>(o.get("response_template"), instruction, o.get_string("on_missing_template") == "skip");
}

}  // namespace
}  // namespace loom::completion_only

LOOM_PLUGIN(loom::kKindCollator, "completion-only", "0.1.0", "labels only the responses, found by the template in context",
            loom::completion_only::options, loom::completion_only::create)
