#pragma once
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "runtime/executor.hpp"
#include "loom/tokenizer.hpp"

namespace loom::core {

struct GenerationSettings {
  std::int64_t max_new_tokens = 32;
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;        // nucleus sampling when temperature > 0
  std::uint64_t seed = 0;
  std::int64_t max_positions = 0;  // the model's longest sequence; a prompt plus its answer past it is an error (0: no bound)
  // Prompts rendered by a chat template, which writes the special tokens itself: encoded without
  // adding any, and answers decoded with theirs (an end-of-turn token may be the stop text).
  bool templated = false;
  // A row stops at the first of these in its text, which is cut there (a chat turn's end marker).
  std::vector<std::string> stop_texts;
};

// The logits at the last position [B, V] (fp32, CPU) after running ids [B, T] with their positions
// and mask through the model, keeping keys and values in `cache`.
using NextLogits = std::function<at::Tensor(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, KVCache* cache)>;

// The next token of each row of `logits` [B, V]: the largest logit when greedy, else a draw from
// the temperature-scaled distribution cut to its top-p nucleus, computed here in double from one
// uniform per row of `streams` (one per row). Nothing in it depends on LibTorch's kernels or
// thread count, so every placement that computes the same logits picks the same tokens.
at::Tensor choose_next(const at::Tensor& logits, const GenerationSettings& settings, std::vector<std::mt19937_64>& streams);
// Row `row`'s random stream for a generation seeded with `seed`.
std::mt19937_64 row_stream(std::uint64_t seed, std::int64_t row);

// Continues each prompt (batched, left-padded, with a KV cache) until EOS or max_new_tokens.
// Returns the generated text of each prompt, special tokens left out.
std::vector<std::string> generate(const NextLogits& next_logits, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                  const GenerationSettings& settings);

}  // namespace loom::core
