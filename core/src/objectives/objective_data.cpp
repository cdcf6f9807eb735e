#include "objectives/objective_data.hpp"

#include <algorithm>

#include "config/data.hpp"
#include "loom/error.hpp"

namespace loom::core {

std::vector<std::int64_t> prompt_ids(const Tokenizer& tokenizer, const std::string& prompt) { return tokenizer.encode(prompt, Specials::kPrompt).ids; }

std::vector<std::int64_t> completion_ids(const Tokenizer& tokenizer, const std::string& completion) {
  // A whole sample's specials, less its BOS: the text's own ids, then the EOS where add_eos says so.
  const auto bos = tokenizer.encode("", Specials::kPrompt).ids.size();
  std::vector<std::int64_t> ids = tokenizer.encode(completion, Specials::kSample).ids;
  ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(std::min(bos, ids.size())));
  return ids;
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

PairBatch collate_pairs(const std::vector<std::string>& samples, const ObjectiveNeeds& needs, const Tokenizer& tokenizer,
                        const CollateSettings& settings) {
  const auto pad = tokenizer.special_tokens().pad;
  if (!pad) throw UserError("the tokenizer has no padding token; set [tokenizer] pad_token (e.g. \"eos\")");
  std::vector<kit::LabeledRow> chosen, rejected;
  std::int64_t skipped = 0;
  const auto length = static_cast<std::size_t>(settings.max_length);
  for (const auto& sample : samples) {
    const SampleWithRecord s = split_sample(sample);
    const auto prompt = prompt_ids(tokenizer, s.prompt);
    kit::LabeledRow c = completion_row(prompt, completion_ids(tokenizer, record_text(s.record, needs.chosen_field)));
    kit::LabeledRow r = completion_row(prompt, completion_ids(tokenizer, record_text(s.record, needs.rejected_field)));
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
    const SampleWithRecord s = split_sample(sample);
    rows.push_back(completion_row(prompt_ids(tokenizer, s.prompt), completion_ids(tokenizer, record_text(s.record, answer_field()))));
  }
  return kit::pad_rows(std::move(rows), settings, *pad, tokenizer.pad_left());
}

std::optional<PromptSplit> AnswerCollator::split_for_generation(const std::string& sample) const {
  const SampleWithRecord s = split_sample(sample);
  const auto it = s.record.find(answer_field());
  if (it == s.record.end() || !(it->is_string() || it->is_number())) return std::nullopt;
  return PromptSplit{s.prompt, it->is_string() ? it->get<std::string>() : it->dump()};
}

}  // namespace loom::core
