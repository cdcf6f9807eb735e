#pragma once
// A decoder layer written as code (kit 4.0). A family whose layer a description would not say
// (GPT-NeoX's parallel residual and per-head fused qkv, a plain MLP with biases, LayerNorms) gives
// DecoderFamily::block: a short class over public pieces. It registers its weights through a
// BlockBuilder by their checkpoint names, each linear declaring how tensor parallelism splits it,
// and hands its queries, keys and values to attend(). The shell (decoder.hpp) then loads (sharded
// files, 4-bit bases), saves, draws at random init, splits, caches and schedules it as it does its
// own layers, so the block holds no loading, no cache and no collective.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/decoder.hpp"
#include "loom/kit/moe.hpp"
#include "loom/model.hpp"

namespace loom {
class AdaptableLinear;  // loom/layers.hpp
}

namespace loom::kit {

// A norm of a layer (or the model's final one) in its form: its weight, and its bias where the
// form has one (NormForm::kLayer). Applied to x's last dimension; x itself where it has no weight.
struct Norm {
  NormForm form = NormForm::kScale;
  at::Tensor weight, bias;
  double eps = 1e-6;
  LOOM_API at::Tensor operator()(const at::Tensor& x) const;
};

// An MLP's activation as config.json's hidden_act names it (Activation): silu, exact gelu, or gelu
// with the tanh approximation.
LOOM_API at::Tensor activate(Activation activation, const at::Tensor& x);

// How attend() turns q and k by the pass's rotary tables: HF's rotate_half (apply_rotary), GPT-J's
// interleaved pairs (apply_rotary_interleaved), or not at all.
enum class Rotary { kHalf, kInterleaved, kNone };

// One pass through one decoder layer as the shell prepared it: rotary tables and the attention
// pattern of the layer's kind (global or sliding), and, in generation, the cache the pass reads
// and writes. A block passes it to attend() as it is.
struct LayerPass {
  std::size_t layer = 0;    // the layer's index in the model
  std::int64_t window = 0;  // a sliding layer's window; 0: global
  at::Tensor cos, sin;      // [B, T, rotary dims]
  at::Tensor allowed;       // which keys each query sees (attention_allowed); undefined: plain causal
  at::Tensor attention_mask;  // [B, S] as the state carries it
  const AttentionSegments* segments = nullptr;  // variable-length attention's segments, where the shell chose it
  // A pass through a StaticKVCache (generation); null otherwise. rows and columns [B, T] index the
  // cache; read_rows the cache rows a later pass reads (undefined: all); fresh: the rows held
  // nothing before. A sliding layer whose window is shorter than the cache keeps a ring of
  // `window` slots: ring_slots [B, T] each token's slot, ring_allowed what a query sees of it.
  StaticKVCache* cache = nullptr;
  at::Tensor cache_rows, cache_columns, read_rows;
  bool fresh = false;
  at::Tensor ring_slots, ring_allowed;
  // A mixture of experts' router sums for the load-balancing loss, null when not counted, and the
  // tokens that are real ([B, T] of attention_mask) that they count.
  RouterSums* router_sums = nullptr;
  at::Tensor token_mask;
  Communicator* tensor_group = nullptr;  // the group the layer's heads split over (null: whole); for shared_by_heads()
};

// x as every one of this rank's heads reads it, where the heads split over the pass's tensor group
// and x does not (DeepSeek's one rotary key head, read by every query head): forward x itself, its
// gradient summed over the group in backward, so every rank's copy of what made x learns alike.
LOOM_API at::Tensor shared_by_heads(const at::Tensor& x, const LayerPass& pass);
// The same over `tensor_group` (null or one rank: x itself); kit 4.1.
LOOM_API at::Tensor shared_by_heads(const at::Tensor& x, Communicator* tensor_group);

// attend()'s choices beyond the defaults: the rotary's convention, and what the scores take
// (AttentionExtras): soft-capping and sinks run the exact formula; another scale alone keeps the
// fused kernels (q is scaled to suit them).
struct AttendOptions {
  Rotary rotary = Rotary::kHalf;
  AttentionExtras extras;
};

// Attention of one pass's tokens: q [B, T, H, d], k [B, T, KV, d] and v [B, T, KV, dv] as the
// projections give them (before rotary; H a multiple of KV), turned by the pass's rotary, written
// into the pass's cache and attended over what each query may see (its sample, its window, the
// cache's columns), on the fastest kernel that computes it. [B, T, H * dv].
LOOM_API at::Tensor attend(const LayerPass& pass, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttendOptions& options = {});

// What a layer's attention is made from, cached instead of its keys and values (kit 4.1; DeepSeek's
// compressed latent and rotary key): x [B, T, W] of the pass's tokens written into the pass's cache
// at their columns (the layer's `keys` slot, [rows, 1, capacity, W]; `values` left empty), and
// every column the rows hold returned, [B, capacity, W] (the pass's own x where the rows held
// nothing before it: the pass's pattern then covers its tokens alone). Without a cache, x. The
// block then makes keys and values of all of it and calls attend() with a pass whose cache is
// null, which attends over them with the pass's pattern. No sliding layer: a ring is attend()'s.
LOOM_API at::Tensor remember(const LayerPass& pass, const at::Tensor& x);

// A layer as code: what DecoderFamily::block makes, one a layer the shell holds.
class LOOM_API DecoderBlock {
 public:
  virtual ~DecoderBlock();
  // The layer's output [B, T, hidden] from its input.
  virtual at::Tensor forward(const at::Tensor& x, LayerPass& pass) = 0;
};

// A mixture of experts a layer holds (kit 4.0), made by BlockBuilder::experts(): the router
// [E, H] and the experts stacked as transformers 5 keeps them (gate_up [E, 2I, H], each expert's
// gate rows then its up rows; down [E, H, I]). The shell loads them (one tensor per expert's linear
// on disk, as the family's MixtureOfExperts names them), saves, draws and splits them (each
// expert's units over the tensor group, the experts over the expert group), stores them 4-bit for
// QLoRA and hands an adapter their deltas (ExpertWeights). A block calls it on the MLP's input.
class LOOM_API Experts : public torch::nn::Module {
 public:
  // The router and the stacked tensors (one value expanded to the shape where `stored_*` keep them)
  // for `experts_here` experts of `units` units each (this rank's).
  // `activation`: how gate_up's product feeds down; `biases`: each expert's products with a bias
  // (gate_up [E, 2I], down [E, H]: gpt-oss's; kit 4.1).
  Experts(const DecoderConfig& config, const RouterSettings& routing, std::int64_t experts_here, std::int64_t units, const at::TensorOptions& options,
          std::shared_ptr<LinearWeight> stored_gate_up, std::shared_ptr<LinearWeight> stored_down, Communicator* tensor_group,
          Communicator* expert_group, const ExpertActivation& activation = {}, bool biases = false);
  // Each token's top-k experts of m [B, T, H], weighted; the router's sums over the pass's real
  // tokens added to pass.router_sums where the pass counts them (the load-balancing loss).
  at::Tensor forward(const at::Tensor& m, const LayerPass& pass) const;

  // A stacked weight, down's or gate_up's (shapes only where it is stored), and whether it is stored.
  const at::Tensor& stacked(bool down) const { return down ? down_ : gate_up_; }
  bool stored(bool down) const { return (down ? stored_down_ : stored_gate_up_) != nullptr; }
  // Where a checkpoint's experts are read into: the stacked tensor, or a stored weight's
  // full-precision copy until finish_stacked() hands it over (one layer's at a time).
  at::Tensor stacked_values(bool down);
  // The stacked weight's values are all in: a stored one takes them (a 4-bit one quantizes them).
  void finish_stacked(bool down, const at::Tensor& values = at::Tensor());

  // A stacked weight's bias, gate_up's [E, 2I] or down's [E, H] (this rank's part); undefined where
  // the experts have none.
  const at::Tensor& bias(bool down) const { return down ? down_bias_ : gate_up_bias_; }
  const ExpertActivation& activation() const { return activation_; }

  at::Tensor router;
  ExpertsDelta gate_up_delta, down_delta;  // an adapter's, on every expert (ExpertWeights)
  // The family's own routing of the tokens [N, H] by the router [E, H] (DeepSeek-V3's
  // route_sigmoid_grouped with its correction bias); unset: route() with the config's settings.
  std::function<Routing(const at::Tensor& hidden, const at::Tensor& router)> route_with;

 private:
  ExpertsMatrix matrix(bool down) const;
  RouterSettings routing_;
  at::Tensor gate_up_, down_;
  std::shared_ptr<LinearWeight> stored_gate_up_, stored_down_;
  Communicator* tp_;
  Communicator* ep_;
  at::Tensor staging_gate_up_, staging_down_;
  ExpertActivation activation_;
  at::Tensor gate_up_bias_, down_bias_;
};

// A weight a block registered, as the shell keeps it.
struct BlockWeight {
  std::string name;  // under the layer, as the checkpoint names it ("input_layernorm.weight")
  // Where the checkpoint holds each row apart (StableLM's per-head norms), the pattern of their
  // names with "{}" for the row ("self_attn.q_layernorm.norms.{}.weight"); `name` is then the
  // pattern without its "{}." ("self_attn.q_layernorm.norms.weight"). Empty otherwise.
  std::string rows_apart;
  at::Tensor tensor;
  float init = 0;                   // its value at random init
  bool split = false;               // split by its first dimension over the tensor group (a column's part)
  std::vector<std::int64_t> shape;  // its whole shape
};

// What a family's block registers its weights through, by their checkpoint names under the layer.
// Each linear declares how tensor parallelism splits it (Megatron's column and row; replicated),
// and the builder makes this rank's part of it (and, for an adapter that stores the base its own
// way, a 4-bit part). A block reads its shapes from config() and nothing else: under tensor
// parallelism its q, k and v have fewer heads, which `view(..., -1, head_dim)` takes as it is.
class LOOM_API BlockBuilder {
 public:
  // For the shell: a layer `layer` under `prefix` ("model.layers.3."), its tensors made with
  // `options` (the meta device to learn shapes), split over `tensor_group` (null: whole), its
  // linears' weights from `base_weight` where it gives one (a 4-bit base).
  using BaseWeight = std::function<std::shared_ptr<LinearWeight>(const LinearInfo&, const at::TensorOptions&)>;
  BlockBuilder(const DecoderFamily& family, const DecoderConfig& config, std::size_t layer, at::TensorOptions options, Communicator* tensor_group,
               BaseWeight base_weight, Communicator* expert_group = nullptr);

  const DecoderConfig& config() const { return config_; }
  std::size_t layer() const { return layer_; }
  std::int64_t window() const { return layer_window(config_, layer_); }
  const at::TensorOptions& options() const { return options_; }

  // A linear layer `name` ("attention.dense") of [out, in] weight and, if `bias`, its bias, split as
  // `style` says; `pieces` the outputs of a fused linear a column split cuts each on its own (q, k
  // and v of Phi-3's qkv_proj; empty: one piece, cut as a whole, which keeps GPT-NeoX's per-head
  // rows together).
  std::shared_ptr<AdaptableLinear> linear(const std::string& name, std::int64_t in, std::int64_t out, bool bias, ParallelStyle style,
                                          const std::vector<std::int64_t>& pieces = {});
  // A weight that is no linear's (a norm's scale, a bias of its own) of `shape`, `init` at random
  // init. Whole on every rank, or with ParallelStyle::kColumn split with the heads it spans (its
  // first dimension, like a column linear's output): the tensor is this rank's part. A name with
  // "{}" is of a weight whose rows the checkpoint holds apart, "{}" their index (BlockWeight).
  at::Tensor weight(const std::string& name, const std::vector<std::int64_t>& shape, float init, ParallelStyle style = ParallelStyle::kReplicated);
  // A norm in `form` of `shape` (empty: [hidden_size]), its weight `name` + ".weight" (and bias +
  // ".bias" where the form has one), eps config().rms_norm_eps; split like weight() by `style`
  // (Cohere's per-head q norm [heads, head_dim] by its heads).
  Norm norm(const std::string& name, NormForm form, const std::vector<std::int64_t>& shape = {}, ParallelStyle style = ParallelStyle::kReplicated);
  // The layer's mixture of experts as the family's MixtureOfExperts and config().moe say (its
  // names: DecoderNames' router and experts); one a layer. `activation` and `biases` as Experts
  // takes them (kit 4.1): the biases' names are the stacked weights' with "_bias" after them.
  std::shared_ptr<Experts> experts(const ExpertActivation& activation = {}, bool biases = false);

  // What was registered, in order, for the shell.
  const std::vector<BlockWeight>& weights() const { return weights_; }
  const std::vector<std::pair<std::string, std::shared_ptr<AdaptableLinear>>>& linears() const { return linears_; }
  // The linears as declared: whole sizes and styles (the made ones hold this rank's parts).
  const std::vector<LinearInfo>& declared() const { return declared_; }
  const std::shared_ptr<Experts>& made_experts() const { return experts_; }
  Communicator* tensor_group() const { return tensor_group_; }

 private:
  const DecoderFamily& family_;
  const DecoderConfig& config_;
  std::size_t layer_;
  std::string prefix_;
  at::TensorOptions options_;
  Communicator* tensor_group_;
  BaseWeight base_weight_;
  Communicator* expert_group_;
  std::shared_ptr<Experts> experts_;
  std::vector<BlockWeight> weights_;
  std::vector<std::pair<std::string, std::shared_ptr<AdaptableLinear>>> linears_;
  std::vector<LinearInfo> declared_;
};

// Llama's attention projections under `prefix` ("self_attn.": q_proj, k_proj, v_proj, o_proj): q, k
// and v split by their heads (column), o by its input (row); each with a bias where asked.
struct GroupedQueryAttention {
  std::shared_ptr<AdaptableLinear> q, k, v, o;
  std::int64_t head_dim = 0;
  struct Heads {
    at::Tensor q, k, v;
  };
  // q, k and v of h [B, T, hidden] as [B, T, heads, head_dim] (this rank's heads), before rotary.
  LOOM_API Heads project(const at::Tensor& h) const;
  // o(attend(project(h))): the attention's output [B, T, hidden].
  LOOM_API at::Tensor operator()(const at::Tensor& h, const LayerPass& pass, const AttendOptions& options = {}) const;
};
LOOM_API GroupedQueryAttention grouped_query_attention(BlockBuilder& b, const std::string& prefix, bool qkv_bias, bool o_bias);

// An MLP: gated, down(act(gate(h)) * up(h)) (SwiGLU, GeGLU), where it has a gate; plain,
// down(act(up(h))), where not. gate and up split by their units (column), down by its input (row).
struct Mlp {
  std::shared_ptr<AdaptableLinear> gate, up, down;
  Activation activation = Activation::kSilu;
  // A long row's a slice of rows at a time (mlp_over_row_chunks).
  LOOM_API at::Tensor operator()(const at::Tensor& h) const;
};
// Whether a weight of any of `linears` (nulls skipped) takes a gradient (kit 4.2).
LOOM_API bool any_trains(std::initializer_list<AdaptableLinear*> linears);
// Llama's gate_proj, up_proj and down_proj under `prefix` ("mlp."), config().activation; `units`
// hidden units (0: intermediate_size; DeepSeek's shared experts: their own width).
LOOM_API Mlp gated_mlp(BlockBuilder& b, const std::string& prefix, bool bias, std::int64_t units = 0);
// Two linears, `up` (hidden to intermediate_size) and `down`, config().activation between them.
LOOM_API Mlp plain_mlp(BlockBuilder& b, const std::string& up, const std::string& down, bool bias);

// What a family's block registers for layer `layer`, whole (built on the meta device: no memory):
// its linears with their declared styles, named under the layer, and the values of all its
// weights (the linears', the experts' and the rest); for the plan and for ranks that do not hold
// the layer.
struct BlockShape {
  std::vector<LinearInfo> linears;
  std::uint64_t parameters = 0;
};
LOOM_API BlockShape block_shape(const DecoderFamily& family, const DecoderConfig& config, std::size_t layer);

}  // namespace loom::kit
