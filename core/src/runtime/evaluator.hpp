#pragma once
// A run's held-out evaluation: the mean next-token loss and the greedy exact-match, through the
// rank's runtime (one process or any split), the sums taken over the data ranks.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom/collator.hpp"
#include "loom/communicator.hpp"
#include "loom/tokenizer.hpp"
#include "generation/generate.hpp"
#include "runtime/rank_runtime.hpp"

namespace loom::core {

struct EvalSettings {
  std::int64_t batch_size = 1;
  std::int64_t max_samples = 0;     // the first this many samples (0: all)
  std::int64_t max_new_tokens = 0;  // the longest greedy answer for exact-match
  CollateSettings collate;
  // Rows for the exact-match's generation whose cache fits (null: as many as it asks).
  std::function<std::int64_t(std::int64_t rows, std::int64_t capacity)> generation_rows;
};

struct EvalResult {
  double loss = 0;           // mean over the label tokens of every evaluated sample
  std::int64_t samples = 0;  // evaluated, over every rank
  std::int64_t exact = 0;    // greedy answers equal to their reference (surrounding whitespace aside)
  std::int64_t prompts = 0;  // samples the collator could split into prompt and reference
  double exact_match() const { return prompts == 0 ? 0 : static_cast<double>(exact) / static_cast<double>(prompts); }
};

// Generation through the rank's runtime: the head's logits of each pass, on every rank of the replica.
NextLogits next_logits_of(RankRuntime& runtime);
// Settings every rank of a replica generates alike under: the decode step as a CUDA graph where one
// process holds the model on one GPU; the cache's rows the fewest any rank of the replica fits
// (`generation_rows`: what this rank fits, null: every row asked), refused on every rank together.
void share_generation(GenerationSettings& g, RankRuntime& runtime, Parallel& parallel, c10::Device comm_device,
                      const std::function<std::int64_t(std::int64_t rows, std::int64_t capacity)>& generation_rows);

class Evaluator {
 public:
  // `parallel`'s data group shares the samples out; its pipeline group holds the stages. Small
  // sums travel on `comm_device`.
  Evaluator(RankRuntime& runtime, const Collator& collator, const Tokenizer& tokenizer, Parallel& parallel, c10::Device comm_device,
            EvalSettings settings);
  // Every rank of the data group takes every n-th sample; every rank of the run calls it. The
  // model is left in training mode.
  EvalResult evaluate(const std::vector<std::string>& samples);

 private:
  RankRuntime& runtime_;
  const Collator& collator_;
  const Tokenizer& tokenizer_;
  Parallel& parallel_;
  c10::Device comm_device_;
  EvalSettings settings_;
};

}  // namespace loom::core
