#pragma once
// The end of every collation: labeled rows cut to [data] max_length and padded into a Batch, the
// same way for a collator plugin and for the host's chat data.
#include <cstdint>
#include <vector>

#include "loom/collator.hpp"
#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

struct LabeledRow {
  std::vector<std::int64_t> ids;
  std::vector<std::int64_t> labels;  // kIgnoreLabel where no loss is taken
};

// Rows longer than settings.max_length lose their right end or left start, or are dropped
// (Truncation::kDrop); a row left with no label is dropped too (nothing to learn from). The rest
// are padded with `pad_id` on the left or right to the longest. Dropped rows add to Batch::skipped,
// which starts at `skipped`.
LOOM_API Batch pad_rows(std::vector<LabeledRow> rows, const CollateSettings& settings, std::int64_t pad_id, bool pad_left, std::int64_t skipped = 0);

}  // namespace loom::kit
