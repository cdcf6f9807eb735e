#include "loom/kit/collate.hpp"

#include <algorithm>

namespace loom::kit {

Batch pad_rows(std::vector<LabeledRow> rows, const CollateSettings& settings, std::int64_t pad_id, bool pad_left, std::int64_t skipped) {
  Batch batch;
  batch.skipped = skipped;
  const auto unlabeled = [](const std::vector<std::int64_t>& labels) {
    return std::all_of(labels.begin(), labels.end(), [](std::int64_t l) { return l == kIgnoreLabel; });
  };
  std::vector<LabeledRow> kept;
  const auto limit = static_cast<std::size_t>(settings.max_length);
  for (auto& row : rows) {
    if (row.ids.size() > limit) {
      if (settings.truncation == Truncation::kDrop) {
        ++batch.skipped;
        continue;
      }
      const auto start = static_cast<std::ptrdiff_t>(settings.truncation == Truncation::kLeft ? row.ids.size() - limit : 0);
      const auto end = start + static_cast<std::ptrdiff_t>(limit);
      row.ids = std::vector<std::int64_t>(row.ids.begin() + start, row.ids.begin() + end);
      row.labels = std::vector<std::int64_t>(row.labels.begin() + start, row.labels.begin() + end);
    }
    if (unlabeled(row.labels)) {
      ++batch.skipped;
      continue;
    }
    kept.push_back(std::move(row));
  }
  std::size_t cols = 0;
  for (const auto& r : kept) cols = std::max(cols, r.ids.size());
  batch.rows = static_cast<std::int64_t>(kept.size());
  batch.cols = static_cast<std::int64_t>(cols);
  for (const auto& r : kept) {
    const std::size_t padding = cols - r.ids.size();
    const auto emit_padding = [&] {
      batch.input_ids.insert(batch.input_ids.end(), padding, pad_id);
      batch.attention_mask.insert(batch.attention_mask.end(), padding, 0);
      batch.labels.insert(batch.labels.end(), padding, kIgnoreLabel);
    };
    if (pad_left) emit_padding();
    batch.input_ids.insert(batch.input_ids.end(), r.ids.begin(), r.ids.end());
    batch.attention_mask.insert(batch.attention_mask.end(), r.ids.size(), 1);
    batch.labels.insert(batch.labels.end(), r.labels.begin(), r.labels.end());
    if (!pad_left) emit_padding();
  }
  return batch;
}

}  // namespace loom::kit
