// Model plugin `stablelm` (StableLM 2, StableLM-3B-4E1T): LayerNorms with biases, q, k and v with
// biases where use_qkv_bias says, a LayerNorm of each head of q and of k where qk_layernorm says
// (one weight a head, each saved apart), rotary over the first partial_rotary_factor of a head, a
// SwiGLU MLP, and with use_parallel_residual attention and the MLP both reading one norm of the
// layer's input.
#include "loom/kit/decoder_block.hpp"
#include "loom/layers.hpp"

namespace stablelm {

using namespace loom::kit;
using loom::ParallelStyle;

class Block final : public DecoderBlock {
 public:
  explicit Block(BlockBuilder& b)
      : eps_(b.config().rms_norm_eps),
        parallel_(b.config().family.value("use_parallel_residual", false)),
        input_norm_(b.norm("input_layernorm", NormForm::kLayer)),
        attention_(grouped_query_attention(b, "self_attn.", b.config().qkv_bias, false)),
        mlp_(gated_mlp(b, "mlp.", false)) {
    const DecoderConfig& c = b.config();
    if (!parallel_) mlp_norm_ = b.norm("post_attention_layernorm", NormForm::kLayer);
    if (c.family.value("qk_layernorm", false)) {  // split with the heads they norm
      q_norm_ = b.weight("self_attn.q_layernorm.norms.{}.weight", {c.num_attention_heads, c.head_dim}, 1.0f, ParallelStyle::kColumn);
      k_norm_ = b.weight("self_attn.k_layernorm.norms.{}.weight", {c.num_key_value_heads, c.head_dim}, 1.0f, ParallelStyle::kColumn);
    }
  }
  at::Tensor forward(const at::Tensor& x, LayerPass& pass) override {
    const at::Tensor h = input_norm_(x);
    auto heads = attention_.project(h);
    if (q_norm_.defined()) {  // [B, T, heads, d] against one weight row a head
      heads.q = layer_norm(heads.q, at::Tensor(), at::Tensor(), eps_) * q_norm_;
      heads.k = layer_norm(heads.k, at::Tensor(), at::Tensor(), eps_) * k_norm_;
    }
    const at::Tensor mid = x + attention_.o->forward(attend(pass, heads.q, heads.k, heads.v));
    return parallel_ ? mid + mlp_(h) : mid + mlp_(mlp_norm_(mid));
  }

 private:
  double eps_;
  bool parallel_;
  Norm input_norm_, mlp_norm_;
  GroupedQueryAttention attention_;
  Mlp mlp_;
  at::Tensor q_norm_, k_norm_;
};

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("stablelm", {"stablelm"}, "StableLmForCausalLM");
    f.norm_form = NormForm::kLayer;
    f.configure = [](DecoderConfig& c, const json::Value* file) {
      const auto flag = [&](const char* key, bool absent) { return file != nullptr ? (*file)[key].opt_boolean().value_or(absent) : absent; };
      c.qkv_bias = flag("use_qkv_bias", false);
      c.family["qk_layernorm"] = flag("qk_layernorm", false);
      c.family["use_parallel_residual"] = flag("use_parallel_residual", false);
      if (file != nullptr) c.rms_norm_eps = (*file)["layer_norm_eps"].opt_number().value_or(1e-5);
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      out["layer_norm_eps"] = c.rms_norm_eps;
      out["use_qkv_bias"] = c.qkv_bias;
      out["qk_layernorm"] = c.family.value("qk_layernorm", false);
      out["use_parallel_residual"] = c.family.value("use_parallel_residual", false);
    };
    f.block = [](BlockBuilder& b) { return std::make_shared<Block>(b); };
    return f;
  }();
  return f;
}

}  // namespace stablelm

LOOM_DECODER_FAMILY_PLUGIN("stablelm", "0.1.0", "StableLM decoder family from an HF folder or a random init", stablelm::family)
