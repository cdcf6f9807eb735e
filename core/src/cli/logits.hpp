#pragma once
// `loom logits`: a model's logits for given token ids, for parity checks against transformers.
#include <cstdint>
#include <filesystem>

#include <ATen/core/Tensor.h>

namespace loom::core {

// Token ids in transformers' names: input_ids [B, T]; attention_mask (default all 1) and
// position_ids (default: counted over the real tokens, as transformers does for left padding).
struct TokenInputs {
  at::Tensor ids, mask, positions;  // int64 [B, T]
};

// Reads and checks a JSON file {"input_ids": [[...], ...], "attention_mask": ..., "position_ids": ...}:
// rectangular, ids in [0, vocab), mask 0/1, at most `max_positions` columns. Errors name the file and key.
TokenInputs read_token_inputs(const std::filesystem::path& file, std::int64_t vocab, std::int64_t max_positions);

// The largest |a - b| over the positions `mask` marks real ([B, T] against [B, T, V] logits).
double max_real_difference(const at::Tensor& a, const at::Tensor& b, const at::Tensor& mask);

}  // namespace loom::core
