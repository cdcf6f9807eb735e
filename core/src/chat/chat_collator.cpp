#include "chat/chat_collator.hpp"

#include "chat/chat_data.hpp"
#include "loom/error.hpp"

namespace loom::core {

std::vector<bool> tokens_in_spans(const std::vector<std::pair<std::size_t, std::size_t>>& offsets,
                                  const std::vector<std::pair<std::size_t, std::size_t>>& spans) {
  std::vector<bool> in(offsets.size(), false);
  // The token holding byte `at`, or the first one after it (a byte no token covers, e.g. a space a
  // normalizer folded into the next token).
  const auto token_at = [&](std::size_t at) -> std::optional<std::size_t> {
    for (std::size_t i = 0; i < offsets.size(); ++i)
      if (offsets[i].second > offsets[i].first && offsets[i].second > at) return i;
    return std::nullopt;
  };
  for (const auto& [begin, end] : spans) {
    if (end <= begin) continue;
    const auto first = token_at(begin);
    if (!first) break;  // past the text
    std::size_t last = *first;
    for (std::size_t i = *first; i < offsets.size() && offsets[i].first < end; ++i) last = i;
    for (std::size_t i = *first; i <= last; ++i) in[i] = true;
  }
  return in;
}

kit::LabeledRow ChatCollator::label(const std::string& sample, const Tokenizer& tokenizer) const {
  const RenderedChat rendered = chat_.render_for_training(conversation_from_sample(sample));
  Encoding enc = tokenizer.encode(rendered.text, Specials::kNone);
  const auto marked = tokens_in_spans(enc.offsets, rendered.assistant_spans);
  kit::LabeledRow row{std::move(enc.ids), {}};
  row.labels.resize(row.ids.size(), kIgnoreLabel);
  for (std::size_t i = 0; i < row.ids.size(); ++i)
    if (marked[i]) row.labels[i] = row.ids[i];
  return row;
}

Batch ChatCollator::collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer, const CollateSettings& settings) const {
  const auto pad = tokenizer.special_tokens().pad;
  if (!pad) throw UserError("the tokenizer has no padding token; set [tokenizer] pad_token (e.g. \"eos\")");
  std::vector<kit::LabeledRow> rows;
  for (const auto& s : samples) rows.push_back(label(s, tokenizer));
  return kit::pad_rows(std::move(rows), settings, *pad, tokenizer.pad_left());
}

namespace {

// The index of the conversation's last assistant message.
std::size_t last_assistant(const Conversation& c) {
  for (std::size_t k = c.messages.size(); k-- > 0;)
    if (c.messages[k].value("role", "") == "assistant") return k;
  throw UserError("the conversation has no assistant message");
}

std::string content_text(const nlohmann::ordered_json& message) {
  const auto it = message.find("content");
  return it != message.end() && it->is_string() ? it->get<std::string>() : "";
}

}  // namespace

std::optional<PromptSplit> ChatCollator::split_for_generation(const std::string& sample) const {
  Conversation c = conversation_from_sample(sample);
  const std::size_t k = last_assistant(c);
  const std::string reference = content_text(c.messages[k]);
  if (reference.empty()) return std::nullopt;  // a tool call, or nothing to compare
  c.messages.erase(c.messages.begin() + static_cast<std::ptrdiff_t>(k), c.messages.end());
  return PromptSplit{chat_.render(c, true), reference};
}

namespace {

// The marker in what a template writes after an assistant's content: its text without the
// whitespace a template writes around it.
std::string marker_after(const std::string& turn, const std::string& content) {
  const auto at = turn.find(content);
  if (at == std::string::npos) return "";
  const std::string tail = turn.substr(at + content.size());
  const auto first = tail.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  return tail.substr(first, tail.find_last_not_of(" \t\r\n") + 1 - first);
}

}  // namespace

std::string ChatCollator::end_of_turn(const std::string& sample) const {
  const Conversation c = conversation_from_sample(sample);
  const RenderedChat rendered = chat_.render_for_training(c);
  const std::string content = content_text(c.messages[last_assistant(c)]);
  if (rendered.assistant_spans.empty() || content.empty()) return "";
  const auto [begin, end] = rendered.assistant_spans.back();
  return marker_after(rendered.text.substr(begin, end - begin), content);
}

std::string turn_end_marker(const ChatTemplate& chat, const Conversation& prompt) {
  // What the template adds to the prompt (rendered with its generation prompt) when a short reply
  // follows it; only the prompt's rendering is compared, so a template that writes earlier turns
  // otherwise once later ones follow still gives its marker.
  try {
    Conversation answered = prompt;
    answered.messages.push_back({{"role", "assistant"}, {"content", "OK"}});
    const std::string asked = chat.render(prompt, true), whole = chat.render(answered, false);
    if (whole.compare(0, asked.size(), asked) != 0) return "";
    return marker_after(whole.substr(asked.size()), "OK");
  } catch (const UserError&) {
    return "";  // a template that refuses the reply: answers end at the EOS alone
  }
}

}  // namespace loom::core
