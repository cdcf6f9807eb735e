#pragma once
#include <cstdint>
#include <functional>
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
};

// The logits at the last position [B, V] (fp32, CPU) after running ids [B, T] with their positions
// and mask through the model, keeping keys and values in `cache`.
using NextLogits = std::function<at::Tensor(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, KVCache* cache)>;

// Continues each prompt (batched, left-padded, with a KV cache) until EOS or max_new_tokens.
// Returns the generated text of each prompt, special tokens left out.
std::vector<std::string> generate(const NextLogits& next_logits, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                  const GenerationSettings& settings);

}  // namespace loom::core
