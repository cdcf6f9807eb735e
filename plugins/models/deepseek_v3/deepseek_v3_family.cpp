// Model plugin `deepseek_v3` (DeepSeek-V3, R1; V2's attention and experts are the same): multi-head
// latent attention (q through a low-rank q_a/q_b pair or one q_proj; keys and values from a latent
// of kv_lora_rank through kv_b, beside one rotary key head every query head reads; rotary on the
// heads' last qk_rope_head_dim values, interleaved where rope_interleave says), and from layer
// first_k_dense_replace on a mixture of experts: sigmoid scores plus a correction bias choose the
// best topk_group of n_group groups and the top-k experts in them, weighted by the unbiased scores
// (renormalised, times routed_scaling_factor), beside n_shared_experts shared experts. Generation
// caches the latent and the rotary key (kit::remember), not every head's keys and values.
#include <cmath>

#include "loom/kit/decoder_block.hpp"
#include "loom/layers.hpp"

namespace deepseek_v3 {

using namespace loom::kit;
using loom::ParallelStyle;

std::int64_t setting(const DecoderConfig& c, const char* key) { return c.family.at(key).get<std::int64_t>(); }

class Block final : public DecoderBlock {
 public:
  explicit Block(BlockBuilder& b)
      : c_(b.config()), nope_(setting(c_, "qk_nope_head_dim")), rope_(c_.head_dim), v_dim_(setting(c_, "v_head_dim")),
        latent_(setting(c_, "kv_lora_rank")), interleaved_(c_.family.value("rope_interleave", true)) {
    const std::int64_t h = c_.hidden_size, heads = c_.num_attention_heads, q_rank = setting(c_, "q_lora_rank");
    input_norm_ = b.norm("input_layernorm", NormForm::kScale);
    mlp_norm_ = b.norm("post_attention_layernorm", NormForm::kScale);
    if (q_rank > 0) {
      q_a_ = b.linear("self_attn.q_a_proj", h, q_rank, c_.attention_bias, ParallelStyle::kReplicated);
      q_a_norm_ = b.norm("self_attn.q_a_layernorm", NormForm::kScale, {q_rank});
      q_a_norm_.eps = 1e-6;  // built without the config's eps
    }
    q_ = b.linear(q_rank > 0 ? "self_attn.q_b_proj" : "self_attn.q_proj", q_rank > 0 ? q_rank : h, heads * (nope_ + rope_), false, ParallelStyle::kColumn);
    kv_a_ = b.linear("self_attn.kv_a_proj_with_mqa", h, latent_ + rope_, c_.attention_bias, ParallelStyle::kReplicated);
    kv_a_norm_ = b.norm("self_attn.kv_a_layernorm", NormForm::kScale, {latent_});
    kv_a_norm_.eps = 1e-6;
    kv_b_ = b.linear("self_attn.kv_b_proj", latent_, heads * (nope_ + v_dim_), false, ParallelStyle::kColumn);
    o_ = b.linear("self_attn.o_proj", heads * v_dim_, h, c_.attention_bias, ParallelStyle::kRow);
    scores_.rotary = Rotary::kNone;  // turned here: only the rotary part of each head
    scores_.extras.scale = c_.attention_scale;
    if (!layer_is_sparse(c_, b.layer())) {
      mlp_ = gated_mlp(b, "mlp.", false);
      return;
    }
    experts_ = b.experts();
    const at::Tensor bias = b.weight("mlp.gate.e_score_correction_bias", {c_.moe.num_experts}, 0.0f);
    const GroupedSigmoidRouting routing{c_.moe.top_k, setting(c_, "n_group"), setting(c_, "topk_group"), c_.moe.normalize,
                                        c_.family.value("routed_scaling_factor", 1.0)};
    experts_->route_with = [bias, routing](const at::Tensor& x, const at::Tensor& router) { return route_sigmoid_grouped(x, router, bias, routing); };
    shared_ = gated_mlp(b, "mlp.shared_experts.", false, c_.moe.expert_intermediate_size * setting(c_, "n_shared_experts"));
  }

  at::Tensor forward(const at::Tensor& x, LayerPass& pass) override {
    const auto batch = x.size(0), len = x.size(1);
    const at::Tensor h = input_norm_(x);
    const at::Tensor q = q_->forward(q_a_ ? q_a_norm_(q_a_->forward(h)) : h).view({batch, len, -1, nope_ + rope_});
    const at::Tensor compressed = kv_a_->forward(h);
    // Generation caches what keys and values come from (the normed latent and the turned rotary
    // key: kv_lora_rank + rope values a token) and makes them of every cached column each pass.
    const at::Tensor k_rot = turned(compressed.narrow(-1, latent_, rope_).view({batch, len, 1, rope_}), pass).view({batch, len, rope_});
    const at::Tensor held = remember(pass, at::cat({kv_a_norm_(compressed.narrow(-1, 0, latent_)), k_rot}, -1));
    const auto seen = held.size(1), heads = q.size(2);
    const at::Tensor kv = kv_b_->forward(held.narrow(-1, 0, latent_)).view({batch, seen, -1, nope_ + v_dim_});
    const at::Tensor k_shared = shared_by_heads(held.narrow(-1, latent_, rope_), pass).view({batch, seen, 1, rope_});
    const at::Tensor queries = at::cat({q.narrow(-1, 0, nope_), turned(q.narrow(-1, nope_, rope_), pass)}, -1);
    const at::Tensor keys = at::cat({kv.narrow(-1, 0, nope_), k_shared.expand({batch, seen, heads, rope_})}, -1);
    LayerPass whole = pass;
    whole.cache = nullptr;  // the keys and values of every column are made: attend() only attends
    const at::Tensor mid = x + o_->forward(attend(whole, queries, keys, kv.narrow(-1, nope_, v_dim_), scores_));
    const at::Tensor m = mlp_norm_(mid);
    return mid + (experts_ ? experts_->forward(m, pass) + shared_(m) : mlp_(m));
  }

 private:
  // [B, T, heads, rope] turned by the pass's rotary, GPT-J's pairs where rope_interleave says.
  at::Tensor turned(const at::Tensor& t, const LayerPass& pass) const {
    const at::Tensor heads_first = t.transpose(1, 2);
    return (interleaved_ ? apply_rotary_interleaved(heads_first, pass.cos, pass.sin) : apply_rotary(heads_first, pass.cos, pass.sin)).transpose(1, 2);
  }
  const DecoderConfig& c_;
  std::int64_t nope_, rope_, v_dim_, latent_;
  bool interleaved_;
  Norm input_norm_, mlp_norm_, q_a_norm_, kv_a_norm_;
  std::shared_ptr<loom::AdaptableLinear> q_a_, q_, kv_a_, kv_b_, o_;
  AttendOptions scores_;
  Mlp mlp_, shared_;
  std::shared_ptr<Experts> experts_;
};

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("deepseek_v3", {"deepseek_v3"}, "DeepseekV3ForCausalLM");
    f.moe.enabled = true;
    f.moe.default_top_k = 8;
    f.configure = [](DecoderConfig& c, const json::Value* file) {
      // Random models: DeepseekV3Config's proportions, scaled to the shape's head_dim (the rotary part).
      const auto key = [&](const char* name, std::int64_t absent) { return file != nullptr ? (*file)[name].opt_integer(0, kMaxDimension).value_or(absent) : absent; };
      for (const auto& [name, absent] : {std::pair<const char*, std::int64_t>{"qk_nope_head_dim", 2 * c.head_dim}, {"v_head_dim", 2 * c.head_dim},
                                         {"kv_lora_rank", 8 * c.head_dim}, {"q_lora_rank", 0}, {"n_group", 1}, {"topk_group", 1}, {"n_shared_experts", 1}})
        c.family[name] = key(name, absent);
      c.family["rope_interleave"] = file == nullptr || (*file)["rope_interleave"].opt_boolean().value_or(true);
      c.family["routed_scaling_factor"] = file != nullptr ? (*file)["routed_scaling_factor"].opt_number().value_or(1.0) : 1.0;
      const std::int64_t first_dense = key("first_k_dense_replace", 0);
      for (std::int64_t i = 0; i < std::min(first_dense, c.num_hidden_layers); ++i) c.moe.dense_layers.push_back(i);
      // Scores over q·k of nope + rope values a head, times yarn's mscale² where mscale_all_dim is set
      // (in rope_parameters, or transformers 4's rope_scaling).
      const char* rope_key = file != nullptr && (*file).has("rope_parameters") ? "rope_parameters" : "rope_scaling";
      const double all = file != nullptr && (*file).has(rope_key) ? (*file)[rope_key]["mscale_all_dim"].opt_number().value_or(0) : 0;
      double scale = 1.0 / std::sqrt(static_cast<double>(setting(c, "qk_nope_head_dim") + c.head_dim));
      if (c.rope.type != "default" && all > 0) {
        c.family["mscale_all_dim"] = all;
        const double mscale = c.rope.factor > 1 ? 0.1 * all * std::log(c.rope.factor) + 1.0 : 1.0;
        scale *= mscale * mscale;
      }
      c.attention_scale = scale;
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      for (const auto& [name, value] : c.family.items())
        if (name != "mscale_all_dim") out[name] = value;
      for (const char* key : {"rope_parameters", "rope_scaling"})  // the rotary's own key, where the common writer put it
        if (c.family.contains("mscale_all_dim") && out.contains(key) && out[key].is_object()) out[key]["mscale_all_dim"] = c.family["mscale_all_dim"];
      out["n_routed_experts"] = c.moe.num_experts;
      out["first_k_dense_replace"] = c.moe.dense_layers.size();
      out["qk_rope_head_dim"] = c.head_dim;
    };
    f.block = [](BlockBuilder& b) { return std::make_shared<Block>(b); };
    // The latent and the rotary key, whole on every tensor rank.
    f.cache_values_per_position = [](const DecoderConfig& c, int) { return static_cast<std::uint64_t>(setting(c, "kv_lora_rank") + c.head_dim); };
    return f;
  }();
  return f;
}

}  // namespace deepseek_v3

LOOM_DECODER_FAMILY_PLUGIN("deepseek_v3", "0.1.0", "DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing) from an HF folder or a random init",
                           deepseek_v3::family)
