// Model plugin `olmo2`: OLMo 2 is the kit's decoder with its norms after attention and after the MLP
// (none before), each weight applied in fp32 before rounding, and RMSNorms of q and k over all
// their heads at once, before the heads are split out (weights of num_heads * head_dim; under
// tensor parallelism each rank holds its heads' part and the squares are summed over the group).
#include "loom/kit/decoder.hpp"

namespace olmo2 {

using loom::kit::DecoderConfig;
using loom::kit::LayerWeight;

const loom::kit::DecoderFamily& family() {
  static const loom::kit::DecoderFamily f = [] {
    loom::kit::DecoderFamily f;
    f.plugin = "olmo2";
    f.model_types = {"olmo2"};
    f.hf_class = [](const DecoderConfig&) { return "Olmo2ForCausalLM"; };
    f.norm_form = loom::kit::NormForm::kScaleInFloat;
    f.names.input_norm = "";
    f.names.post_attention_norm = "";
    f.names.attention_out_norm = "post_attention_layernorm.weight";
    f.names.mlp_out_norm = "post_feedforward_layernorm.weight";
    f.layer_weights = {{"self_attn.q_norm.weight", LayerWeight::Size::kQueryWidth, 1.0f},
                       {"self_attn.k_norm.weight", LayerWeight::Size::kKeyWidth, 1.0f}};
    f.on_query_key = [](at::Tensor& q, at::Tensor& k, const loom::kit::LayerWeights& norms, const DecoderConfig& c, loom::Communicator* group) {
      const auto form = loom::kit::NormForm::kScaleInFloat;
      q = loom::kit::rms_norm_over_heads(form, q, norms[0], c.rms_norm_eps, c.num_attention_heads, group);
      k = loom::kit::rms_norm_over_heads(form, k, norms[1], c.rms_norm_eps, c.num_key_value_heads, group);
    };
    // Backward keeps q and k before their norms, in fp32.
    f.hook_saved_per_token = [](const DecoderConfig& c) {
      return static_cast<std::uint64_t>(2 * (c.num_attention_heads + c.num_key_value_heads) * c.head_dim);
    };
    return f;
  }();
  return f;
}

}  // namespace olmo2

LOOM_DECODER_FAMILY_PLUGIN("olmo2", "0.1.0", "OLMo 2 decoder family from an HF folder or a random init", olmo2::family)
