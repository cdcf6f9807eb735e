#pragma once
// The rows of the objectives that read more than a rendered text (loom/objective.hpp): a
// preference pair's two rows, a sampled completion's row, and evaluation's collator for them
// (the prompt, then the record's answer field labelled).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/chat_collator.hpp"
#include "chat/chat_template.hpp"
#include "config/data.hpp"
#include "loom/collator.hpp"
#include "loom/kit/collate.hpp"
#include "loom/objective.hpp"
#include "loom/tokenizer.hpp"

namespace loom::core {

// How a preference or sampling objective reads its samples (a prompt with its record,
// config/data.hpp's sample_with_record). Under a text [data] format the prompt is the rendered
// text, read with the tokenizer's BOS (never an EOS), and an answer field's text follows it alone,
// with the EOS where the tokenizer adds one. Under a chat format the prompt is the record's
// conversation, less its last message where that is the assistant's (the answer, where the record
// has no answer field), rendered by the chat template with its generation prompt; an answer
// (text, a message, or a list of messages ending with the assistant's, less the prompt's where the
// list repeats them) is what the template writes after that prompt when the answer follows it, its
// end of turn included, as TRL's apply_chat_template splits a prompt from its completion (a
// template that ends no turn: then the EOS where the tokenizer adds one). Prompt and answer are
// tokenized apart, as TRL does.
class ObjectiveSamples {
 public:
  ObjectiveSamples() = default;  // a text [data] format
  explicit ObjectiveSamples(std::shared_ptr<const ChatTemplate> chat) : chat_(std::move(chat)) {}

  // Whether prompts are rendered by a chat template (generation encodes them without specials).
  bool templated() const { return chat_ != nullptr; }
  // The prompt as generation reads it.
  std::string prompt_text(const SampleWithRecord& sample) const;
  std::vector<std::int64_t> prompt_ids(const SampleWithRecord& sample, const Tokenizer& tokenizer) const;
  // The prompt's ids and the answer in each of `fields` as the tokens after it, the sample read
  // and its prompt rendered once (a chat format: with `own_answer`, the conversation's own last
  // answer where the record has no such field, as held-out SFT-form conversations give it; never
  // for a pair's completions); UserError when an answer is missing.
  struct Ids {
    std::vector<std::int64_t> prompt;
    std::vector<std::vector<std::int64_t>> answers;  // one per field
  };
  Ids ids(const SampleWithRecord& sample, const std::vector<std::string>& fields, const Tokenizer& tokenizer, bool own_answer = false) const;
  // One answer's ids, as ids() gives them.
  std::vector<std::int64_t> answer_ids(const SampleWithRecord& sample, const std::string& field, const Tokenizer& tokenizer,
                                       bool own_answer = false) const;
  // The answer's text an exact-match compares with (a chat format: its last message's content);
  // nullopt when the record has none to compare.
  std::optional<std::string> reference(const SampleWithRecord& sample, const std::string& field) const;
  // Where a generated answer stops: the chat template's end of an assistant turn ("" for text
  // formats, or a template that shows none).
  std::string end_of_turn(const SampleWithRecord& sample) const;

 private:
  std::shared_ptr<const ChatTemplate> chat_;
};

// A row of `prompt` then `completion`, labelled on the completion.
kit::LabeledRow completion_row(const std::vector<std::int64_t>& prompt, const std::vector<std::int64_t>& completion);

// A record's field as text: a string as it is, a number or boolean as JSON writes it; UserError
// when it is missing or another kind of value (the caller names the sample).
std::string record_text(const nlohmann::ordered_json& record, const std::string& field);

// kPreferences: each sample's chosen row, then each's rejected row, in the order of the pairs
// kept. A pair longer than max_length is cut alike on both rows (its completions' ends, or its
// prompt's start under truncation = "left") or dropped under "drop" (counted in Batch::skipped),
// as is a pair a row of which keeps no label.
struct PairBatch {
  Batch batch;
  std::int64_t pairs = 0;
};
PairBatch collate_pairs(const std::vector<std::string>& samples, const ObjectiveNeeds& needs, const ObjectiveSamples& read,
                        const Tokenizer& tokenizer, const CollateSettings& settings);

// Evaluation's collator for kPreferences and kPrompts samples: the prompt as generation reads it,
// then the record's answer (needs.answer_field; kPreferences: the chosen completion) labelled, for
// the held-out loss; split_for_generation gives the prompt and that answer for exact-match.
class AnswerCollator final : public Collator, public PromptForm {
 public:
  AnswerCollator(ObjectiveNeeds needs, ObjectiveSamples read) : needs_(std::move(needs)), read_(std::move(read)) {}
  Batch collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer, const CollateSettings& settings) const override;
  std::optional<PromptSplit> split_for_generation(const std::string& sample) const override;
  bool templated() const override { return read_.templated(); }
  std::string end_of_turn(const std::string& sample) const override;
  // The field the answer is read from.
  const std::string& answer_field() const;

 private:
  ObjectiveNeeds needs_;
  ObjectiveSamples read_;
};

}  // namespace loom::core
