#pragma once
// The rows of the objectives that read more than a rendered text (loom/objective.hpp): a
// preference pair's two rows, a sampled completion's row, and evaluation's collator for them
// (the prompt, then the record's answer field labelled).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/collator.hpp"
#include "loom/kit/collate.hpp"
#include "loom/objective.hpp"
#include "loom/tokenizer.hpp"

namespace loom::core {

// The ids a prompt is read as, where generation and training both read it: with the tokenizer's
// BOS (its add_bos), never an EOS.
std::vector<std::int64_t> prompt_ids(const Tokenizer& tokenizer, const std::string& prompt);
// A completion's ids after its prompt: the text alone, then the EOS where the tokenizer adds one.
std::vector<std::int64_t> completion_ids(const Tokenizer& tokenizer, const std::string& completion);
// A row of `prompt` then `completion`, labelled on the completion.
kit::LabeledRow completion_row(const std::vector<std::int64_t>& prompt, const std::vector<std::int64_t>& completion);

// A record's field as text: a string as it is, a number or boolean as JSON writes it; UserError
// when it is missing or another kind of value (the caller names the sample).
std::string record_text(const nlohmann::ordered_json& record, const std::string& field);

// kPreferences: each sample's chosen row, then each's rejected row, in the order of the pairs
// kept. A pair longer than max_length is cut alike on both rows (its completions' ends, or its
// prompt's start under truncation = "left") or dropped under "drop" (counted in Batch::skipped),
// as is a pair a row of which keeps no label. `where(i)` names sample i in errors.
struct PairBatch {
  Batch batch;
  std::int64_t pairs = 0;
};
PairBatch collate_pairs(const std::vector<std::string>& samples, const ObjectiveNeeds& needs, const Tokenizer& tokenizer,
                        const CollateSettings& settings);

// Evaluation's collator for kPreferences and kPrompts samples: the prompt as generation reads it,
// then the record's answer (needs.answer_field; kPreferences: the chosen completion) labelled, for
// the held-out loss; split_for_generation gives the prompt and that answer for exact-match.
class AnswerCollator final : public Collator {
 public:
  explicit AnswerCollator(ObjectiveNeeds needs) : needs_(std::move(needs)) {}
  Batch collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer, const CollateSettings& settings) const override;
  std::optional<PromptSplit> split_for_generation(const std::string& sample) const override;
  // The field the answer is read from.
  const std::string& answer_field() const;

 private:
  ObjectiveNeeds needs_;
};

}  // namespace loom::core
