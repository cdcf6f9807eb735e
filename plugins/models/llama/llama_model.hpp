#pragma once
#include <memory>
#include <optional>

#include "llama_config.hpp"
#include "loom/model.hpp"
#include "loom/tensor_parallel.hpp"

namespace loom::llama {

// The K/V heads a tensor rank reads: its own shard when they split evenly, otherwise the whole
// projections replicated and the heads [first, first + count) its query heads use.
struct KvHeads {
  bool split = true;
  std::int64_t first = 0;
  std::int64_t count = 0;
};
// nullopt when replicated K/V heads do not map onto the rank's query heads.
std::optional<KvHeads> kv_heads_for(const LlamaConfig& config, int rank, int tensor);
TensorParallelSupport llama_tensor_parallel(const LlamaConfig& config, int tensor);

// Builds the model's blocks on their devices and fills them from `folder`'s safetensors
// (streamed shard by shard) or, when `folder` is empty, from the seed.
std::unique_ptr<LoadedModel> load_llama(const LlamaConfig& config, const std::filesystem::path& folder, const LoadRequest& request);

}  // namespace loom::llama
