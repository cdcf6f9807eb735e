// A family's model plugin: its options and factory, over the generic decoder.
#include <algorithm>
#include <mutex>

#include "loom/devices.hpp"
#include "loom/error.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/decoder.hpp"
#include "loom/kit/hub_cache.hpp"
#include "loom/kit/loss.hpp"
#include "loom/kit/tensor_parallel.hpp"

namespace loom::kit {
namespace {

const char* const kShapeKeys[] = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "vocab_size"};

class DecoderModel final : public Model, public TensorParallelModel, public StaticCacheSizing, public StaticCacheWindow, public PackedSequences,
                           public FrozenHeadWorkingSet, public ExpertStructure, public TokenCountedMemory {
 public:
  DecoderModel(const DecoderFamily& family, DecoderConfig config, std::filesystem::path weights)
      : family_(family), config_(std::move(config)), weights_(std::move(weights)) {}
  ModelStructure structure() const override { return described(); }
  std::unique_ptr<LoadedModel> load(const LoadRequest& request) const override { return load_decoder(family_, config_, weights_, request); }
  TensorParallelSupport tensor_parallel(int tensor) const override {
    TensorParallelSupport s = decoder_tensor_parallel(config_, tensor);
    // K/V heads replicated over the ranks (they do not split) suit neither a k norm spanning them
    // all nor a fused q/k/v, whose rows every rank holds a part of.
    const bool replicated_kv = tensor > 1 && s.refusal.empty() && config_.num_key_value_heads % tensor != 0;
    const auto across_keys = [](const LayerWeight& w) { return w.size == LayerWeight::Size::kKeyWidth; };
    const std::string unsplit = "its " + std::to_string(config_.num_key_value_heads) + " key/value heads do not split over " + std::to_string(tensor) +
                                " tensor ranks";
    if (replicated_kv && std::any_of(family_.layer_weights.begin(), family_.layer_weights.end(), across_keys))
      s.refusal = unsplit + ", and its k norm spans them all; use a tensor size that divides the key/value heads";
    if (replicated_kv && family_.block)
      s.refusal = unsplit + ", and the family's layer splits them with its query heads; use a tensor size that divides the key/value heads";
    if (replicated_kv && !family_.names.qkv.empty())
      s.refusal = unsplit + ", and its fused " + family_.names.qkv + " holds them beside the query heads; use a tensor size that divides the key/value heads";
    const DecoderNames& n = family_.names;
    for (const auto& [fused, parts] : {std::pair{&n.qkv, "q, k and v"}, std::pair{&n.gate_up, "gate and up"}})
      if (tensor > 1 && s.refusal.empty() && !fused->empty())
        s.notes.push_back(*fused + ": fused " + parts + ", each split by column on its own (every rank holds its part of each)");
    return s;
  }
  // Each sparse layer's stacked gate_up [E, 2I, H] and down [E, H, I], named as the loaded model's
  // expert_weights() names them.
  std::vector<ExpertsInfo> experts_info() const override {
    std::vector<ExpertsInfo> out;
    const auto& m = config_.moe;
    for (std::int64_t i = 0; i < config_.num_hidden_layers; ++i) {
      if (!layer_is_sparse(config_, static_cast<std::size_t>(i))) continue;
      const std::string prefix = family_.names.layers + std::to_string(i) + "." + family_.names.experts;
      const auto block = static_cast<std::size_t>(i + 1);
      out.push_back({prefix + ".gate_up_proj", block, m.num_experts, 2 * m.expert_intermediate_size, config_.hidden_size});
      out.push_back({prefix + ".down_proj", block, m.num_experts, config_.hidden_size, m.expert_intermediate_size});
    }
    return out;
  }
  // A decoder layer (blocks 1..layers) keeps the keys and values of the K/V heads its rank reads.
  std::uint64_t cache_values_per_position(std::size_t index, int tensor) const override {
    if (index < 1 || index > static_cast<std::size_t>(config_.num_hidden_layers)) return 0;
    if (family_.cache_values_per_position) return family_.cache_values_per_position(config_, std::max(1, tensor));
    const auto kv = kv_heads_for(config_, 0, std::max(1, tensor));
    return kv ? 2 * static_cast<std::uint64_t>(kv->count) * static_cast<std::uint64_t>(config_.head_dim) : 0;
  }
  // A sliding layer's cache is a ring of its window's positions (decoder_model.cpp, CacheRing).
  std::int64_t cache_window(std::size_t index) const override { return index >= 1 ? layer_window(config_, index - 1) : 0; }
  // Training with a frozen whole head, the loss comes from the head's input (DecoderLoaded::loss_sum,
  // next_token_loss_sum_from_hidden): backward's gradient of that input a token, and a slice of
  // logits whatever the tokens; never more than whole logits and their gradient, which a run
  // decoder_loss_from_head_input turns down keeps.
  std::uint64_t frozen_head_working_values_per_token(std::uint64_t tokens, DType dtype) const override {
    const auto vocab = static_cast<std::uint64_t>(config_.vocab_size), hidden = static_cast<std::uint64_t>(config_.hidden_size);
    const std::uint64_t whole = 2 * vocab;
    if (tokens == 0 || !decoder_loss_from_head_input(config_, dtype == DType::kFloat16)) return whole;
    const std::uint64_t bytes = dtype_bytes(dtype), slice = head_loss_slice_bytes(config_.vocab_size, bytes);
    return std::min(whole, hidden + (slice + tokens * bytes - 1) / (tokens * bytes));
  }

  // A dense layer whose MLP runs a long row in slices (dense_layer_values); a sparse one's experts
  // do not.
  Values block_values_per_token(std::size_t block, std::uint64_t tokens, DType dtype) const override {
    const ModelStructure& s = described();
    const BlockInfo& info = s.blocks.at(block);
    std::size_t layer = 0;
    for (std::size_t i = 0; i < block; ++i) layer += s.blocks[i].kind == BlockKind::kDecoderLayer ? 1 : 0;
    if (info.kind != BlockKind::kDecoderLayer || layer_is_sparse(config_, layer)) return {info.activation_values_per_token, info.working_values_per_token};
    return dense_layer_values(config_, info, tokens, static_cast<std::int64_t>(dtype_bytes(dtype)));
  }

 private:
  // describe_decoder's answer, made once: a family written as code builds its blocks to count them.
  const ModelStructure& described() const {
    std::call_once(described_once_, [this] { described_ = describe_decoder(family_, config_); });
    return described_;
  }

  const DecoderFamily& family_;  // the plugin's, alive as long as its library
  DecoderConfig config_;
  std::filesystem::path weights_;  // empty: random init
  mutable std::once_flag described_once_;
  mutable ModelStructure described_;
};

}  // namespace

at::Tensor rms_norm_as(NormForm form, const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& bias) {
  switch (form) {
    case NormForm::kOffsetScale: return rms_norm_offset(x, weight, eps);
    case NormForm::kScaleInFloat: return rms_norm_float(x, weight, eps);
    case NormForm::kLayer: return layer_norm(x, weight, bias, eps);
    case NormForm::kLayerFloat: return layer_norm_float(x, weight, eps);
    case NormForm::kScale: break;
  }
  return rms_norm(x, weight, eps);
}

at::Tensor rms_norm_over_heads(NormForm form, const at::Tensor& x, const at::Tensor& weight, double eps, std::int64_t all_heads, Communicator* group) {
  const auto heads = x.size(-2), dim = x.size(-1);
  const at::Tensor flat = x.flatten(-2);  // [..., heads * head_dim]
  if (group == nullptr || heads == all_heads) return rms_norm_as(form, flat, weight, eps).view(x.sizes());
  // The mean square over every rank's heads: this rank's sum, summed over the group both ways
  // (every rank's normalized values depend on every rank's squares).
  const at::Tensor f = flat.to(at::kFloat);
  const at::Tensor squares = reduce_from_tensor_region(copy_to_tensor_region(f.pow(2).sum(-1, true), group), group);
  const at::Tensor normed = f * (squares / static_cast<double>(all_heads * dim) + eps).rsqrt();
  const at::Tensor w = weight.to(at::kFloat);
  at::Tensor out;
  switch (form) {
    case NormForm::kOffsetScale: out = (normed * (w + 1)).to(x.scalar_type()); break;
    case NormForm::kScaleInFloat: out = (normed * w).to(x.scalar_type()); break;
    case NormForm::kScale: out = normed.to(x.scalar_type()) * weight; break;
    case NormForm::kLayer:
    case NormForm::kLayerFloat: throw std::logic_error("rms_norm_over_heads: a LayerNorm's form");
  }
  return out.view(x.sizes());
}

DecoderFamily decoder_family(std::string plugin, std::vector<std::string> model_types, std::string hf_class) {
  DecoderFamily f;
  f.plugin = std::move(plugin);
  f.model_types = std::move(model_types);
  f.hf_class = [hf_class = std::move(hf_class)](const DecoderConfig&) { return hf_class; };
  return f;
}

void add_query_key_norms(DecoderFamily& f) {
  f.layer_weights.push_back({"self_attn.q_norm.weight", LayerWeight::Size::kHeadDim, norm_identity(f.norm_form)});
  f.layer_weights.push_back({"self_attn.k_norm.weight", LayerWeight::Size::kHeadDim, norm_identity(f.norm_form)});
  const std::size_t first = f.layer_weights.size() - 2;
  const NormForm form = f.norm_form;
  f.on_query_key = [first, form](at::Tensor& q, at::Tensor& k, const LayerWeights& w, const DecoderConfig& c, Communicator*) {
    q = rms_norm_as(form, q, w[first], c.rms_norm_eps);
    k = rms_norm_as(form, k, w[first + 1], c.rms_norm_eps);
  };
  // Backward keeps q and k before their norms.
  f.hook_saved_per_token = [](const DecoderConfig& c) { return static_cast<std::uint64_t>((c.num_attention_heads + c.num_key_value_heads) * c.head_dim); };
}

std::vector<OptionSpec> decoder_options(const DecoderFamily& family) {
  std::vector<OptionSpec> out = {
      OptionSpec::string("path", std::nullopt,
                         "HF model folder (config.json + safetensors), or a hub id (\"org/name\") found in the local Hugging Face cache")
          .path(),
      OptionSpec::string("revision", "", "a hub id's branch, tag or commit in the cache (\"\": main)"),
      OptionSpec::string("init", "pretrained", "\"pretrained\": weights from path; \"random\": fresh weights for the config at path or the shape below")
          .one_of({"pretrained", "random"}),
  };
  if (family.model_types.size() > 1)
    out.push_back(OptionSpec::string("architecture", family.model_types.front(), "shape: model family when no config.json is used").one_of(family.model_types));
  for (auto spec : {
           OptionSpec::integer("hidden_size", std::nullopt, "shape: model width").at_least(1).at_most(kMaxDimension),
           OptionSpec::integer("intermediate_size", std::nullopt, "shape: MLP width").at_least(1).at_most(kMaxDimension),
           OptionSpec::integer("num_hidden_layers", std::nullopt, "shape: decoder layers").at_least(1).at_most(kMaxLayers),
           OptionSpec::integer("num_attention_heads", std::nullopt, "shape: attention heads").at_least(1).at_most(kMaxDimension),
           OptionSpec::integer("num_key_value_heads", std::nullopt, "shape: key/value heads (GQA); default num_attention_heads").at_least(1).at_most(kMaxDimension),
           OptionSpec::integer("vocab_size", std::nullopt, "shape: vocabulary size").at_least(1).at_most(kMaxDimension),
           OptionSpec::integer("max_position_embeddings", 2048, "shape: longest sequence").at_least(1).at_most(kMaxDimension),
           OptionSpec::real("rope_theta", 10000.0, "shape: rotary base").at_least(0),
           OptionSpec::real("partial_rotary_factor", 1.0, "shape: the share of each head's dimensions rotary turns (its first ones)").at_least(0).at_most(1),
           OptionSpec::real("rms_norm_eps", 1e-6, "shape: RMSNorm epsilon").at_least(0),
           OptionSpec::boolean("tie_word_embeddings", false, "shape: head shares the embedding matrix"),
           OptionSpec::integer("sliding_window", 0, "shape: keys a sliding layer's query sees, itself included (0: no layer slides)")
               .at_least(0)
               .at_most(kMaxDimension),
           OptionSpec::string_list("layer_types", std::nullopt,
                                   "shape: each layer's attention, \"full_attention\" or \"sliding_attention\"; default every layer sliding when "
                                   "sliding_window is set"),
       })
    out.push_back(std::move(spec));
  if (family.moe.enabled) {
    for (auto spec : {
             OptionSpec::integer("num_experts", 8, "shape: experts in each sparse layer").at_least(1).at_most(kMaxDimension),
             OptionSpec::integer("num_experts_per_tok", family.moe.default_top_k, "shape: experts each token is routed to (top-k)")
                 .at_least(1)
                 .at_most(kMaxDimension),
             OptionSpec::integer("moe_intermediate_size", std::nullopt, "shape: each expert's hidden units; default intermediate_size")
                 .at_least(1)
                 .at_most(kMaxDimension),
             OptionSpec::integer("decoder_sparse_step", 1, "shape: every this many layers is sparse (layer i when (i + 1) % step == 0)")
                 .at_least(1)
                 .at_most(kMaxLayers),
             OptionSpec::any_of("output_router_logits", kBool, std::nullopt,
                                "add the routers' load-balancing loss to the training loss (default: config.json's, else false)"),
             OptionSpec::real("router_aux_loss_coef", std::nullopt, "the load-balancing loss's weight (default: config.json's, else 0.001)").at_least(0),
             OptionSpec::any_of("mlp_only_layers", kIntList, std::nullopt, "shape: layers that keep a dense MLP"),
         })
      out.push_back(std::move(spec));
    if (!family.names.shared_expert.empty())
      out.push_back(OptionSpec::integer("shared_expert_intermediate_size", std::nullopt, "shape: the shared expert's hidden units; default moe_intermediate_size")
                        .at_least(1)
                        .at_most(kMaxDimension));
    if (!family.moe.normalize) out.push_back(OptionSpec::boolean("norm_topk_prob", false, "shape: the top-k routing weights rescaled to sum to 1"));
  }
  return out;
}

std::unique_ptr<Plugin> create_decoder(const DecoderFamily& family, const Options& o) {
  bool any_shape = false;
  for (const char* key : kShapeKeys) any_shape = any_shape || o.has(key);
  any_shape = any_shape || o.has("layer_types") || (o.has("sliding_window") && o.get_int("sliding_window") != 0);
  if (o.has("path")) {
    if (any_shape) throw UserError("shape keys (hidden_size, ...) describe a model without a folder; remove them or remove path");
    const std::string path = model_folder(o.get_string("path"), o.has("revision") ? o.get_string("revision") : "", "[model] path").string();
    const bool random = o.get_string("init") == "random";
    DecoderConfig config = read_decoder_config(family, path);
    if (family.moe.enabled) {
      if (o.has("output_router_logits")) config.moe.aux_loss = o.get_bool("output_router_logits");
      if (o.has("router_aux_loss_coef")) config.moe.aux_loss_coef = o.get_float("router_aux_loss_coef");
    }
    return std::make_unique<DecoderModel>(family, std::move(config), random ? std::filesystem::path() : std::filesystem::path(path));
  }
  if (o.get_string("init") == "pretrained")
    throw UserError("needs path = \"MODEL_FOLDER\" (an HF folder with config.json), or init = \"random\" with shape keys");
  std::string missing;
  for (const char* key : kShapeKeys)
    if (!o.has(key) && std::string(key) != "num_key_value_heads") missing += (missing.empty() ? "" : ", ") + std::string(key);
  if (!missing.empty()) throw UserError("init = \"random\" without path needs the shape keys " + missing);
  return std::make_unique<DecoderModel>(family, decoder_config_from_options(family, o), std::filesystem::path());
}

}  // namespace loom::kit
