#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/export.hpp"
#include "loom/plugin.hpp"
#include "loom/tokenizer.hpp"

namespace loom {

inline constexpr std::int64_t kIgnoreLabel = -100;  // label the loss skips, as in PyTorch/HF

// A padded batch, row-major [rows x cols]. Labels hold kIgnoreLabel where no loss is taken.
struct Batch {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<std::int64_t> input_ids;
  std::vector<std::int64_t> attention_mask;
  std::vector<std::int64_t> labels;
  std::int64_t skipped = 0;  // samples dropped by the collator's policy (counted for the run report)
};

class LOOM_API Collator : public Plugin {
 public:
  ~Collator() override;  // defined in the SDK library: one typeinfo for host and plugins
  // Tokenizes formatted samples, truncates to max_length, pads on the tokenizer's padding side
  // with its pad id, and masks labels.
  virtual Batch collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer,
                        std::int64_t max_length) const = 0;
};

}  // namespace loom
