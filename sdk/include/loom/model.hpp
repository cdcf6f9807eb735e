#pragma once
#include <cstdint>
#include <string>
#include <map>
#include <optional>
#include <vector>

#include <filesystem>
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "loom/capability.hpp"
#include "loom/communicator.hpp"
#include "loom/devices.hpp"
#include "loom/export.hpp"
#include "loom/plugin.hpp"

namespace loom {

class AdaptableLinear;               // loom/layers.hpp
class LinearWeight;                  // loom/layers.hpp

enum class BlockKind { kEmbedding, kDecoderLayer, kNorm, kHead };
LOOM_API const char* block_kind_name(BlockKind kind);

// How a tensor-parallel placement may split a linear layer, declared by the model (Megatron's
// styles): column splits the output features (q, k, v, gate, up), row the input features (o, down;
// its output is reduced across the group), replicated keeps it whole on every rank.
enum class ParallelStyle { kReplicated, kColumn, kRow };
LOOM_API const char* parallel_style_name(ParallelStyle style);

// How one linear layer is split: its style and the group it is split over (null or one rank:
// not split at all).
struct TensorShard {
  ParallelStyle style = ParallelStyle::kReplicated;
  Communicator* group = nullptr;
  bool split() const { return group != nullptr && group->size() > 1 && style != ParallelStyle::kReplicated; }
  int rank() const { return group ? group->rank() : 0; }
  int size() const { return group ? group->size() : 1; }
  // The dimension of the [out, in] weight that is split (0 column, 1 row), -1 when whole.
  int weight_dim() const { return !split() ? -1 : style == ParallelStyle::kColumn ? 0 : 1; }
};

struct LinearInfo {
  std::string name;  // the HF module name, e.g. "model.layers.0.self_attn.q_proj"
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  ParallelStyle parallel = ParallelStyle::kReplicated;
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
  // The weights as stored when that is not `parameters` in the run dtype (a 4-bit block counts its
  // codes and scales); 0 means parameters x the run dtype's size.
  std::uint64_t weight_bytes = 0;
};

struct LOOM_API ModelStructure {
  std::string architecture;  // e.g. "llama", "qwen2"
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t max_positions = 0;
  std::vector<BlockInfo> blocks;

  std::uint64_t total_parameters() const;  // tied weights counted once
  // SDK 2.2: the indices of the blocks that hold distinct weights, in order (of a tied group only
  // its first block), for sums over the model that count tied weights once.
  std::vector<std::size_t> distinct_blocks() const;
};

// Keys and values of past positions, per decoder layer: [B, kv_heads, S, head_dim].
struct KVCache {
  std::vector<at::Tensor> keys;
  std::vector<at::Tensor> values;
};

// What flows from block to block. The host moves every tensor to the next block's device before
// calling it, so a block only ever sees tensors on its own device.
struct ForwardState {
  at::Tensor hidden;          // token ids [B, T] into the embedding, [B, T, H] between blocks, the head's output out of it
  at::Tensor position_ids;    // [B, T] int64
  at::Tensor attention_mask;  // [B, S] int64: 1 for a real token, 0 for padding; S = cached + T positions
  KVCache* cache = nullptr;   // SDK 3.0's cache, kept for the layout: this host never sets it (StaticCacheDecoding decodes)
  // Tensors every block of one pass shares (rotary tables, the attention pattern), made by the
  // model at the first block a rank runs for each micro-batch and travelling with the activations;
  // a model keeps no per-pass state of its own, so micro-batches and pipeline stages never see
  // another pass's values. Empty when a pass starts. The host moves them to each block's device,
  // except 0-dim CPU tensors: values for the host (a length), which reading on a GPU would sync.
  std::map<std::string, at::Tensor> pass;
};

struct NamedParameter {
  std::string name;  // the HF checkpoint name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::size_t block = 0;
  at::Tensor tensor;
};

struct NamedLinear {
  std::string name;  // the HF module name, e.g. "model.layers.0.self_attn.q_proj"
  std::size_t block = 0;
  AdaptableLinear* layer = nullptr;
};

// The LibTorch scalar type of a run dtype.
LOOM_API c10::ScalarType scalar_type(DType dtype);

struct LoadRequest {
  // One entry per block of structure(), from the plan: the device of each block this rank holds,
  // nullopt for blocks other ranks hold (the model neither allocates nor reads those).
  std::vector<std::optional<c10::Device>> block_devices;
  DType dtype = DType::kFloat32;
  std::uint64_t seed = 0;  // for init = "random": a block's values do not depend on which blocks a rank holds
  Parallel* parallel = nullptr;  // this process's groups; null in a one-process run
  // The weight to build under a linear instead of a dense one (unset, or null returned: dense),
  // from an adapter that stores the base (BaseStoringAdapter): fill it with LinearWeight::assign()
  // while loading, and call finish_load() after.
  std::function<std::shared_ptr<LinearWeight>(const LinearInfo&, const at::TensorOptions&)> base_weight;
};

// A model with its weights, block by block on the devices of its plan.
class LOOM_API LoadedModel {
 public:
  virtual ~LoadedModel();
  virtual std::size_t block_count() const = 0;  // all blocks of the model, held here or not
  // Runs block `index` (one this rank holds) on `state`, whose tensors are already on its device.
  virtual void forward(std::size_t index, ForwardState& state) = 0;
  // Summed next-token cross-entropy of the head's output against labels [B, T] (-100 ignored), on
  // the head's device (loom::kit::next_token_loss_sum for full-vocabulary logits; a
  // vocabulary-parallel head never gathers them).
  virtual at::Tensor loss_sum(const at::Tensor& head_output, const at::Tensor& labels) = 0;
  // Full-vocabulary logits [B, T, V] from the head's output, for generation.
  virtual at::Tensor logits(const at::Tensor& head_output) = 0;
  // Every parameter this rank holds once (tied weights under their first name), in block order.
  virtual std::vector<NamedParameter> parameters() = 0;
  // Every linear of the model in order, those of blocks other ranks hold with a null layer (so an
  // adapter numbers them the same on any rank: its initialisation does not depend on the plan).
  virtual std::vector<NamedLinear> linears() = 0;
  virtual void set_training(bool training) = 0;  // dropout in adapters follows this
  // Writes an HF folder (config.json + model.safetensors) of the current weights. Under tensor
  // parallelism every rank of the tensor group calls it (the shards are gathered) and its rank 0
  // writes.
  virtual void save_pretrained(const std::filesystem::path& dir) = 0;
  // The dimension along which parameter `name` (as parameters() names it) is split over the
  // tensor group, -1 when every rank holds it whole (the default).
  virtual int shard_dim(const std::string& name) const;
};

class LOOM_API Model : public Plugin {
 public:
  ~Model() override;  // defined in the SDK library: one typeinfo for host and plugins
  // Read from config alone: a folder holding only config.json is enough.
  virtual ModelStructure structure() const = 0;
  // Materialises the weights straight onto each block's device and dtype (streaming checkpoint
  // shards), or initialises them from the seed. Throws UserError on a bad checkpoint.
  virtual std::unique_ptr<LoadedModel> load(const LoadRequest& request) const = 0;
};

// SDK 3.2: keys and values kept for generation in tensors made once per request and written in
// place (no concatenation per token, fixed shapes a CUDA graph can replay).
struct StaticKVCache {
  std::int64_t rows = 0;      // sequences it holds
  std::int64_t capacity = 0;  // positions per sequence
  // Per decoder layer, by the model's own numbering: [rows, kv_heads, capacity, head_dim], made by
  // the model at the layer's first pass (kv_heads: those this rank holds).
  std::vector<at::Tensor> keys;
  std::vector<at::Tensor> values;
};

// One pass through a StaticKVCache.
struct CachedPass {
  StaticKVCache* cache = nullptr;
  at::Tensor rows;     // [B] int64: the cache rows of the pass's batch rows; undefined: rows 0..B-1 of a cache of B rows
  at::Tensor columns;  // [B, T] int64: the cache column each token's keys and values go to
  // The rows hold nothing before this pass (a prompt): its tokens attend among themselves only, so
  // attention needs no cache read and can take its causal (flash) kernel when nothing is padded.
  bool fresh = false;
};

// Capability of a LoadedModel that generates through a StaticKVCache (SDK 3.2). Without it the
// host recomputes every position per token.
class LOOM_API StaticCacheDecoding : public Capability {
 public:
  ~StaticCacheDecoding() override;
  // Runs block `index` as forward() does (state.cache is null), writing the keys and values of the
  // pass's tokens into pass.cache at pass.columns first and attending over what the rows hold.
  // state.attention_mask is [B, T] (1: a real token) for a fresh pass, else [B, capacity] (1: a
  // column holding a real token, this pass's own included; a token also sees only columns up to its
  // own). Every tensor of `pass` may be on another device than the block; the model moves them.
  virtual void forward_cached(std::size_t index, ForwardState& state, CachedPass& pass) = 0;
};

// Capability of a Model whose loaded form offers StaticCacheDecoding (SDK 3.2): what its cache
// keeps, so a plan can count it before anything loads.
class LOOM_API StaticCacheSizing : public Capability {
 public:
  ~StaticCacheSizing() override;
  // Values (of the run dtype) block `index` keeps per position of one row (a decoder layer's keys
  // and values), on each rank when split over `tensor` ranks.
  virtual std::uint64_t cache_values_per_position(std::size_t index, int tensor) const = 0;
};

// Capability of a Model whose cache keeps fewer positions than it is made for in some blocks (SDK
// 3.9): a sliding layer keeps only its window. Without it the plan counts every position.
class LOOM_API StaticCacheWindow : public Capability {
 public:
  ~StaticCacheWindow() override;
  // The most positions block `index` keeps a row, however many the cache is made for (0: every one).
  virtual std::int64_t cache_window(std::size_t index) const = 0;
};

// Capability of a Model whose loaded form trains on packed rows (SDK 3.3): several samples laid end
// to end in one row. Its forward() reads ForwardState::attention_mask values as segment ids (0:
// padding; 1, 2, ...: the samples of the row, in order), so a token attends only to earlier tokens
// of its own segment, and position_ids restart at 0 with each segment. Without it the host refuses
// [data] packing: a model that reads the mask as 0 or 1 would let samples see each other.
class LOOM_API PackedSequences : public Capability {
 public:
  ~PackedSequences() override;
};

// Capability of a Model whose loss_sum() takes the head's input where the head's weight trains
// nothing and no tensor group splits it (SDK 3.4): the head block then holds a slice of logits at a
// time, not all of them. The planner counts the head block's working set, in such a run, as this
// many values of `dtype` per token for micro-batches of `tokens` tokens, in place of
// BlockInfo::working_values_per_token (which counts whole logits and their gradient).
class LOOM_API FrozenHeadWorkingSet : public Capability {
 public:
  ~FrozenHeadWorkingSet() override;
  virtual std::uint64_t frozen_head_working_values_per_token(std::uint64_t tokens, DType dtype) const = 0;
};

// Capability of a LoadedModel that gives each position's log-probability of its label from the
// head's output without whole logits (SDK 3.14): what objectives that compare log-probabilities
// (DPO, GRPO and their reference passes) read, where logits() would make [tokens, vocabulary].
class LOOM_API HeadTokenLogps : public Capability {
 public:
  ~HeadTokenLogps() override;
  // [B, T] float32, position t holding log p(labels[t] | the positions before it) under the logits
  // divided by `temperature` (0 at t = 0 and where labels[t] is -100), differentiable with respect
  // to head_output; undefined where this head's output does not serve (the host then takes them
  // from logits()).
  virtual at::Tensor token_logps(const at::Tensor& head_output, const at::Tensor& labels, double temperature) = 0;
};

// Capability of a Model some of whose blocks keep or work with a number of values per token that
// depends on how many tokens a micro-batch holds (SDK 3.14): the kit's decoder runs a long row's
// MLP a slice of rows at a time, keeping its input alone and working in one slice. The host plans
// a micro-batch of `tokens` with these in place of the block's BlockInfo values.
class LOOM_API TokenCountedMemory : public Capability {
 public:
  ~TokenCountedMemory() override;
  struct Values {
    std::uint64_t activation_values_per_token = 0;
    std::uint64_t working_values_per_token = 0;
  };
  // Block `block`'s values for a micro-batch of `tokens` tokens of `dtype` (BlockInfo's where
  // they do not depend on it).
  virtual Values block_values_per_token(std::size_t block, std::uint64_t tokens, DType dtype) const = 0;
};

// Capability of a LoadedModel whose training loss has a term of its own beside the next-token loss
// (SDK 3.10): a mixture of experts' load-balancing loss. Its forward() leaves what the term reads in
// ForwardState::pass; the host adds the term to each micro-batch's loss (the step's loss gets their
// mean) and logs it as a metric of its own. Evaluation's loss is the next-token loss alone.
class LOOM_API AuxiliaryLoss : public Capability {
 public:
  ~AuxiliaryLoss() override;
  // The metric's name ("aux_loss"); empty when this model adds no term (the host asks nothing more).
  virtual std::string auxiliary_loss_name() const = 0;
  // What the term is multiplied by as it joins the loss (router_aux_loss_coef).
  virtual double auxiliary_loss_weight() const = 0;
  // One pass's term from its state after the head block, unweighted (as the metric shows it): a scalar on
  // the head's device, differentiable in what made it; undefined where the pass left nothing for it.
  // Every block must have run in this process with gradients kept (the host refuses pipeline
  // stages and recomputed blocks for such a model).
  virtual at::Tensor auxiliary_loss(const ForwardState& state) = 0;
};

// A low-rank delta on a stacked experts weight W [E, out, in] (SDK 3.10): each expert's rows x get
// scale * (x a[e]^T) b[e]^T beside x W[e]^T (LoRA on every expert, as PEFT's target_parameters).
struct ExpertsDelta {
  at::Tensor a;  // [E, r, in]
  at::Tensor b;  // [E, out, r]
  double scale = 1;
  bool defined() const { return a.defined(); }
};

// One stacked experts weight of a model (SDK 3.10).
struct NamedExperts {
  std::string name;         // its parameter's name: "model.layers.0.mlp.experts.gate_up_proj"
  std::size_t block = 0;
  at::Tensor weight;        // [E, out, in]; undefined in a block another rank holds
  ExpertsDelta* delta = nullptr;  // what the model's forward adds (an adapter sets it); null in another rank's block
};

// A stacked experts weight as a plan sees it, read from config alone (SDK 3.10).
struct ExpertsInfo {
  std::string name;  // as NamedExperts names it
  std::size_t block = 0;
  std::int64_t experts = 0, out_features = 0, in_features = 0;
};

// Capability of a Model with stacked experts weights (SDK 3.10), for the plan's count of what an
// adapter adds to them.
class LOOM_API ExpertStructure : public Capability {
 public:
  ~ExpertStructure() override;
  virtual std::vector<ExpertsInfo> experts_info() const = 0;
};

// Capability of a LoadedModel whose mixtures of experts an adapter can adapt (SDK 3.10).
class LOOM_API ExpertWeights : public Capability {
 public:
  ~ExpertWeights() override;
  // Every stacked experts weight of the model in order (a module's in the order it registers them),
  // those of blocks other ranks hold with no weight or delta, as linears() numbers linears.
  virtual std::vector<NamedExperts> expert_weights() = 0;
};

// Which experts of a stacked experts weight this rank holds (SDK 3.11).
struct ExpertsHeld {
  std::int64_t first = 0;          // the first expert held here
  std::int64_t total = 0;          // the layer's experts over all ranks
  Communicator* group = nullptr;   // the ranks sharing them out (ExpertParallel::expert()), rank r from r x held; null: all here
};

// Capability of a LoadedModel that spreads its experts over ExpertParallel::expert()'s ranks
// (SDK 3.11): a NamedExperts' weight and delta then hold experts first .. first + weight.size(0) - 1.
// A model loaded under [parallel] expert > 1 without it is refused.
class LOOM_API ExpertShards : public Capability {
 public:
  ~ExpertShards() override;
  virtual ExpertsHeld experts_held(const std::string& name) const = 0;
};

// What a model supports under tensor parallelism over `tensor` ranks (TensorParallelModel).
struct TensorParallelSupport {
  std::string refusal;             // empty when it can; otherwise what cannot be split, with the counts
  std::vector<std::string> notes;  // how it splits (heads per rank, K/V split or replicated)
};

// Capability of a Model that load() can split over a tensor group (see loom/capability.hpp). A
// model without it is refused for a mesh with tensor > 1.
class LOOM_API TensorParallelModel : public Capability {
 public:
  ~TensorParallelModel() override;
  // Whether and how load() splits the model over `tensor` ranks (LoadRequest::parallel's tensor
  // group).
  virtual TensorParallelSupport tensor_parallel(int tensor) const = 0;
};

}  // namespace loom
