// Model plugin `cohere` (Command R, R+): one LayerNorm without a bias (in fp32) that attention and
// the MLP both read (a parallel block), per-head LayerNorms of q and k (use_qk_norm: one weight row
// a head), rotary on interleaved pairs, a SwiGLU MLP, a tied head and logits times logit_scale.
#include "loom/kit/decoder_block.hpp"
#include "loom/layers.hpp"

namespace cohere {

using namespace loom::kit;
using loom::ParallelStyle;

class Block final : public DecoderBlock {
 public:
  explicit Block(BlockBuilder& b)
      : norm_(b.norm("input_layernorm", NormForm::kLayerFloat)),
        attention_(grouped_query_attention(b, "self_attn.", b.config().attention_bias, b.config().attention_bias)),
        mlp_(gated_mlp(b, "mlp.", false)) {
    const DecoderConfig& c = b.config();
    if (c.family.value("use_qk_norm", false)) {  // split with the heads they norm
      q_norm_ = b.norm("self_attn.q_norm", NormForm::kLayerFloat, {c.num_attention_heads, c.head_dim}, ParallelStyle::kColumn);
      k_norm_ = b.norm("self_attn.k_norm", NormForm::kLayerFloat, {c.num_key_value_heads, c.head_dim}, ParallelStyle::kColumn);
    }
    turned_.rotary = Rotary::kInterleaved;
  }
  at::Tensor forward(const at::Tensor& x, LayerPass& pass) override {
    const at::Tensor h = norm_(x);
    const auto heads = attention_.project(h);
    const at::Tensor attended = attend(pass, q_norm_(heads.q), k_norm_(heads.k), heads.v, turned_);
    return x + attention_.o->forward(attended) + mlp_(h);
  }

 private:
  Norm norm_, q_norm_, k_norm_;  // q_norm_ and k_norm_ without weights where use_qk_norm is off: none
  GroupedQueryAttention attention_;
  Mlp mlp_;
  AttendOptions turned_;
};

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("cohere", {"cohere"}, "CohereForCausalLM");
    f.norm_form = NormForm::kLayerFloat;
    f.configure = [](DecoderConfig& c, const json::Value* file) {
      c.family["use_qk_norm"] = file != nullptr && (*file)["use_qk_norm"].opt_boolean().value_or(false);
      c.logit_multiplier = file != nullptr ? (*file)["logit_scale"].opt_number().value_or(0.0625) : 0.0625;  // CohereConfig's default
      if (file == nullptr) return;
      c.rms_norm_eps = (*file)["layer_norm_eps"].opt_number().value_or(1e-5);
      if (!(*file)["tie_word_embeddings"].present()) c.tie_word_embeddings = true;  // CohereConfig's default
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      out["layer_norm_eps"] = c.rms_norm_eps;
      out["logit_scale"] = c.logit_multiplier;
      out["use_qk_norm"] = c.family.value("use_qk_norm", false);
    };
    f.block = [](BlockBuilder& b) { return std::make_shared<Block>(b); };
    return f;
  }();
  return f;
}

}  // namespace cohere

LOOM_DECODER_FAMILY_PLUGIN("cohere", "0.1.0", "Cohere Command R decoder family from an HF folder or a random init", cohere::family)
