#pragma once
// Packing (docs/pipeline.md, [data] packing): a micro-batch's samples laid end to end in rows of at
// most max_length tokens instead of each padded to the longest, for a model that attends within
// each sample (PackedSequences, loom/model.hpp).
#include <cstdint>
#include <string>
#include <vector>

#include "loom/collator.hpp"

namespace loom::core {

enum class Packer {
  kFirstFitDecreasing,  // longest first, each into the first row with room: the fewest rows
  kGreedy,              // in the drawn order, a new row when the next sample does not fit
};
Packer parse_packer(const std::string& name);  // "first_fit_decreasing", "greedy"; UserError otherwise

// Which samples (by index into `length`, their token counts) go in which row of at most
// `row_length` tokens; samples of no tokens in none. longest: the most tokens a row holds.
struct PackedRows {
  std::vector<std::vector<std::size_t>> rows;
  std::int64_t longest = 0;
};
PackedRows pack_rows(const std::vector<std::int64_t>& length, std::int64_t row_length, Packer packer);

// One row each, unpadded (a collator's batch of one sample) -> rows of at most `row_length`
// tokens: the mask holds each token's sample in its row (1, 2, ...; 0 pads the row's end), the
// labels are each sample's own, its first token's dropped (it would be predicted from the sample
// before it). Padding ids are `pad_id`. Samples longer than row_length are a logic error (the
// collator truncates to it).
Batch pack_samples(const std::vector<Batch>& samples, std::int64_t row_length, Packer packer, std::int64_t pad_id);

}  // namespace loom::core
