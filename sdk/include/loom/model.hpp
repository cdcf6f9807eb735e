#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/export.hpp"
#include "loom/plugin.hpp"

namespace loom {

enum class BlockKind { kEmbedding, kDecoderLayer, kNorm, kHead };
LOOM_API const char* block_kind_name(BlockKind kind);

struct LinearInfo {
  std::string name;  // path inside the block, e.g. "self_attn.q_proj"
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
};

// One unit of placement. The model runs its blocks in order; activations cross devices only at
// block boundaries. All sizes come from the model's config, never from weights.
struct BlockInfo {
  std::string name;  // "embed", "layers.0", ..., "norm", "head"
  BlockKind kind = BlockKind::kDecoderLayer;
  std::uint64_t parameters = 0;
  // Values kept for backward per token, in the run dtype.
  std::uint64_t activation_values_per_token = 0;
  // Largest transient working set inside the block per token, in the run dtype.
  std::uint64_t working_values_per_token = 0;
  std::uint64_t flops_per_token = 0;  // forward, matmuls only
  // Blocks naming the same group share their weights (tied embeddings): placed together, counted once.
  std::string tied_group;
  std::vector<LinearInfo> linears;  // what an adapter can target
};

struct LOOM_API ModelStructure {
  std::string architecture;  // e.g. "llama", "qwen2"
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t max_positions = 0;
  std::vector<BlockInfo> blocks;

  std::uint64_t total_parameters() const;  // tied weights counted once
};

class LOOM_API Model : public Plugin {
 public:
  ~Model() override;  // defined in the SDK library: one typeinfo for host and plugins
  // Read from config alone: a folder holding only config.json is enough.
  virtual ModelStructure structure() const = 0;
};

}  // namespace loom
