#include "config/objective_data.hpp"

#include <algorithm>

#include "chat/chat_data.hpp"
#include "config/data.hpp"
#include "loom/error.hpp"

namespace loom::core {

namespace {

using Json = nlohmann::ordered_json;

// A text prompt's ids: with the tokenizer's BOS (its add_bos), never an EOS.
std::vector<std::int64_t> text_prompt_ids(const Tokenizer& tokenizer, const std::string& prompt) { return tokenizer.encode(prompt, Specials::kPrompt).ids; }

// A text completion's ids after its prompt: a whole sample's specials less its BOS (the text's own
// ids, then the EOS where add_eos says so).
std::vector<std::int64_t> text_completion_ids(const Tokenizer& tokenizer, const std::string& completion) {
  const auto bos = tokenizer.encode("", Specials::kPrompt).ids.size();
  std::vector<std::int64_t> ids = tokenizer.encode(completion, Specials::kSample).ids;
  ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(std::min(bos, ids.size())));
  return ids;
}

std::string content_of(const Json& message) {
  const auto it = message.find("content");
  return it != message.end() && it->is_string() ? it->get<std::string>() : "";
}

// A chat sample's prompt and the assistant message it ended with (the record's own answer), if any.
struct ChatPrompt {
  Conversation prompt;
  Json answer;  // a list of one message, or null
};

ChatPrompt chat_prompt(const SampleWithRecord& sample) {
  ChatPrompt out{conversation_from_sample(sample.prompt), Json()};
  auto& messages = out.prompt.messages;
  if (!messages.empty() && messages.back().value("role", "") == "assistant") {
    out.answer = Json::array({messages.back()});
    messages.erase(messages.end() - 1);
  }
  if (messages.empty()) throw UserError("the conversation has no message before its answer: nothing to prompt with");
  return out;
}

// The assistant messages of `field`: text (or a number) as the assistant's content, one message,
// or a list of them less the prompt's messages where it starts with them (TRL's conversational
// pairs often repeat the prompt in each completion). Where the record has no such field, the
// conversation's own answer when `own_answer` allows it.
Json answer_messages(const ChatPrompt& chat, const Json& record, const std::string& field, bool own_answer) {
  const auto it = record.find(field);
  if (it == record.end()) {
    if (own_answer && !chat.answer.is_null()) return chat.answer;
    throw UserError("the record has no field '" + field + "'");
  }
  if (it->is_string() || it->is_number() || it->is_boolean())
    return Json::array({Json{{"role", "assistant"}, {"content", it->is_string() ? it->get<std::string>() : it->dump()}}});
  Json messages = it->is_object() ? Json::array({*it}) : *it;
  if (!messages.is_array() || messages.empty())
    throw UserError("field '" + field + "' is " + std::string(it->type_name()) + "; expected the answer's text, a message or a list of messages");
  for (std::size_t k = 0; k < messages.size(); ++k)
    if (!messages[k].is_object() || !messages[k].contains("role") || !messages[k]["role"].is_string())
      throw UserError("field '" + field + "': message " + std::to_string(k + 1) + " is not a {\"role\", \"content\"} object");
  const auto& prompt = chat.prompt.messages;
  if (messages.size() >= prompt.size() && std::equal(prompt.begin(), prompt.end(), messages.begin(), same_message))
    messages.erase(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(prompt.size()));
  if (messages.empty() || messages.back().value("role", "") != "assistant")
    throw UserError("field '" + field + "' holds no assistant message " + (messages.empty() ? "after the prompt it repeats" : "at its end") +
                    ": the answer is the assistant's");
  return messages;
}

}  // namespace

std::string ObjectiveSamples::prompt_text(const SampleWithRecord& sample) const {
  return chat_ ? chat_->render(chat_prompt(sample).prompt, true) : sample.prompt;
}

std::vector<std::int64_t> ObjectiveSamples::prompt_ids(const SampleWithRecord& sample, const Tokenizer& tokenizer) const {
  return chat_ ? tokenizer.encode(prompt_text(sample), Specials::kNone).ids : text_prompt_ids(tokenizer, sample.prompt);
}

ObjectiveSamples::Ids ObjectiveSamples::ids(const SampleWithRecord& sample, const std::vector<std::string>& fields, const Tokenizer& tokenizer,
                                            bool own_answer) const {
  Ids out;
  if (!chat_) {
    out.prompt = text_prompt_ids(tokenizer, sample.prompt);
    for (const auto& field : fields) out.answers.push_back(text_completion_ids(tokenizer, record_text(sample.record, field)));
    return out;
  }
  const ChatPrompt chat = chat_prompt(sample);
  const std::string prompt = chat_->render(chat.prompt, true);
  out.prompt = tokenizer.encode(prompt, Specials::kNone).ids;
  // A template that ends no turn (a plain base-model one) leaves the answer's end to the EOS, where
  // the tokenizer adds one, as a text format does.
  const bool ends_turns = !turn_end_marker(*chat_, chat.prompt).empty();
  for (const auto& field : fields) {
    Conversation whole = chat.prompt;
    for (const auto& m : answer_messages(chat, sample.record, field, own_answer)) whole.messages.push_back(m);
    const std::string text = chat_->render(whole, false);
    if (text.compare(0, prompt.size(), prompt) != 0)
      throw UserError("chat template '" + chat_->name() + "' writes the prompt differently when the answer in '" + field +
                      "' follows it than with its generation prompt, so the answer's tokens cannot be told from the prompt's");
    const std::string answer = text.substr(prompt.size());
    out.answers.push_back(ends_turns ? tokenizer.encode(answer, Specials::kNone).ids : text_completion_ids(tokenizer, answer));
  }
  return out;
}

std::vector<std::int64_t> ObjectiveSamples::answer_ids(const SampleWithRecord& sample, const std::string& field, const Tokenizer& tokenizer,
                                                       bool own_answer) const {
  return ids(sample, {field}, tokenizer, own_answer).answers.front();
}

std::optional<std::string> ObjectiveSamples::reference(const SampleWithRecord& sample, const std::string& field) const {
  const auto it = sample.record.find(field);
  if (it != sample.record.end() && (it->is_string() || it->is_number())) return it->is_string() ? it->get<std::string>() : it->dump();
  if (!chat_) return std::nullopt;
  try {
    const Json messages = answer_messages(chat_prompt(sample), sample.record, field, true);
    const std::string content = content_of(messages.back());
    if (!content.empty()) return content;
  } catch (const UserError&) {
  }
  return std::nullopt;
}

std::string ObjectiveSamples::end_of_turn(const SampleWithRecord& sample) const {
  return chat_ ? turn_end_marker(*chat_, chat_prompt(sample).prompt) : "";
}

kit::LabeledRow completion_row(const std::vector<std::int64_t>& prompt, const std::vector<std::int64_t>& completion) {
  kit::LabeledRow row;
  row.ids = prompt;
  row.ids.insert(row.ids.end(), completion.begin(), completion.end());
  row.labels.assign(prompt.size(), kIgnoreLabel);
  row.labels.insert(row.labels.end(), completion.begin(), completion.end());
  return row;
}

std::string record_text(const nlohmann::ordered_json& record, const std::string& field) {
  const auto it = record.find(field);
  if (it == record.end()) throw UserError("the record has no field '" + field + "'");
  if (it->is_string()) return it->get<std::string>();
  if (it->is_number() || it->is_boolean()) return it->dump();
  throw UserError("field '" + field + "' is " + it->type_name() + "; expected a string (or a number)");
}

namespace {

// Cuts a row to `length` tokens from its right end or its left start.
void cut(kit::LabeledRow& row, std::size_t length, bool left) {
  if (row.ids.size() <= length) return;
  const auto drop = static_cast<std::ptrdiff_t>(row.ids.size() - length);
  if (left) {
    row.ids.erase(row.ids.begin(), row.ids.begin() + drop);
    row.labels.erase(row.labels.begin(), row.labels.begin() + drop);
  } else {
    row.ids.resize(length);
    row.labels.resize(length);
  }
}

bool labels_any(const kit::LabeledRow& row) {
  return std::any_of(row.labels.begin(), row.labels.end(), [](std::int64_t l) { return l != kIgnoreLabel; });
}

}  // namespace

PairBatch collate_pairs(const std::vector<std::string>& samples, const ObjectiveNeeds& needs, const ObjectiveSamples& read,
                        const Tokenizer& tokenizer, const CollateSettings& settings) {
  const auto pad = tokenizer.special_tokens().pad;
  if (!pad) throw UserError("the tokenizer has no padding token; set [tokenizer] pad_token (e.g. \"eos\")");
  std::vector<kit::LabeledRow> chosen, rejected;
  std::int64_t skipped = 0;
  const auto length = static_cast<std::size_t>(settings.max_length);
  for (const auto& sample : samples) {
    const auto read_ids = read.ids(split_sample(sample), {needs.chosen_field, needs.rejected_field}, tokenizer);
    kit::LabeledRow c = completion_row(read_ids.prompt, read_ids.answers[0]);
    kit::LabeledRow r = completion_row(read_ids.prompt, read_ids.answers[1]);
    if (c.ids.size() > length || r.ids.size() > length) {
      if (settings.truncation == Truncation::kDrop) {
        ++skipped;
        continue;
      }
      if (settings.truncation == Truncation::kLeft) {
        // The same prompt tokens off both rows, so both completions follow the same context.
        const std::size_t excess = std::max(c.ids.size(), r.ids.size()) - length;
        for (auto* row : {&c, &r}) cut(*row, row->ids.size() > excess ? row->ids.size() - excess : 0, true);
      } else {
        cut(c, length, false);
        cut(r, length, false);
      }
    }
    if (!labels_any(c) || !labels_any(r)) {
      ++skipped;
      continue;
    }
    chosen.push_back(std::move(c));
    rejected.push_back(std::move(r));
  }
  PairBatch out;
  out.pairs = static_cast<std::int64_t>(chosen.size());
  for (auto& r : rejected) chosen.push_back(std::move(r));
  out.batch = kit::pad_rows(std::move(chosen), settings, *pad, tokenizer.pad_left(), skipped);
  return out;
}

const std::string& AnswerCollator::answer_field() const { return needs_.answer_field.empty() ? needs_.chosen_field : needs_.answer_field; }

Batch AnswerCollator::collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer, const CollateSettings& settings) const {
  const auto pad = tokenizer.special_tokens().pad;
  if (!pad) throw UserError("the tokenizer has no padding token; set [tokenizer] pad_token (e.g. \"eos\")");
  std::vector<kit::LabeledRow> rows;
  for (const auto& sample : samples) {
    const auto read_ids = read_.ids(split_sample(sample), {answer_field()}, tokenizer, true);
    rows.push_back(completion_row(read_ids.prompt, read_ids.answers.front()));
  }
  return kit::pad_rows(std::move(rows), settings, *pad, tokenizer.pad_left());
}

std::optional<PromptSplit> AnswerCollator::split_for_generation(const std::string& sample) const {
  const SampleWithRecord s = split_sample(sample);
  auto reference = read_.reference(s, answer_field());
  if (!reference) return std::nullopt;
  return PromptSplit{read_.prompt_text(s), std::move(*reference)};
}

std::string AnswerCollator::end_of_turn(const std::string& sample) const { return read_.end_of_turn(split_sample(sample)); }

}  // namespace loom::core
