#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "executor.hpp"
#include "loom/tokenizer.hpp"

namespace loom::core {

struct GenerationSettings {
  std::int64_t max_new_tokens = 32;
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;        // nucleus sampling when temperature > 0
  std::uint64_t seed = 0;
  std::int64_t max_positions = 0;  // the model's longest sequence; a prompt plus its answer past it is an error (0: no bound)
};

// Continues each prompt (batched, left-padded, with a KV cache) until EOS or max_new_tokens.
// Returns the generated text of each prompt, special tokens left out.
std::vector<std::string> generate(Executor& executor, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                  const GenerationSettings& settings);

}  // namespace loom::core
