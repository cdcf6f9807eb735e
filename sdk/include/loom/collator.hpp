#pragma once
#include <cstdint>
#include <optional>
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

enum class Truncation { kRight, kLeft, kDrop };

struct CollateSettings {
  std::int64_t max_length = 1024;
  Truncation truncation = Truncation::kRight;  // kDrop skips (and counts) samples that are too long
};

// A sample split where generation should start: the model is given `prompt` and should produce
// `reference` (for exact-match evaluation).
struct PromptSplit {
  std::string prompt;
  std::string reference;
};

class LOOM_API Collator : public Plugin {
 public:
  ~Collator() override;  // defined in the SDK library: one typeinfo for host and plugins
  // Tokenizes formatted samples, truncates, pads on the tokenizer's padding side with its pad
  // id, and masks labels.
  virtual Batch collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer,
                        const CollateSettings& settings) const = 0;
  // Where a sample's answer begins, if the collator knows (nullopt: no exact-match for it).
  virtual std::optional<PromptSplit> split_for_generation(const std::string& sample) const = 0;
};

}  // namespace loom
