// The generic decoder's blocks: embedding, decoder layers (RMSNorm, rotary GQA attention with the
// family's q/k hook, SwiGLU MLP), final norm, head. Written so that each block runs on whatever
// device its tensors are on; the host moves activations between blocks.
#include <algorithm>

#include <fstream>
#include <map>
#include <mutex>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/decoder.hpp"
#include "loom/kit/decoder_block.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/loss.hpp"
#include "loom/kit/moe.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/kit/tensor_parallel.hpp"
#include "loom/layers.hpp"

namespace loom::kit {
namespace fs = std::filesystem;
std::optional<KvHeads> kv_heads_for(const DecoderConfig& c, int rank, int tensor) {
  const std::int64_t heads = c.num_attention_heads, kv = c.num_key_value_heads;
  if (kv % tensor == 0) return KvHeads{true, rank * (kv / tensor), kv / tensor};
  // Replicated: this rank's query heads [rank * local, (rank + 1) * local) read K/V heads
  // h / (heads / kv); attention() pairs local query head i with K/V head i / (local / count).
  const std::int64_t local = heads / tensor, group = heads / kv;
  const std::int64_t first = rank * local / group, count = ((rank + 1) * local - 1) / group - first + 1;
  if (local % count != 0) return std::nullopt;
  for (std::int64_t i = 0; i < local; ++i)
    if ((rank * local + i) / group - first != i / (local / count)) return std::nullopt;
  return KvHeads{false, first, count};
}

bool decoder_loss_from_head_input(const DecoderConfig& c, bool fp16) {
  return !fp16 && c.hidden_size != c.vocab_size;
}

TensorParallelSupport decoder_tensor_parallel(const DecoderConfig& c, int tensor) {
  TensorParallelSupport s;
  const auto n = std::to_string(tensor);
  if (tensor <= 1) return s;
  if (c.num_attention_heads % tensor != 0) {
    s.refusal = "its " + std::to_string(c.num_attention_heads) + " attention heads do not split over " + n +
                " tensor ranks; use a tensor size that divides the head count";
    return s;
  }
  bool dense = false;
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) dense = dense || !layer_is_sparse(c, static_cast<std::size_t>(i));
  if (dense && c.intermediate_size % tensor != 0) {
    s.refusal = "its intermediate_size " + std::to_string(c.intermediate_size) + " does not split over " + n + " tensor ranks";
    return s;
  }
  if (c.moe.shared_expert_intermediate_size % tensor != 0) {
    s.refusal = "its shared expert's " + std::to_string(c.moe.shared_expert_intermediate_size) + " hidden units do not split over " + n + " tensor ranks";
    return s;
  }
  if (c.moe.num_experts > 0 && c.moe.expert_intermediate_size % tensor != 0) {
    s.refusal = "its experts' " + std::to_string(c.moe.expert_intermediate_size) + " hidden units do not split over " + n + " tensor ranks";
    return s;
  }
  for (int r = 0; r < tensor; ++r)
    if (!kv_heads_for(c, r, tensor)) {
      s.refusal = "its " + std::to_string(c.num_key_value_heads) + " key/value heads neither split over " + n + " tensor ranks nor map onto " +
                  std::to_string(c.num_attention_heads / tensor) + " query heads per rank; use a tensor size that divides " +
                  std::to_string(c.num_key_value_heads);
      return s;
    }
  if (shard_range(c.vocab_size, tensor - 1, tensor).length == 0) {
    s.refusal = "its vocabulary of " + std::to_string(c.vocab_size) + " is too small to split over " + n + " tensor ranks";
    return s;
  }
  const auto kv = kv_heads_for(c, 0, tensor);
  s.notes.push_back("attention: " + std::to_string(c.num_attention_heads) + " query heads, " + std::to_string(c.num_attention_heads / tensor) +
                    " per tensor rank (q_proj by column, o_proj by row)");
  if (kv->split)
    s.notes.push_back("key/value: " + std::to_string(c.num_key_value_heads) + " heads split, " + std::to_string(kv->count) + " per tensor rank");
  else
    s.notes.push_back("key/value: " + std::to_string(c.num_key_value_heads) + " heads do not split over " + n +
                      " ranks: k_proj and v_proj replicated on every rank, each reading the " + std::to_string(kv->count) + " its query heads use");
  if (dense)
    s.notes.push_back("MLP: " + std::to_string(c.intermediate_size) + " hidden units, " + std::to_string(c.intermediate_size / tensor) +
                      " per tensor rank (gate and up by column, down by row)");
  if (c.moe.num_experts > 0)
    s.notes.push_back("experts: each of the " + std::to_string(c.moe.num_experts) + " experts' " + std::to_string(c.moe.expert_intermediate_size) +
                      " hidden units, " + std::to_string(c.moe.expert_intermediate_size / tensor) +
                      " per tensor rank (gate and up by column, down by row); the router whole on every rank");
  s.notes.push_back("vocabulary: " + std::to_string(c.vocab_size) + " rows of the embedding" + (c.tie_word_embeddings ? " (tied head)" : " and the head") +
                    ", up to " + std::to_string(shard_range(c.vocab_size, 0, tensor).length) +
                    " per tensor rank; the loss reduced over the group, full logits only for generation");
  return s;
}

namespace {

bool ends_with(const std::string& text, const std::string& end) {
  return text.size() > end.size() && text.compare(text.size() - end.size(), end.size(), end) == 0;
}

// Whether a family's layer weight is split over the tensor group with the heads it spans.
bool layer_weight_split(const LayerWeight& w, Communicator* tp, const KvHeads& kv) {
  if (tp == nullptr) return false;
  return w.size == LayerWeight::Size::kQueryWidth || (w.size == LayerWeight::Size::kKeyWidth && kv.split);
}

// The description's layer (DecoderFamily's fields): the family's norms, rotary GQA attention with
// its q/k hook, a gated MLP or experts. The default block, with the decode step's fused kernels.
class DecoderLayer final : public DecoderBlock {
 public:
  // Its weights register through `b` (split over b.tensor_group(); experts, 4-bit bases and the
  // expert group are the builder's); `kv`: the K/V heads this rank reads when K/V are replicated.
  // `sparse`: experts in place of the MLP (layer_is_sparse).
  DecoderLayer(BlockBuilder& b, const DecoderFamily& family, KvHeads kv, bool sparse)
      : family_(family), config_(b.config()), tp_(b.tensor_group()), kv_(kv) {
    const DecoderConfig& c = config_;
    const DecoderNames& n = family.names;
    const auto q = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
    const bool qkv_bias = c.attention_bias || c.qkv_bias;
    const auto column = ParallelStyle::kColumn, row = ParallelStyle::kRow;
    const auto kv_style = kv.split ? ParallelStyle::kColumn : ParallelStyle::kReplicated;
    for (const auto& [name, norm] : norms(n))
      if (!name->empty()) *norm = b.norm(without_weight_suffix(*name), family.norm_form);
    for (const auto& w : family.layer_weights)
      extras.push_back(b.weight(w.name, {w.length(c)}, w.init, layer_weight_split(w, tp_, kv) ? column : ParallelStyle::kReplicated));
    // A fused q/k/v needs each rank's K/V heads to be its own part of k and v (the plugin refuses
    // tensor sizes that would replicate them).
    if (!n.qkv.empty() && tp_ != nullptr && !kv.split) throw std::logic_error("decoder: a fused qkv projection with replicated K/V heads");
    if (n.qkv.empty()) {
      q_proj = b.linear(n.q, c.hidden_size, q, qkv_bias, column);
      k_proj = b.linear(n.k, c.hidden_size, kvd, qkv_bias, kv_style);
      v_proj = b.linear(n.v, c.hidden_size, kvd, qkv_bias, kv_style);
    } else {
      qkv_proj = b.linear(n.qkv, c.hidden_size, q + 2 * kvd, qkv_bias, column, n.output_pieces(n.qkv, c));
    }
    o_proj = b.linear(n.o, q, c.hidden_size, c.attention_bias, row);
    if (sparse) {
      experts_ = b.experts();
      if (const std::int64_t shared = c.moe.shared_expert_intermediate_size; shared > 0) {
        shared_expert_ = gated_mlp(b, n.shared_expert, false, shared);
        if (!n.shared_expert_gate.empty()) shared_expert_gate = b.linear(n.shared_expert_gate, c.hidden_size, 1, false, ParallelStyle::kReplicated);
      }
      return;
    }
    if (n.gate_up.empty()) {
      gate_proj = b.linear(n.gate, c.hidden_size, c.intermediate_size, c.mlp_bias, column);
      up_proj = b.linear(n.up, c.hidden_size, c.intermediate_size, c.mlp_bias, column);
    } else {
      gate_up_proj = b.linear(n.gate_up, c.hidden_size, 2 * c.intermediate_size, c.mlp_bias, column, n.output_pieces(n.gate_up, c));
    }
    down_proj = b.linear(n.down, c.intermediate_size, c.hidden_size, c.mlp_bias, row);
  }

  // K or V for this rank's query heads: [B, T, heads, d]. Replicated K/V are computed whole and
  // narrowed to the heads this rank reads; their gradient, partial on each rank, is summed over
  // the group (copy-to-region) so every rank's replicated k_proj and v_proj learn alike.
  at::Tensor kv_heads(AdaptableLinear& proj, const at::Tensor& h, std::int64_t batch, std::int64_t len) const {
    at::Tensor x = proj.forward(h);
    if (kv_.split || tp_ == nullptr) return x.view({batch, len, -1, config_.head_dim});
    x = shared_by_heads(x, tp_);
    return x.view({batch, len, -1, config_.head_dim}).narrow(2, kv_.first, kv_.count);
  }

  // Queries, keys and values of this rank's heads as the projections (and the family's hook) give
  // them, before rotary: [B, T, heads, d].
  struct Heads {
    at::Tensor q, k, v;
  };
  Heads project_unrotated(const at::Tensor& x) const {
    const auto batch = x.size(0), len = x.size(1);
    const at::Tensor h = input_norm(x);
    // A decode step's few rows: q, k and v in one kernel. A fused projection's output is this
    // rank's q, k and v side by side.
    auto fused = qkv_proj ? split_last(qkv_proj->forward(h), {q_proj_width(), kv_width(), kv_width()})
                          : tp_ == nullptr ? few_row_products(h, {q_proj.get(), k_proj.get(), v_proj.get()}) : std::vector<at::Tensor>{};
    // -1 for the head count: a placement that shards the projections needs no change here.
    at::Tensor q = (fused.empty() ? q_proj->forward(h) : fused[0]).view({batch, len, -1, config_.head_dim});
    at::Tensor k = fused.empty() ? kv_heads(*k_proj, h, batch, len) : fused[1].view({batch, len, -1, config_.head_dim});
    if (family_.on_query_key) {
      // Each tensor rank applies the family's whole weights to its own heads, so each computes part
      // of their gradient: copy-to-region sums the parts, and every rank's copy learns alike.
      LayerWeights weights;
      for (std::size_t i = 0; i < extras.size(); ++i)
        weights.push_back(layer_weight_split(family_.layer_weights[i], tp_, kv_) ? extras[i] : shared_by_heads(extras[i], tp_));
      family_.on_query_key(q, k, weights, config_, tp_);
    }
    // Scores scaled otherwise than by 1 / sqrt(head_dim): q takes the difference, so every
    // attention kernel (SDPA, flash, the decode kernels) scales as it always does.
    if (config_.attention_scale > 0) q = q * (config_.attention_scale * std::sqrt(static_cast<double>(config_.head_dim)));
    at::Tensor v = fused.empty() ? kv_heads(*v_proj, h, batch, len) : fused[2].view({batch, len, -1, config_.head_dim});
    return {q, k, v};
  }

  bool sparse() const { return experts_ != nullptr; }

  // The layer's output from its input and the attention's [B, T, heads * d].
  at::Tensor finish(const at::Tensor& x, const at::Tensor& attended, const LayerPass& pass) const {
    // A decode step's few rows: each product and what follows it in one kernel (a product whose
    // output a norm takes first is left to the layer).
    const bool whole = tp_ == nullptr;
    at::Tensor mid = whole && !attention_out_norm.weight.defined() ? few_row_product_add(attended, *o_proj, x) : at::Tensor();
    if (!mid.defined()) mid = x + attention_out_norm(o_proj->forward(attended));
    const at::Tensor m = post_attention_norm(mid);
    if (sparse()) {
      at::Tensor out = experts_->forward(m, pass);
      if (shared_expert_.down) {  // the shared expert, every token's, weighed by its gate's sigmoid
        const at::Tensor shared = shared_expert_(m);
        out = out + (shared_expert_gate ? at::sigmoid(shared_expert_gate->forward(m)) * shared : shared);
      }
      return mid + mlp_out_norm(out);
    }
    const std::int64_t units = config_.intermediate_size;
    if (mlp_runs_in_chunks(m.numel() / m.size(-1), units, static_cast<std::int64_t>(m.element_size()))) {
      const auto rows = [this](const at::Tensor& x) { return mlp_out_norm(down_proj->forward(gated(x))); };
      return mid + mlp_over_row_chunks(m, units, {gate_proj.get(), up_proj.get(), gate_up_proj.get(), down_proj.get()}, rows);
    }
    at::Tensor act = whole && config_.activation == Activation::kSilu && gate_proj ? few_row_swiglu(m, *gate_proj, *up_proj) : at::Tensor();
    if (!act.defined()) act = gated(m);
    const at::Tensor out = whole && !mlp_out_norm.weight.defined() ? few_row_product_add(act, *down_proj, mid) : at::Tensor();
    return out.defined() ? out : mid + mlp_out_norm(down_proj->forward(act));
  }

  // The MLP's activation of its gate and up products of m (a fused gate_up's output is this rank's
  // gate units, then its up units).
  at::Tensor gated(const at::Tensor& m) const {
    const auto halves = gate_up_proj ? split_last(gate_up_proj->forward(m), {mlp_width(), mlp_width()})
                                     : std::vector<at::Tensor>{gate_proj->forward(m), up_proj->forward(m)};
    return config_.activation == Activation::kSilu ? swiglu(halves[0], halves[1])
                                                   : geglu(halves[0], halves[1], config_.activation == Activation::kGeluTanh);
  }

  // The layer's norms by their checkpoint names (DecoderNames::layer_norms), "" for one the family lacks.
  std::vector<std::pair<const std::string*, Norm*>> norms(const DecoderNames& n) {
    const auto names = n.layer_norms();
    return {{names[0], &input_norm}, {names[1], &post_attention_norm}, {names[2], &attention_out_norm}, {names[3], &mlp_out_norm}};
  }

  at::Tensor forward(const at::Tensor& x, LayerPass& pass) override {
    const Heads h = project_unrotated(x);
    AttendOptions options;
    options.extras.softcap = config_.attention_softcap;
    return finish(x, attend(pass, h.q, h.k, h.v, options), pass);
  }

  Norm input_norm, post_attention_norm, attention_out_norm, mlp_out_norm;  // no weight: none
  std::vector<at::Tensor> extras;  // the family's layer_weights, in order
  // q, k, v or qkv; gate, up or gate_up (DecoderNames): the others null.
  std::shared_ptr<AdaptableLinear> q_proj, k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, gate_up_proj, down_proj;
  // A sparse layer's shared expert and its gate (DecoderNames::shared_expert); no linears where it has none.
  Mlp shared_expert_;
  std::shared_ptr<AdaptableLinear> shared_expert_gate;

 private:
  // This rank's widths of q's, of k's (or v's) and of the MLP's units.
  std::int64_t q_proj_width() const { return config_.num_attention_heads * config_.head_dim / (tp_ ? tp_->size() : 1); }
  std::int64_t kv_width() const { return kv_.count * config_.head_dim; }
  std::int64_t mlp_width() const { return config_.intermediate_size / (tp_ ? tp_->size() : 1); }
  static std::vector<at::Tensor> split_last(const at::Tensor& x, const std::vector<std::int64_t>& widths) {
    std::vector<at::Tensor> parts;
    std::int64_t at = 0;
    for (const std::int64_t w : widths) {
      parts.push_back(x.narrow(-1, at, w));
      at += w;
    }
    return parts;
  }
  static std::string without_weight_suffix(const std::string& name) {
    if (!ends_with(name, ".weight")) throw std::logic_error("decoder: the norm '" + name + "' is not named as a weight (\"....weight\")");
    return name.substr(0, name.size() - 7);
  }
  const DecoderFamily& family_;
  const DecoderConfig& config_;
  Communicator* tp_;
  KvHeads kv_;
  std::shared_ptr<Experts> experts_;  // a sparse layer's; null in a dense one
};


class DecoderLoaded final : public LoadedModel, public StaticCacheDecoding, public AuxiliaryLoss, public ExpertWeights, public ExpertShards,
                            public HeadTokenLogps {
 public:
  DecoderLoaded(const DecoderFamily& family, DecoderConfig config, const LoadRequest& request)
      : family_(family), names_(family.names), config_(std::move(config)), devices_(request.block_devices) {
    if (request.parallel != nullptr && request.parallel->tensor().size() > 1) tp_ = &request.parallel->tensor();
    if (auto* experts = dynamic_cast<ExpertParallel*>(request.parallel); experts != nullptr && experts->expert().size() > 1) {
      ep_ = &experts->expert();
      if (tp_ != nullptr || config_.moe.num_experts % ep_->size() != 0)
        throw std::logic_error("decoder: experts shared out over " + std::to_string(ep_->size()) + " ranks were not checked");
    }
    const int tp_rank = tp_ ? tp_->rank() : 0, tp_size = tp_ ? tp_->size() : 1;
    const auto kv = kv_heads_for(config_, tp_rank, tp_size);
    if (!kv) throw std::logic_error("decoder: tensor parallelism over " + std::to_string(tp_size) + " ranks was not checked");
    vocab_ = VocabularySplit(config_.vocab_size, tp_);
    const auto layers = static_cast<std::size_t>(config_.num_hidden_layers);
    if (devices_.size() != layers + 3)
      throw std::logic_error("decoder: " + std::to_string(devices_.size()) + " block devices for " + std::to_string(layers + 3) + " blocks");
    const auto dtype = scalar_type(request.dtype);
    const auto on = [&](std::size_t block) { return at::TensorOptions().dtype(dtype).device(*devices_[block]); };
    const std::size_t head = layers + 2;
    if (held(0)) embed_ = at::empty({vocab_.rows.length, config_.hidden_size}, on(0));
    // Each layer the rank holds: the family's block, or the description's layer, its weights
    // registered through a builder that splits them over the tensor group as they declare.
    blocks_.resize(layers);
    for (std::size_t i = 0; i < layers; ++i) {
      if (!held(i + 1)) {  // only its linears' names, for an adapter to number them alike on every rank
        if (!family_.block) blocks_[i].others_linears = names_.layer_linears(layer_is_sparse(config_, i));
        else
          for (const auto& info : block_shape(family_, config_, i).linears) blocks_[i].others_linears.push_back(info.name);
        continue;
      }
      BlockBuilder builder(family_, config_, i, on(i + 1), tp_, request.base_weight, ep_);
      HeldBlock& held_block = blocks_[i];
      held_block.block = family_.block ? family_.block(builder) : std::make_shared<DecoderLayer>(builder, family_, *kv, layer_is_sparse(config_, i));
      if (!held_block.block) throw std::logic_error(family_.plugin + ": the family's block for layer " + std::to_string(i) + " is null");
      held_block.weights = builder.weights();
      held_block.linears = builder.linears();
      held_block.experts = builder.made_experts();
      if ((held_block.experts != nullptr) != layer_is_sparse(config_, i))
        throw std::logic_error(family_.plugin + ": layer " + std::to_string(i) + (held_block.experts ? " made experts, but the config says it is dense"
                                                                                                    : " made no experts, but the config says it is sparse"));
    }
    if (held(layers + 1)) {
      final_norm_ = Norm{family_.norm_form, at::full({config_.hidden_size}, norm_identity(family_.norm_form), on(layers + 1)), at::Tensor(),
                         config_.rms_norm_eps};
      if (norm_has_bias(family_.norm_form)) final_norm_.bias = at::zeros({config_.hidden_size}, on(layers + 1));
    }
    // Gemma scales the embedding's rows by sqrt(hidden_size) as a tensor of the weights' dtype.
    if (family_.embedding_scaled)
      embed_scale_ = at::scalar_tensor(std::sqrt(static_cast<double>(config_.hidden_size)), at::TensorOptions().dtype(dtype)).item<double>();
    // A tied head shares the embedding where both are here; a rank holding only the head keeps
    // its own copy of the embedding matrix (under its checkpoint name).
    if (held(head)) head_ = config_.tie_word_embeddings && held(0) ? embed_ : at::empty({vocab_.rows.length, config_.hidden_size}, on(head));
    for (auto* t : {&embed_, &final_norm_.weight, &final_norm_.bias, &head_})
      if (t->defined()) t->set_requires_grad(true);
    for (int kind = 0; kind < 2; ++kind) {
      const RopeSettings* rope = kind == 0 ? &config_.rope : config_.local_rope ? &*config_.local_rope : nullptr;
      for (int long_context = 0; rope != nullptr && long_context < (rope->type == "longrope" ? 2 : 1); ++long_context)
        inv_freq_cpu_[kind][long_context] =
            at::tensor(rope_inverse_frequencies(*rope, rotary_dim(config_), long_context == 1), at::TensorOptions().dtype(at::kDouble)).to(at::kFloat);
    }
    for (const auto& l : linears())
      if (l.layer) linear_of_[l.name] = l.layer;
    // What is split, along which dimension, out of how many: for loading, saving and init.
    if (tp_) {
      for (const std::string& name : {names_.embed, names_.head}) shards_[name] = {0, config_.vocab_size, {}, tp_};
      for (const auto& l : linears()) {
        if (!l.layer) continue;
        const TensorShard shard = l.layer->base().shard();
        if (!shard.split()) continue;
        const bool column = shard.style == ParallelStyle::kColumn;
        const auto pieces = column_pieces(l.layer->base());
        shards_[l.name + ".weight"] = {column ? 0 : 1, column ? l.layer->out_features : l.layer->in_features, pieces, tp_};
        if (column) shards_[l.name + ".bias"] = {0, l.layer->out_features, pieces, tp_};
      }
      // A sparse layer's experts split by their hidden units, as a dense MLP's (DecoderLayer): gate's
      // and up's each, or a run of interleaved pairs. down's bias is whole on every rank.
      const std::int64_t units = config_.moe.expert_intermediate_size;
      for (std::size_t i = 0; i < blocks_.size(); ++i)
        if (const Experts* e = blocks_[i].experts.get()) {
          const std::vector<std::int64_t> halves = e->activation().interleaved ? std::vector<std::int64_t>{} : std::vector<std::int64_t>{units, units};
          shards_[stacked_name(i, ".gate_up_proj")] = {1, 2 * units, halves, tp_};
          shards_[stacked_name(i, ".down_proj")] = {2, units, {}, tp_};
          if (e->bias(false).defined()) shards_[stacked_name(i, ".gate_up_proj_bias")] = {1, 2 * units, halves, tp_};
        }
      // Weights split with the heads they span (OLMo 2's q/k norms), as their blocks declared.
      for (std::size_t i = 0; i < blocks_.size(); ++i)
        for (const auto& w : blocks_[i].weights)
          if (w.split) shards_[names_.layers + std::to_string(i) + "." + w.name] = {0, w.shape[0], {}, tp_};
    }
    // Under expert parallelism each sparse layer's stacked experts by expert.
    if (ep_)
      for (std::size_t i = 0; i < blocks_.size(); ++i)
        if (const Experts* e = blocks_[i].experts.get()) {
          std::vector<std::string> parts{".gate_up_proj", ".down_proj"};
          if (e->bias(false).defined()) parts.insert(parts.end(), {".gate_up_proj_bias", ".down_proj_bias"});
          for (const auto& part : parts) shards_[stacked_name(i, part)] = {0, config_.moe.num_experts, {}, ep_};
        }
  }

  // Split over the tensor group (the experts' split over the expert group is ExpertShards').
  int shard_dim(const std::string& name) const override {
    const auto it = shards_.find(name);
    return it == shards_.end() || it->second.group != tp_ ? -1 : it->second.dim;
  }

  ExpertsHeld experts_held(const std::string& name) const override {
    const auto it = shards_.find(name);
    const bool shared = it != shards_.end() && ep_ != nullptr && it->second.group == ep_;
    return shared ? ExpertsHeld{first_expert(), config_.moe.num_experts, ep_} : ExpertsHeld{};
  }
  // The first of the experts this rank holds.
  std::int64_t first_expert() const { return ep_ ? ep_->rank() * (config_.moe.num_experts / ep_->size()) : 0; }

  at::Tensor loss_sum(const at::Tensor& head_output, const at::Tensor& labels) override {
    if (deferred(head_output))  // the family's multiplier and soft-cap applied a slice at a time (over a split vocabulary too)
      return vocab_.loss_sum_from_hidden(head_output, head_, labels, head_form());
    return vocab_.loss_sum(head_output, labels);
  }
  at::Tensor logits(const at::Tensor& head_output) override {
    if (deferred(head_output)) return vocab_.logits(head_logits(vocab_.head(head_output, head_), head_form()));
    return vocab_.logits(head_output);
  }
  at::Tensor token_logps(const at::Tensor& head_output, const at::Tensor& labels, double temperature) override {
    if (!deferred(head_output)) return at::Tensor();  // logits already: the host's composite reads them
    return vocab_.logps_from_hidden(head_output, head_, labels, head_form(), temperature);
  }
  // What the family does to the head's product: its multiplier and soft-cap.
  HeadLogits head_form() const { return {config_.logit_multiplier, config_.final_logit_softcap}; }

  // Whether the head leaves its product to loss_sum, token_logps and logits: a head (whole, or
  // split by its vocabulary rows) that takes no gradient in this pass, where
  // decoder_loss_from_head_input says so, in any pass but a cached one's single positions (a decode
  // step's few rows take their own product kernels); a head's input is told from logits by its
  // width, so neither the vocabulary nor this rank's rows of it may be as wide. Evaluation,
  // reference passes and a prompt's chunks then make the logits they need, not every position's.
  // (A checkpointed head would recompute differently from its first pass: only layers are.)
  bool defers_head(const ForwardState& s) const {
    return head_.size(0) != config_.hidden_size && (s.cache == nullptr || s.hidden.size(1) > 1) &&
           !(at::GradMode::is_enabled() && head_.requires_grad()) && decoder_loss_from_head_input(config_, head_.scalar_type() == at::kHalf);
  }
  bool deferred(const at::Tensor& head_output) const {
    return config_.hidden_size != config_.vocab_size && head_.size(0) != config_.hidden_size && head_output.dim() == 3 &&
           head_output.size(2) == config_.hidden_size;
  }

  std::size_t block_count() const override { return blocks_.size() + 3; }
  bool held(std::size_t block) const { return devices_[block].has_value(); }

  void forward(std::size_t index, ForwardState& s) override {
    const std::size_t layers = blocks_.size();
    if (!held(index)) throw std::logic_error("decoder: block " + std::to_string(index) + " is not held by this rank");
    if (index == 0) {
      s.hidden = vocab_.embed(embed_, s.hidden);
      if (embed_scale_ != 1.0) s.hidden = s.hidden * embed_scale_;
      if (config_.embedding_multiplier != 1.0) s.hidden = s.hidden * config_.embedding_multiplier;
    } else if (index <= layers) {
      run_layer(index - 1, s, nullptr);
    } else if (index == layers + 1) {
      s.hidden = final_norm_(s.hidden);
    } else {
      // Training with a frozen head: the head's output is its input, and loss_sum makes the logits
      // a slice of rows at a time (next_token_loss_sum_from_hidden), never whole.
      if (defers_head(s)) return;
      // A decode step's few rows: the head's product in loom's kernel (a tensor rank's share is local).
      at::Tensor logits = few_row_linear(s.hidden, head_);
      s.hidden = head_logits(logits.defined() ? logits : vocab_.head(s.hidden, head_), head_form());
    }
  }

  void forward_cached(std::size_t index, ForwardState& s, CachedPass& pass) override {
    const std::size_t layers = blocks_.size();
    if (index == 0 || index > layers) return forward(index, s);
    if (!held(index)) throw std::logic_error("decoder: block " + std::to_string(index) + " is not held by this rank");
    if (pass.cache == nullptr || !pass.columns.defined()) throw std::logic_error("decoder: a cached pass without its cache or columns");
    run_layer(index - 1, s, &pass);
  }

  // Layer `layer`'s block over the state's hidden, through `cached`'s cache where given. Rotary
  // tables and the attention pattern are made at the first layer a rank runs in a pass and carried
  // in the state to the others; each layer takes those of its kind (global or sliding).
  void run_layer(std::size_t layer, ForwardState& s, CachedPass* cached) {
    if (s.cache != nullptr) throw std::logic_error("decoder: SDK 3.0's growing cache is not served (StaticCacheDecoding decodes)");
    if (!s.pass.count("cos")) {
      if (cached != nullptr) prepare_cached_pass(s, *cached);
      else prepare_pass(s);
    }
    const AttentionSegments segments = pass_segments(s);
    LayerPass pass;
    pass.layer = layer;
    pass.window = layer_window(config_, layer);
    const bool local = pass.window > 0;
    pass.cos = of_kind(s, "cos", local);
    pass.sin = of_kind(s, "sin", local);
    pass.allowed = of_kind(s, "allowed", local);
    pass.attention_mask = s.attention_mask;
    pass.tensor_group = tp_;
    if (segments.offsets.defined()) pass.segments = &segments;
    if (cached != nullptr) {
      pass.cache = cached->cache;
      pass.cache_rows = s.pass.at("cache_rows");
      pass.cache_columns = s.pass.at("cache_columns");
      pass.read_rows = s.pass["read_rows"];
      pass.fresh = cached->fresh;
      // The ring's slots, where prepare_cached_pass made them (a window shorter than the cache).
      if (local && s.pass.count("ring_slots") > 0) {
        pass.ring_slots = s.pass.at("ring_slots");
        if (!cached->fresh) pass.ring_allowed = s.pass.at("ring_allowed");
      }
    }
    // The load-balancing loss's sums travel with the pass, from sparse layer to sparse layer.
    const bool counted = cached == nullptr && blocks_[layer].experts && config_.moe.aux_loss && at::GradMode::is_enabled();
    RouterSums sums = counted ? pass_sums(s) : RouterSums{};
    if (counted) {
      pass.router_sums = &sums;
      pass.token_mask = s.attention_mask;
    }
    s.hidden = blocks_[layer].block->forward(s.hidden, pass);
    if (counted) {
      s.pass["router_picks"] = sums.picks;
      s.pass["router_probabilities"] = sums.probabilities;
      s.pass["router_rows"] = sums.rows;
    }
  }

  static RouterSums pass_sums(const ForwardState& s) {
    const auto picks = s.pass.find("router_picks");
    if (picks == s.pass.end()) return {};
    return {picks->second, s.pass.at("router_probabilities"), s.pass.at("router_rows")};
  }

  std::string auxiliary_loss_name() const override { return config_.moe.aux_loss ? "aux_loss" : ""; }
  double auxiliary_loss_weight() const override { return config_.moe.aux_loss_coef; }
  at::Tensor auxiliary_loss(const ForwardState& s) override {
    const RouterSums sums = pass_sums(s);
    return config_.moe.aux_loss && sums.picks.defined() ? load_balancing_loss(sums) : at::Tensor();
  }

  std::vector<NamedExperts> expert_weights() override {
    std::vector<NamedExperts> out;
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      if (!layer_is_sparse(config_, i)) continue;
      Experts* e = blocks_[i].experts.get();
      out.push_back({stacked_name(i, ".gate_up_proj"), i + 1, e ? e->stacked(false) : at::Tensor(), e ? &e->gate_up_delta : nullptr});
      out.push_back({stacked_name(i, ".down_proj"), i + 1, e ? e->stacked(true) : at::Tensor(), e ? &e->down_delta : nullptr});
    }
    return out;
  }

  // A sparse layer's stacked tensor under its in-memory name: `part` ".gate_up_proj" or ".down_proj".
  std::string stacked_name(std::size_t layer, const std::string& part) const { return names_.layers + std::to_string(layer) + "." + names_.experts + part; }

  // A pass tensor for a layer of one kind: a sliding layer's own ("allowed_local", "cos_local")
  // where the pass made one, else what every layer shares.
  static const at::Tensor& of_kind(ForwardState& s, const std::string& name, bool local) {
    if (local)
      if (const auto it = s.pass.find(name + "_local"); it != s.pass.end()) return it->second;
    return s.pass.at(name);
  }

  // Rotary tables and the attention pattern are the same for every layer of one kind in a pass:
  // made at the first decoder layer a rank runs and carried in the state to the others.
  void prepare_pass(ForwardState& s, std::int64_t cache_capacity = 0) {
    set_rotary(s, cache_capacity);
    const auto len = s.hidden.size(1), keys = s.attention_mask.size(1);
    // A window hides keys only from a query more than `window` columns past them.
    const std::int64_t window = config_.sliding_window > 0 && keys > config_.sliding_window ? config_.sliding_window : 0;
    // Nothing padded, nothing cached: plain causal attention (undefined pattern), which SDPA runs
    // on its fastest kernel. Packed rows (mask values past 1 number samples, PackedSequences) are
    // not plain: attention_allowed keeps each sample to itself. Decided once per pass: one read of
    // the mask's range.
    const bool whole = s.cache == nullptr && keys == len;
    const at::Tensor range = whole ? at::stack({s.attention_mask.min(), s.attention_mask.max()}).cpu() : at::Tensor();
    const bool plain = whole && range[0].item<std::int64_t>() == 1 && range[1].item<std::int64_t>() == 1;
    // Padded, packed or windowed rows on a GPU: each sample (and each run of padding) attends
    // within itself, and within its window, through variable-length flash attention, with no
    // [T, T] pattern and no work across samples.
    if (whole && (!plain || window > 0) && segment_attention_serves(s.hidden, config_.head_dim, window > 0)) {
      const AttentionSegments segments = attention_segments(s.attention_mask);
      if (segments.offsets.defined()) {
        s.pass["segment_offsets"] = segments.offsets;
        s.pass["longest_segment"] = at::scalar_tensor(segments.longest, at::kLong);  // on the host
        s.pass["allowed"] = at::Tensor();
        return;
      }
    }
    s.pass["allowed"] = plain ? at::Tensor() : attention_allowed(s.attention_mask, len);
    if (window > 0) s.pass["allowed_local"] = attention_allowed(s.attention_mask, len, window);
  }

  static AttentionSegments pass_segments(const ForwardState& s) {
    const auto offsets = s.pass.find("segment_offsets");
    if (offsets == s.pass.end()) return {};
    return {offsets->second, s.pass.at("longest_segment").item<std::int64_t>()};
  }

  // `cache_capacity`: a cached pass's, whose positions all lie below it (0: uncached).
  void set_rotary(ForwardState& s, std::int64_t cache_capacity = 0) {
    // HF computes the angles in fp32, scales cos/sin by the attention factor and casts them to the
    // activations' dtype. cos/sin span rotary_dim; apply_rotary leaves a head's other dimensions be.
    std::optional<std::int64_t> extent;
    for (const auto& [kind, suffix] : {std::pair<int, const char*>{0, ""}, {1, "_local"}}) {
      if (!inv_freq_cpu_[kind][0].defined()) continue;
      const RopeSettings& rope = kind == 0 ? config_.rope : *config_.local_rope;
      // longrope takes its long factors for a sequence past the original context, as transformers
      // decides it a pass (its largest position); a cached pass by its capacity, so a generation's
      // every token turns alike (transformers recomputes its cache on crossing, to the same end).
      bool long_context = false;
      if (rope.type == "longrope") {
        if (!extent) extent = cache_capacity > 0 ? cache_capacity : s.position_ids.max().item<std::int64_t>() + 1;
        long_context = *extent > rope.original_max_positions;
      }
      const at::Tensor freqs = s.position_ids.to(at::kFloat).unsqueeze(-1) * inv_freq(kind, long_context, s.hidden.device()).view({1, 1, -1});
      const at::Tensor angles = at::cat({freqs, freqs}, -1);
      at::Tensor cos = angles.cos(), sin = angles.sin();
      if (rope.attention_factor != 1.0) {
        cos = cos * rope.attention_factor;
        sin = sin * rope.attention_factor;
      }
      s.pass[std::string("cos") + suffix] = cos.to(s.hidden.scalar_type());
      s.pass[std::string("sin") + suffix] = sin.to(s.hidden.scalar_type());
    }
  }

  // The same for a pass through a StaticKVCache; the cache's indices travel with the pass too. A
  // fresh pass attends among its own tokens as an uncached one does; a later one sees the columns
  // its mask marks up to each token's own (and, in a sliding layer, within its window).
  void prepare_cached_pass(ForwardState& s, const CachedPass& pass) {
    const auto device = s.hidden.device();
    const auto batch = s.hidden.size(0), len = s.hidden.size(1);
    const at::Tensor columns = pass.columns.to(device);
    if (columns.dim() != 2 || columns.size(0) != batch || columns.size(1) != len)
      throw std::logic_error("decoder: cache columns of shape " + shape_text(columns.sizes().vec()) + " for a pass of " + std::to_string(batch) + "x" +
                             std::to_string(len) + " tokens");
    s.pass["cache_columns"] = columns;
    s.pass["cache_rows"] = (pass.rows.defined() ? pass.rows.to(device) : at::arange(batch, columns.options())).view({batch, 1}).expand({batch, len});
    if (pass.rows.defined() && !pass.fresh) s.pass["read_rows"] = pass.rows.to(device);
    const std::int64_t window = config_.sliding_window;
    const bool ring = window > 0 && pass.cache->capacity > window;
    if (ring) s.pass["ring_slots"] = at::remainder(columns, window);
    if (pass.fresh) return prepare_pass(s, pass.cache->capacity);  // state.cache is null: the pattern of an uncached pass
    set_rotary(s, pass.cache->capacity);
    const auto capacity = s.attention_mask.size(1);
    const at::Tensor key_column = at::arange(capacity, columns.options()).view({1, 1, 1, capacity});
    // A token always sees its own column, as in attention_allowed(): a padding token of a later
    // prompt chunk sees no real one, and must not softmax over nothing (NaN keys and values).
    const at::Tensor own = columns.view({batch, 1, len, 1});
    const at::Tensor real = s.attention_mask.to(at::kBool);
    s.pass["allowed"] = (real.view({batch, 1, 1, capacity}) & (key_column <= own)) | (key_column == own);
    if (ring) s.pass["ring_allowed"] = ring_allowed(real, columns, window);
  }

  // What a sliding layer's queries see of its ring (LayerPass::ring_allowed) from the columns holding a
  // real token (`real` [B, capacity]) and the pass's columns [B, T], which follow one another in
  // each row (a prompt's chunk, a decode step). Slot j holds the latest column at or before
  // `last` that is j modulo the window (negative: none yet).
  static at::Tensor ring_allowed(const at::Tensor& real, const at::Tensor& columns, std::int64_t window) {
    const auto batch = columns.size(0), len = columns.size(1);
    const at::Tensor slot = at::arange(window, columns.options()).view({1, window});
    const auto held_at = [&](const at::Tensor& last) { return last.view({batch, 1}) - at::remainder(last.view({batch, 1}) - slot, window); };
    const auto is_real = [&](const at::Tensor& held) { return (held >= 0) & real.gather(1, held.clamp_min(0)); };
    const at::Tensor first = columns.select(1, 0);
    // A decode step writes first: its own slot then holds it, the others the window before it.
    if (len == 1) return is_real(held_at(first)).view({batch, 1, 1, window});
    const at::Tensor held = held_at(first - 1);                                        // [B, W]
    const at::Tensor query = columns.view({batch, len, 1});
    const at::Tensor before = is_real(held).view({batch, 1, window}) & (held.view({batch, 1, window}) > query - window);
    const at::Tensor key = columns.view({batch, 1, len});
    const at::Tensor own = ((key <= query) & (key > query - window) & real.gather(1, columns).view({batch, 1, len})) | (key == query);
    return at::cat({before, own}, 2).view({batch, 1, len, window + len});
  }

  std::vector<NamedParameter> parameters() override {
    std::vector<NamedParameter> out;
    const std::size_t head = blocks_.size() + 2;
    if (held(0)) out.push_back({names_.embed, 0, embed_});
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      if (!blocks_[i].block) continue;
      const std::string prefix = names_.layers + std::to_string(i) + ".";
      for (const auto& w : blocks_[i].weights) out.push_back({prefix + w.name, i + 1, w.tensor});
      if (const Experts* e = blocks_[i].experts.get()) {
        out.push_back({prefix + names_.router + ".weight", i + 1, e->router});
        if (!e->stored(false)) out.push_back({stacked_name(i, ".gate_up_proj"), i + 1, e->stacked(false)});
        if (!e->stored(true)) out.push_back({stacked_name(i, ".down_proj"), i + 1, e->stacked(true)});
        if (e->bias(false).defined()) out.push_back({stacked_name(i, ".gate_up_proj_bias"), i + 1, e->bias(false)});
        if (e->bias(true).defined()) out.push_back({stacked_name(i, ".down_proj_bias"), i + 1, e->bias(true)});
      }
      for (const auto& [name, linear] : blocks_[i].linears)
        for (const auto& [suffix, tensor] : linear->stored()) out.push_back({prefix + name + "." + suffix, i + 1, tensor});
    }
    if (held(head - 1)) out.push_back({names_.final_norm, head - 1, final_norm_.weight});
    if (held(head - 1) && final_norm_.bias.defined()) out.push_back({final_norm_bias_name(), head - 1, final_norm_.bias});
    if (held(head) && !config_.tie_word_embeddings) out.push_back({names_.head, head, head_});
    if (held(head) && config_.tie_word_embeddings && !held(0)) out.push_back({names_.embed, head, head_});
    return out;
  }

  std::vector<NamedLinear> linears() override {
    std::vector<NamedLinear> out;
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      const std::string prefix = names_.layers + std::to_string(i) + ".";
      if (blocks_[i].block)
        for (const auto& [name, linear] : blocks_[i].linears) out.push_back({prefix + name, i + 1, linear.get()});
      else
        for (const auto& name : blocks_[i].others_linears) out.push_back({prefix + name, i + 1, nullptr});
    }
    return out;
  }

  // Every linear's adapter (its dropout) follows.
  void set_training(bool training) override {
    for (const auto& b : blocks_)
      for (const auto& [name, linear] : b.linears) linear->train(training);
  }

  // The final norm's bias (a LayerNorm's) beside its weight: "....weight" becomes "....bias".
  std::string final_norm_bias_name() const {
    const std::string& w = names_.final_norm;
    return (ends_with(w, "weight") ? w.substr(0, w.size() - 6) : w + ".") + "bias";
  }

  void save_pretrained(const fs::path& dir) override {
    const bool writes = !(tp_ && tp_->rank() != 0) && !(ep_ && ep_->rank() != 0);
    if (!stored_stacks().empty())
      throw UserError("saving a model whose experts are stored 4-bit: transformers has no 4-bit layout for stacked experts; save the adapter "
                      "and merge it into the full-precision model with `loom export` (an [adapter] plugin = \"lora\" pipeline), or train with lora");
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& p : parameters()) {
      if (const auto layer = linear_part(p.name).first;
          tp_ && layer && layer->base().shard().split() && dynamic_cast<DenseWeight*>(&held_weight(layer->base())) == nullptr)
        throw UserError("saving a 4-bit base split over tensor ranks as its 4-bit parts (" + p.name +
                        "): each rank quantized its own part; merge the adapter into a dense copy instead");
      const auto it = shards_.find(p.name);
      at::Tensor whole = p.tensor;
      if (it != shards_.end()) {
        // Gathered whole onto the host at once: a model split to fit never holds it whole on a GPU,
        // and only the rank that writes keeps it.
        whole = it->second.whole(p.tensor);
        if (!writes) continue;
        whole = whole.to(at::kCPU);
      }
      if (writes) add_as_on_disk(p.name, whole, tensors);
    }
    if (!writes) return;
    fs::create_directories(dir);
    write_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
    write_file_atomically(dir / "config.json", decoder_config_json(family_, config_));
  }

  // A tensor under its name on disk: a sparse layer's router under the family's name for it, its
  // stacked experts one tensor per expert's linear (as published checkpoints and transformers 5's
  // save_pretrained hold them); anything else as it is.
  void add_as_on_disk(const std::string& name, const at::Tensor& t, std::vector<std::pair<std::string, at::Tensor>>& out) const {
    const auto [layer, rest] = layer_of(name);
    const auto& moe = family_.moe;
    const std::string prefix = names_.layers + std::to_string(layer) + ".";
    const bool sparse = layer >= 0 && moe.enabled && layer_is_sparse(config_, static_cast<std::size_t>(layer));
    const bool gate_up = sparse && rest == names_.experts + ".gate_up_proj", down = sparse && rest == names_.experts + ".down_proj";
    if ((gate_up || down) && moe.stacked_transposed) {  // whole, [E, in, out]
      out.emplace_back(name, t.transpose(1, 2).contiguous());
      return;
    }
    if (!gate_up && !down) {
      if (const BlockWeight* w = rows_apart(name)) {  // each row under its own name
        const auto at = w->rows_apart.find("{}");
        for (std::int64_t r = 0; r < t.size(0); ++r)
          out.emplace_back(prefix + w->rows_apart.substr(0, at) + std::to_string(r) + w->rows_apart.substr(at + 2), t[r]);
        return;
      }
      out.emplace_back(sparse && rest == names_.router + ".weight" ? prefix + moe.disk_router + ".weight" : name, t);
      return;
    }
    const std::int64_t units = config_.moe.expert_intermediate_size;
    for (std::int64_t e = 0; e < t.size(0); ++e) {
      const std::string expert = prefix + moe.disk_experts + std::to_string(e) + ".";
      if (down) {
        out.emplace_back(expert + moe.down + ".weight", t[e]);
      } else {
        out.emplace_back(expert + moe.gate + ".weight", t[e].narrow(0, 0, units));
        out.emplace_back(expert + moe.up + ".weight", t[e].narrow(0, units, units));
      }
    }
  }

  // The weight a block registered under `name` (its in-memory name) whose rows the checkpoint holds
  // apart; null for any other.
  const BlockWeight* rows_apart(const std::string& name) const {
    const auto [layer, rest] = layer_of(name);
    if (layer < 0) return nullptr;
    for (const auto& w : blocks_[static_cast<std::size_t>(layer)].weights)
      if (!w.rows_apart.empty() && w.name == rest) return &w;
    return nullptr;
  }

  // A checkpoint tensor that is one row of such a weight: the weight's in-memory name and the row;
  // nullopt for any other.
  std::optional<std::pair<std::string, std::int64_t>> row_of(const std::string& name) const {
    const auto [layer, rest] = layer_of(name);
    if (layer < 0) return std::nullopt;
    for (const auto& w : blocks_[static_cast<std::size_t>(layer)].weights) {
      if (w.rows_apart.empty()) continue;
      const auto at = w.rows_apart.find("{}");
      const std::string head = w.rows_apart.substr(0, at), tail = w.rows_apart.substr(at + 2);
      if (rest.size() <= head.size() + tail.size() || rest.compare(0, head.size(), head) != 0 ||
          rest.compare(rest.size() - tail.size(), tail.size(), tail) != 0)
        continue;
      const std::string digits = rest.substr(head.size(), rest.size() - head.size() - tail.size());
      if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
      return std::pair{names_.layers + std::to_string(layer) + "." + w.name, std::stoll(digits)};
    }
    return std::nullopt;
  }

  // The decoder layer a tensor's name is under and the rest of its name; {-1, ""} for another.
  std::pair<std::int64_t, std::string> layer_of(const std::string& name) const {
    const std::string& prefix = names_.layers;
    if (name.compare(0, prefix.size(), prefix) != 0) return {-1, ""};
    std::size_t at = prefix.size();
    std::int64_t layer = 0;
    while (at < name.size() && std::isdigit(static_cast<unsigned char>(name[at])) && layer < kMaxLayers) layer = layer * 10 + (name[at++] - '0');
    if (at == prefix.size() || at >= name.size() || name[at] != '.' || layer >= config_.num_hidden_layers) return {-1, ""};
    return {layer, name.substr(at + 1)};
  }

  // One expert's linear in a checkpoint: its layer, the expert and which (0 gate, 1 up, 2 down).
  struct ExpertPart {
    std::size_t layer = 0;
    std::int64_t expert = 0;
    int which = 0;
  };
  std::optional<ExpertPart> expert_part(const std::string& name) const {
    const auto& moe = family_.moe;
    const auto [layer, rest] = layer_of(name);
    if (layer < 0 || !moe.enabled || rest.compare(0, moe.disk_experts.size(), moe.disk_experts) != 0) return std::nullopt;
    std::size_t at = moe.disk_experts.size();
    std::int64_t expert = 0;
    const std::size_t digits = at;
    while (at < rest.size() && std::isdigit(static_cast<unsigned char>(rest[at])) && expert < kMaxDimension) expert = expert * 10 + (rest[at++] - '0');
    if (at == digits || at >= rest.size() || rest[at] != '.') return std::nullopt;
    const std::string linear = rest.substr(at + 1);
    const std::array<const std::string*, 3> linears{&moe.gate, &moe.up, &moe.down};
    for (int which = 0; which < 3; ++which)
      if (linear == *linears[static_cast<std::size_t>(which)] + ".weight") return ExpertPart{static_cast<std::size_t>(layer), expert, which};
    return std::nullopt;
  }

  // A tensor's in-memory name from its name on disk (a sparse layer's router under the family's
  // name for it); any other as it is.
  std::string memory_name(const std::string& name) const {
    const auto [layer, rest] = layer_of(name);
    if (layer >= 0 && family_.moe.enabled && rest == family_.moe.disk_router + ".weight") return names_.layers + std::to_string(layer) + "." + names_.router + ".weight";
    return name;
  }

  // One expert's linear from a checkpoint into its layer's stacked tensor (this rank's units of it
  // under tensor parallelism). Returns the stacked tensor's name; "" for an expert another rank of
  // the expert group holds (checked all the same, nothing read).
  std::string read_expert_part(const SafetensorsFile& file, const SafetensorInfo& info, const ExpertPart& part) {
    const std::string where = file.path().string() + ": tensor '" + info.name + "' ";
    Experts* layer = blocks_[part.layer].experts.get();
    if (layer == nullptr) throw UserError(where + "is an expert's weight, but layer " + std::to_string(part.layer) + " is dense in this config");
    if (part.expert >= config_.moe.num_experts)
      throw UserError(where + "is expert " + std::to_string(part.expert) + "'s; the config has " + std::to_string(config_.moe.num_experts) + " (num_experts)");
    const std::int64_t units = config_.moe.expert_intermediate_size, hidden = config_.hidden_size;
    const std::vector<std::int64_t> shape = part.which == 2 ? std::vector<std::int64_t>{hidden, units} : std::vector<std::int64_t>{units, hidden};
    if (info.shape != shape) throw UserError(where + "has shape " + shape_text(info.shape) + ", the config implies " + shape_text(shape));
    const std::int64_t expert = part.expert - first_expert();
    if (expert < 0 || expert >= layer->stacked(true).size(0)) return "";
    at::Tensor t = file.tensor(info.name);
    if (tp_) t = part_of_pieces(t, part.which == 2 ? 1 : 0, {}, tp_->rank(), tp_->size());
    const std::int64_t mine = layer->stacked(true).size(2);
    const at::Tensor stacked = layer->stacked_values(part.which == 2);
    at::Tensor into = part.which == 2 ? stacked[expert] : stacked[expert].narrow(0, part.which == 0 ? 0 : mine, mine);
    into.copy_(t);
    return stacked_name(part.layer, part.which == 2 ? ".down_proj" : ".gate_up_proj");
  }

  void init_random(std::uint64_t seed) {
    torch::NoGradGuard no_grad;
    // HF's initializer_range: N(0, 0.02) for matrices, ones for norms, zeros for biases. Each
    // tensor draws from a seed of its own name, so its values do not depend on which device or
    // rank the plan put it on, nor on which other blocks that rank holds. The draws come from a
    // private generator of the device's kind (seeded as at::manual_seed would seed the shared one):
    // loading leaves the process's generators alone, so ranks loading side by side in one process
    // (the tests' threads) draw alike.
    const auto generator_for = [&](const std::string& name, const c10::Device& device) {
      std::uint64_t name_hash = 1469598103934665603ull;  // FNV-1a
      for (unsigned char ch : name) name_hash = (name_hash ^ ch) * 1099511628211ull;
      at::Generator shared = at::globalContext().defaultGenerator(device);
      at::Generator own;
      {
        std::lock_guard<std::mutex> lock(shared.mutex());
        own = shared.clone();
      }
      own.set_current_seed((seed * 1000003 + name_hash) & 0x7fffffffffffffffull);
      return own;
    };
    for (auto& p : parameters()) {
      if (linear_part(p.name).first) continue;  // a linear's weight: below
      const auto& n = p.name;
      if (const auto fill = constant_init(n)) p.tensor.fill_(*fill);
      else if (const auto it = shards_.find(n); it != shards_.end())  // the whole tensor one device would draw, then this rank's part
        p.tensor.copy_(
            it->second.part(at::empty(full_shape(p.name, p.tensor), p.tensor.options()).normal_(0.0, 0.02, generator_for(n, p.tensor.device()))));
      else p.tensor.normal_(0.0, 0.02, generator_for(n, p.tensor.device()));
    }
    // Stored experts likewise: drawn whole, this rank's part handed over.
    for (const auto& [n, stack] : stored_stacks()) {
      const at::Tensor& local = stack.layer->stacked(stack.down);
      const at::Tensor whole = at::empty(full_shape(n, local), local.options()).normal_(0.0, 0.02, generator_for(n, local.device()));
      const auto s = shards_.find(n);
      stack.layer->finish_stacked(stack.down, s == shards_.end() ? whole : s->second.part(whole));
    }
    // Each linear's weight is drawn whole, as one device draws it, and handed to the layer's weight
    // (a split one keeps its part, a 4-bit one quantizes it at once): one matrix at a time.
    for (const auto& [name, layer] : linear_of_) {
      const std::string key = name + ".weight";
      const auto options = layer->options();
      const at::Tensor whole = at::empty({layer->out_features, layer->in_features}, options).normal_(0.0, 0.02, generator_for(key, options.device()));
      const auto s = shards_.find(key);
      layer->base().assign("weight", s == shards_.end() ? whole : s->second.part(whole));
    }
  }

  // What a tensor holds at random init when that is a constant: the value a block registered its
  // weight with (norms' scales 1, biases 0), the final norm's identity, any other bias 0.
  std::optional<float> constant_init(const std::string& name) const {
    if (name == names_.final_norm) return norm_identity(family_.norm_form);
    if (const auto [layer, rest] = layer_of(name); layer >= 0)
      for (const auto& w : blocks_[static_cast<std::size_t>(layer)].weights)
        if (w.name == rest) return w.init;
    if (ends_with(name, ".bias") || ends_with(name, "_bias")) return 0.0f;  // a linear's, or stacked experts' (gate_up_proj_bias)
    return std::nullopt;
  }

  // The linear held here whose weight `name` is a part of ("...q_proj.weight", or a 4-bit part
  // such as "...q_proj.weight.absmax"), with the part's suffix; {null, ""} for anything else.
  std::pair<AdaptableLinear*, std::string> linear_part(const std::string& name) const {
    const auto at = name.find(".weight");
    if (at == std::string::npos) return {nullptr, ""};
    const auto it = linear_of_.find(name.substr(0, at));
    if (it == linear_of_.end()) return {nullptr, ""};
    return {it->second, name.substr(at + 1)};
  }

  std::vector<std::int64_t> full_shape(const std::string& name, const at::Tensor& local) const {
    const auto it = shards_.find(name);
    return it == shards_.end() ? local.sizes().vec() : it->second.whole_shape(local);
  }

  void load_checkpoint(const fs::path& folder) {
    std::map<std::string, at::Tensor> wanted;  // every parameter but the linears' weights
    for (const auto& p : parameters())
      if (!linear_part(p.name).first) wanted.emplace(p.name, p.tensor);
    // Stored experts (4-bit) are wanted too, their tensors giving the shapes.
    const auto stored = stored_stacks();
    for (const auto& [name, stack] : stored) wanted.emplace(name, stack.layer->stacked(stack.down));
    std::set<std::string> loaded, linears_read;
    std::map<std::string, std::int64_t> rows_read;  // a weight held row by row: the rows read
    std::map<std::string, std::set<std::int64_t>> expert_parts;  // a stacked tensor's experts' linears read (expert * 3 + which)
    std::map<std::string, std::pair<at::Tensor, at::Tensor>> mxfp4_read;  // an MXFP4 weight's blocks and scales, until both are read
    torch::NoGradGuard no_grad;
    for (const auto& shard : shard_files(folder)) {
      SafetensorsFile file(shard);  // one shard mapped at a time: peak host memory is about one shard
      for (const auto& info : file.tensors()) {
        const auto name = wrapper_name(info.name);  // the family's own name of a wrapper folder's tensor
        if (!name) continue;                        // the wrapper's other parts (a vision tower)
        if (const auto part = expert_part(*name)) {
          if (held_elsewhere(*name)) continue;
          const std::string stacked = read_expert_part(file, info, *part);
          if (stacked.empty()) continue;
          // A stacked tensor read expert by expert is whole when every expert's linears were read
          // (a stored one then takes its values).
          auto& parts = expert_parts[stacked];
          parts.insert(part->expert * 3 + part->which);
          const bool down = part->which == 2;
          Experts& experts = *blocks_[part->layer].experts;
          if (parts.size() == static_cast<std::size_t>(experts.stacked(true).size(0) * (down ? 1 : 2)) && loaded.insert(stacked).second)
            experts.finish_stacked(down);
          continue;
        }
        if (const auto row = row_of(*name)) {  // one row of a weight the checkpoint holds row by row
          const auto it = wanted.find(row->first);
          if (it == wanted.end()) {
            if (held_elsewhere(*name)) continue;
            throw UserError(shard.string() + ": unexpected tensor '" + info.name + "' for a " + config_.model_type + " model of this config");
          }
          const auto whole = full_shape(row->first, it->second);
          const std::vector<std::int64_t> row_shape(whole.begin() + 1, whole.end());
          if (row->second >= whole[0] || info.shape != row_shape)
            throw UserError(shard.string() + ": tensor '" + info.name + "' is row " + std::to_string(row->second) + " of shape " + shape_text(info.shape) +
                            "; the config implies " + std::to_string(whole[0]) + " rows of " + shape_text(row_shape));
          // Under tensor parallelism this rank keeps its rows only.
          const auto s = shards_.find(row->first);
          const ShardRange mine = s == shards_.end() ? ShardRange{0, whole[0]} : s->second.range();
          if (row->second >= mine.start && row->second < mine.start + mine.length) it->second[row->second - mine.start].copy_(file.tensor(info.name));
          if (++rows_read[row->first] == whole[0]) loaded.insert(row->first);
          continue;
        }
        if (const auto [layer, suffix] = linear_part(*name); layer) {
          read_linear_part(file, info, *name, *layer, suffix);
          linears_read.insert(name->substr(0, name->size() - suffix.size() - 1));
          continue;
        }
        // An MXFP4 stacked experts weight: its blocks and scales, dequantized once both are read.
        std::optional<at::Tensor> unpacked;
        std::string disk_name = *name;
        if (const auto packed = mxfp4_part(*name)) {
          if (held_elsewhere(*name)) continue;
          const auto whole = wanted.find(packed->first);
          if (whole == wanted.end())
            throw UserError(shard.string() + ": unexpected tensor '" + info.name + "' for a " + config_.model_type + " model of this config");
          auto& pair = mxfp4_read[packed->first];
          (packed->second ? pair.second : pair.first) = file.tensor(info.name).clone();  // the file's mapping ends with its shard
          if (!pair.first.defined() || !pair.second.defined()) continue;
          try {
            unpacked = dequantize_mxfp4(pair.first, pair.second, whole->second.scalar_type());
          } catch (const UserError& e) {
            throw UserError(shard.string() + ": the MXFP4 tensors '" + packed->first + "_blocks' and '_scales': " + e.what());
          }
          mxfp4_read.erase(packed->first);
          disk_name = packed->first;
        }
        auto it = wanted.find(memory_name(disk_name));
        if (it == wanted.end()) {
          if (ignorable(*name) || held_elsewhere(*name)) continue;
          throw UserError(shard.string() + ": unexpected tensor '" + info.name + "' for a " + config_.model_type + " model of this config");
        }
        const std::string& key = it->first;
        // gpt-oss's stacked experts lie [E, in, out] on disk (MixtureOfExperts::stacked_transposed);
        // MXFP4's as they are held.
        const bool transposed = !unpacked && transposed_on_disk(key);
        auto expected = full_shape(key, it->second);
        if (transposed) std::swap(expected[1], expected[2]);
        const std::vector<std::int64_t> shape = unpacked ? unpacked->sizes().vec() : info.shape;
        if (shape != expected)
          throw UserError(shard.string() + ": tensor '" + (unpacked ? disk_name + "' (MXFP4)" : info.name + "'") + " has shape " + shape_text(shape) +
                          ", the config implies " + shape_text(expected));
        at::Tensor read = unpacked ? *unpacked : file.tensor(info.name);
        if (transposed) read = read.transpose(1, 2);
        // Under tensor or expert parallelism only this rank's slice of the mapping is read.
        const auto s = shards_.find(key);
        const at::Tensor values = s == shards_.end() ? read : s->second.part(read);
        if (const auto stack = stored.find(key); stack != stored.end()) stack->second.layer->finish_stacked(stack->second.down, values);
        else it->second.copy_(values);
        loaded.insert(key);
      }
    }
    for (const auto& [name, pair] : mxfp4_read)
      throw UserError(folder.string() + ": the checkpoint holds " + name + (pair.first.defined() ? "_blocks without its _scales" : "_scales without its _blocks") +
                      " (an MXFP4 weight needs both)");
    std::string missing;
    std::size_t count = 0;
    for (const auto& [name, t] : wanted)
      if (!loaded.count(name) && count++ < 5) missing += (missing.empty() ? "" : ", ") + name;
    for (const auto& [name, layer] : linear_of_)
      if (!linears_read.count(name) && count++ < 5) missing += (missing.empty() ? "" : ", ") + name + ".weight";
    if (count > 0)
      throw UserError(folder.string() + ": the checkpoint lacks " + std::to_string(count) + " tensor(s) the config needs: " + missing +
                      (count > 5 ? ", ..." : ""));
    for (const auto& [name, layer] : linear_of_) {
      try {
        layer->base().finish_load(name);
      } catch (const UserError& e) {
        throw UserError(folder.string() + ": " + e.what());
      }
    }
  }

  // A stacked experts weight the family saves [E, in, out] (its in-memory name).
  bool transposed_on_disk(const std::string& name) const {
    if (!family_.moe.stacked_transposed) return false;
    const auto [layer, rest] = layer_of(name);
    return layer >= 0 && (rest == names_.experts + ".gate_up_proj" || rest == names_.experts + ".down_proj");
  }
  // A checkpoint tensor that is half of an MXFP4 stacked experts weight: the weight's name and
  // whether it is the scales (else the blocks); nullopt for any other.
  std::optional<std::pair<std::string, bool>> mxfp4_part(const std::string& name) const {
    for (const bool scales : {false, true}) {
      const std::string end = scales ? "_scales" : "_blocks";
      if (ends_with(name, end) && transposed_on_disk(name.substr(0, name.size() - end.size())))
        return std::pair{name.substr(0, name.size() - end.size()), scales};
    }
    return std::nullopt;
  }

  // Each stacked experts weight held here that the adapter stores its own way (4-bit), by name.
  struct StoredStack {
    Experts* layer = nullptr;
    bool down = false;
  };
  std::map<std::string, StoredStack> stored_stacks() const {
    std::map<std::string, StoredStack> out;
    for (std::size_t i = 0; i < blocks_.size(); ++i)
      for (const bool down : {false, true})
        if (blocks_[i].experts && blocks_[i].experts->stored(down))
          out[stacked_name(i, down ? ".down_proj" : ".gate_up_proj")] = {blocks_[i].experts.get(), down};
    return out;
  }

  // A tensor's name as the family names it: a wrapper folder's renamed (DecoderFamily::Wrapper),
  // nullopt for one of its parts the model does not load; any other name as it is.
  std::optional<std::string> wrapper_name(const std::string& name) const {
    if (config_.wrapper_type.empty()) return name;
    const auto starts = [&](const std::string& prefix) { return name.compare(0, prefix.size(), prefix) == 0; };
    for (const auto& skipped : family_.wrapper.skipped)
      if (starts(skipped)) return std::nullopt;
    for (const auto& [from, to] : family_.wrapper.renames)
      if (starts(from)) return to + name.substr(from.size());
    return name;
  }

  // One part of a linear's weight from a checkpoint (`name`: the family's name of info's tensor):
  // the whole "weight" (this rank's slice under tensor parallelism) or a part of a 4-bit weight,
  // handed to the layer's weight to keep.
  void read_linear_part(const SafetensorsFile& file, const SafetensorInfo& info, const std::string& name, AdaptableLinear& layer,
                        const std::string& suffix) {
    const std::string where = file.path().string() + ": tensor '" + info.name + "' ";
    const bool floats = info.dtype == "F32" || info.dtype == "F16" || info.dtype == "BF16" || info.dtype == "F64";
    if ((suffix != "weight" || !floats) && dynamic_cast<DenseWeight*>(&layer.base()))
      throw UserError(where + "is a part of a 4-bit weight in bitsandbytes' layout; load this checkpoint with [adapter] plugin = \"qlora\"");
    if (suffix != "weight" && layer.base().shard().split())
      throw UserError(where + "is a part of a 4-bit weight, which loom cannot cut for tensor ranks; load the full-precision folder (the "
                              "qlora adapter quantizes each rank's part as it loads) or leave [parallel] tensor at 1");
    at::Tensor t = file.tensor(info.name);
    if (const auto s = shards_.find(name); s != shards_.end()) {
      const std::vector<std::int64_t> whole = {layer.out_features, layer.in_features};
      if (info.shape != whole) throw UserError(where + "has shape " + shape_text(info.shape) + ", the config implies " + shape_text(whole));
      t = s->second.part(t);
    }
    try {
      layer.base().assign(suffix, t);
    } catch (const UserError& e) {
      throw UserError(where + e.what());
    }
  }

 private:
  // The inverse frequencies of the global (0) or sliding (1) layers' rotary on a device (longrope's
  // long ones for a long context).
  at::Tensor inv_freq(int kind, bool long_context, const c10::Device& device) {
    const std::string key = std::to_string(kind) + (long_context ? "long" : "") + device.str();
    auto it = inv_freq_.find(key);
    if (it == inv_freq_.end()) it = inv_freq_.emplace(key, inv_freq_cpu_[kind][long_context ? 1 : 0].to(device)).first;
    return it->second;
  }

  // A tensor of a block another rank holds.
  bool held_elsewhere(const std::string& name) const {
    const std::size_t layers = blocks_.size();
    if (name == names_.embed) return !held(0) && !(config_.tie_word_embeddings && held(layers + 2));
    if (name == names_.final_norm || name == final_norm_bias_name()) return !held(layers + 1);
    if (name == names_.head) return !held(layers + 2);
    const std::string& prefix = names_.layers;
    if (name.compare(0, prefix.size(), prefix) != 0) return false;
    std::size_t used = 0;
    try {
      const auto layer = std::stoull(name.substr(prefix.size()), &used);
      return used > 0 && layer < layers && !held(layer + 1);
    } catch (const std::exception&) {
      return false;
    }
  }

  bool ignorable(const std::string& name) const {
    // Rotary buffers some writers save, and the family's; lm_head next to tied embeddings.
    for (const auto& end : family_.ignored)
      if (ends_with(name, "." + end)) return true;
    return name.find("rotary_emb.inv_freq") != std::string::npos || (config_.tie_word_embeddings && name == names_.head);
  }

  static std::string shape_text(const std::vector<std::int64_t>& shape) {
    std::string out = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
    return out + "]";
  }

  static std::vector<fs::path> shard_files(const fs::path& folder) {
    const fs::path index = folder / "model.safetensors.index.json";
    std::error_code ec;
    if (fs::exists(index, ec)) {
      const auto j = json::read_file(index, 64u << 20, "shard index");
      const json::Value map = json::Value(j, index.string())["weight_map"];
      std::set<std::string> names;
      for (const auto& [tensor, file] : map.object().items()) {
        const std::string f = map[tensor].string();
        if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") map[tensor].fail("shard name '" + f + "' is not a file in the folder");
        names.insert(f);
      }
      std::vector<fs::path> out;
      for (const auto& n : names) out.push_back(folder / n);
      return out;
    }
    if (fs::exists(folder / "model.safetensors", ec)) return {folder / "model.safetensors"};
    throw UserError(folder.string() + ": no model.safetensors or model.safetensors.index.json (use init = \"random\" to start from scratch)");
  }

  const DecoderFamily& family_;
  const DecoderNames& names_;
  DecoderConfig config_;
  Communicator* tp_ = nullptr;  // the tensor group, when the model is split over one
  Communicator* ep_ = nullptr;  // the expert group, when the experts are shared out over one
  VocabularySplit vocab_;       // the embedding's and the head's rows over the tensor group
  std::map<std::string, SplitTensor> shards_;  // over the tensor group, or the expert group for stacked experts
  std::map<std::string, AdaptableLinear*> linear_of_;  // the linears held here, by HF module name
  std::vector<std::optional<c10::Device>> devices_;
  at::Tensor embed_, head_;
  Norm final_norm_;  // its weight undefined where another rank holds it
  // What each layer's block registered (empty where another rank holds the layer).
  struct HeldBlock {
    std::shared_ptr<DecoderBlock> block;
    std::vector<BlockWeight> weights;
    std::vector<std::pair<std::string, std::shared_ptr<AdaptableLinear>>> linears;
    std::shared_ptr<Experts> experts;  // a sparse layer's
    std::vector<std::string> others_linears;  // another rank's layer: its linears' names
  };
  std::vector<HeldBlock> blocks_;
  double embed_scale_ = 1.0;  // the embedding's rows times this (DecoderFamily::embedding_scaled)
  // Global layers' (0), and the sliding ones' (1) where they have their own rotary; [1] longrope's long factors.
  at::Tensor inv_freq_cpu_[2][2];
  std::map<std::string, at::Tensor> inv_freq_;
};

}  // namespace

std::unique_ptr<LoadedModel> load_decoder(const DecoderFamily& family, const DecoderConfig& config, const fs::path& folder,
                                          const LoadRequest& request) {
  auto model = std::make_unique<DecoderLoaded>(family, config, request);
  if (folder.empty())
    model->init_random(request.seed);
  else
    model->load_checkpoint(folder);
  return model;
}

}  // namespace loom::kit
