#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/model.hpp"
#include "loom/tokenizer.hpp"

namespace loom::core {

// Rows decoded together unless asked otherwise (loom generate --rows, and evaluation).
inline constexpr std::int64_t kDefaultGenerationRows = 64;

struct GenerationSettings {
  std::int64_t max_new_tokens = 32;
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;        // nucleus sampling when temperature > 0
  std::int64_t top_k = 0;    // only the k likeliest tokens when temperature > 0 (0: all)
  std::uint64_t seed = 0;
  // Prompt i draws from stream first_stream + i: callers that split one set of prompts over
  // ranks draw each as one process would.
  std::int64_t first_stream = 0;
  std::int64_t max_positions = 0;  // the model's longest sequence; a prompt plus its answer past it is an error (0: no bound)
  // Prompts rendered by a chat template, which writes the special tokens itself: encoded without
  // adding any, and answers decoded with theirs (an end-of-turn token may be the stop text).
  bool templated = false;
  // A row stops at the first of these in its text, which is cut there (a chat turn's end marker).
  std::vector<std::string> stop_texts;
  // The end-of-sequence token ends no row: every prompt gets max_new_tokens (benchmarks, whose
  // timing must not hang on when a random model happens to end).
  bool ignore_eos = false;
  // Rows decoded together. More prompts than this wait, and each takes the place of a row that
  // has ended (continuous batching).
  std::int64_t max_rows = kDefaultGenerationRows;
  // Decode steps between the host's looks at the tokens (end of sequence, stop texts, rows to
  // refill): a GPU runs ahead in between without waiting for the host. 0: after every step on the
  // CPU (a look costs no wait there, and an ended row is refilled at once), every 8 on a GPU.
  std::int64_t check_every = 0;
  // Replay the decode step as a CUDA graph, where the caller knows one process holds the whole
  // model on one GPU (and this is a CUDA build); else each step runs op by op. Same tokens.
  bool cuda_graph = false;
  // Prompts longer than this many tokens go through the model in passes of this many, each
  // attending to the cache the earlier ones wrote: a pass's activations and attention pattern
  // stay bounded however long the prompt.
  std::int64_t prompt_chunk = 4096;
  // Called with the cache's shape once the prompts are read, before it is made: returns the rows
  // to make (a caller checks that they fit: as many, or fewer), or throws UserError.
  std::function<std::int64_t(std::int64_t rows, std::int64_t capacity)> before_cache;
};

// The head's logits [B, V] (fp32, on any device) at each row's last token after running ids [B, T]
// at their positions through the model, with its keys and values kept in the pass's cache (mask:
// as StaticCacheDecoding reads it).
using NextLogits = std::function<at::Tensor(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass& pass)>;

// The next token of each row of `logits` [B, V] on their device: the first largest logit when
// greedy; else a draw from the temperature-scaled softmax cut to its top-k and top-p nucleus, by
// the Gumbel-max trick over noise hashed from (seed, the row's `streams` entry, its `draws` count,
// token id). No generator state: a row draws the same whatever rows sit beside it, whatever
// placement computed the logits, and inside a replayed CUDA graph.
at::Tensor choose_next(const at::Tensor& logits, const GenerationSettings& settings, const at::Tensor& streams, const at::Tensor& draws);

// Continues each prompt until its end of sequence, a stop text or max_new_tokens, through a cache
// made once. Returns the generated text of each prompt, special tokens left out unless templated.
std::vector<std::string> generate(const NextLogits& next_logits, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                  const GenerationSettings& settings);

// An answer as text (as generate() gives it) and as the ids drawn: through the end-of-sequence
// token where the row drew one, through the tokens that spell a stop text where one ended it.
struct Generated {
  std::string text;
  std::vector<std::int64_t> ids;
  std::vector<std::int64_t> prompt_ids;  // the prompt as the model read it
};
std::vector<Generated> generate_completions(const NextLogits& next_logits, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                            const GenerationSettings& settings);
// The same from prompts given as token ids, used as they are (no special tokens added; loom generate --ids).
std::vector<Generated> generate_completions(const NextLogits& next_logits, const Tokenizer& tokenizer, std::vector<std::vector<std::int64_t>> prompt_ids,
                                            const GenerationSettings& settings);

}  // namespace loom::core
