#include "loom/plugin.hpp"

#include <algorithm>

#include "loom/adapter.hpp"
#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/model.hpp"
#include "loom/objective.hpp"
#include "loom/reward.hpp"
#include "loom/placement.hpp"
#include "loom/tokenizer.hpp"

namespace loom {

Plugin::~Plugin() = default;
Capability::~Capability() = default;
Model::~Model() = default;
TensorParallelModel::~TensorParallelModel() = default;
StaticCacheDecoding::~StaticCacheDecoding() = default;
StaticCacheSizing::~StaticCacheSizing() = default;
StaticCacheWindow::~StaticCacheWindow() = default;
PackedSequences::~PackedSequences() = default;
AuxiliaryLoss::~AuxiliaryLoss() = default;
ExpertWeights::~ExpertWeights() = default;
ExpertStructure::~ExpertStructure() = default;
ExpertShards::~ExpertShards() = default;
FrozenHeadWorkingSet::~FrozenHeadWorkingSet() = default;
TokenCountedMemory::~TokenCountedMemory() = default;
HeadTokenLogps::~HeadTokenLogps() = default;
LoadedModel::~LoadedModel() = default;
int LoadedModel::shard_dim(const std::string&) const { return -1; }
Tokenizer::~Tokenizer() = default;
Adapter::~Adapter() = default;
int Adapter::shard_dim(LoadedModel&, const std::string&) const { return -1; }
BaseStoringAdapter::~BaseStoringAdapter() = default;
ExpertAdapterSizing::~ExpertAdapterSizing() = default;
ChatTemplateSource::~ChatTemplateSource() = default;
Collator::~Collator() = default;
Placement::~Placement() = default;
Objective::~Objective() = default;
at::Tensor Objective::advantages(const at::Tensor&) const {
  throw UserError("this objective samples no completions: it has no advantages to give");
}
Reward::~Reward() = default;

const std::vector<std::string>& plugin_kinds() {
  static const std::vector<std::string> kinds{kKindModel, kKindTokenizer, kKindAdapter, kKindCollator,
                                              kKindPlacement, kKindObjective, kKindReward};
  return kinds;
}

std::vector<OptionSpec> common_options(const std::string& kind) {
  if (kind == kKindTokenizer) {
    return {
        OptionSpec::boolean("add_bos", true, "prepend the BOS token to every sample"),
        OptionSpec::boolean("add_eos", true, "append the EOS token to every sample"),
        OptionSpec::string("padding_side", "right", "which side of a batch row gets the padding")
            .one_of({"left", "right"}),
        OptionSpec::any_of("pad_token", kString | kInt, OptionValue{std::string("pad")},
                           "padding token: \"pad\", \"eos\", \"bos\" or a token id"),
    };
  }
  if (kind == kKindAdapter) {
    return {OptionSpec::boolean("merge", false, "after training, also write base + adapter merged as an HF folder (merged/ in the output)"),
            OptionSpec::string("start_from", std::nullopt,
                               "an adapter folder (a run's adapter/, a PEFT folder) whose values training starts from, instead of fresh ones; its "
                               "adapter_config.json must match this section")
                .path()};
  }
  if (kind == kKindReward) {
    return {OptionSpec::real("weight", 1.0, "what this reward counts for in a completion's reward (the weighted sum of the rewards)")};
  }
  return {};
}

c10::ScalarType scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return c10::ScalarType::Float;
    case DType::kBFloat16: return c10::ScalarType::BFloat16;
    case DType::kFloat16: return c10::ScalarType::Half;
  }
  return c10::ScalarType::Float;
}

const char* block_kind_name(BlockKind kind) {
  switch (kind) {
    case BlockKind::kEmbedding: return "embedding";
    case BlockKind::kDecoderLayer: return "decoder";
    case BlockKind::kNorm: return "norm";
    case BlockKind::kHead: return "head";
  }
  return "?";
}

const char* parallel_style_name(ParallelStyle style) {
  switch (style) {
    case ParallelStyle::kReplicated: return "replicated";
    case ParallelStyle::kColumn: return "column";
    case ParallelStyle::kRow: return "row";
  }
  return "?";
}

std::vector<std::size_t> ModelStructure::distinct_blocks() const {
  std::vector<std::size_t> out;
  std::vector<std::string> seen_groups;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const auto& group = blocks[i].tied_group;
    if (!group.empty()) {
      if (std::find(seen_groups.begin(), seen_groups.end(), group) != seen_groups.end()) continue;
      seen_groups.push_back(group);
    }
    out.push_back(i);
  }
  return out;
}

std::uint64_t ModelStructure::total_parameters() const {
  std::uint64_t total = 0;
  for (const auto i : distinct_blocks()) total += blocks[i].parameters;
  return total;
}

}  // namespace loom
