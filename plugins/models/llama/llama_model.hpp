#pragma once
#include <memory>

#include "llama_config.hpp"
#include "loom/model.hpp"

namespace loom::llama {

// Builds the model's blocks on their devices and fills them from `folder`'s safetensors
// (streamed shard by shard) or, when `folder` is empty, from the seed.
std::unique_ptr<LoadedModel> load_llama(const LlamaConfig& config, const std::filesystem::path& folder, const LoadRequest& request);

}  // namespace loom::llama
