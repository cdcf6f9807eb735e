// Model plugin `olmoe` (OLMoE-1B-7B): Llama's pre-norm layer with RMSNorms of q and k over all their
// heads at once (as OLMo 2's, in Llama's norm form) and a mixture of experts in every layer: a
// softmax router picks each token's top num_experts_per_tok experts (renormalised where
// norm_topk_prob says, the weights rounded to the hidden dtype), each a SwiGLU MLP of
// intermediate_size units.
#include "loom/kit/decoder.hpp"

namespace olmoe {

using namespace loom::kit;

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("olmoe", {"olmoe"}, "OlmoeForCausalLM");
    f.moe.enabled = true;
    f.moe.expert_size_key = "intermediate_size";
    f.moe.weights_in_hidden_dtype = true;
    f.moe.default_top_k = 8;
    f.layer_weights = {{"self_attn.q_norm.weight", LayerWeight::Size::kQueryWidth, 1.0f}, {"self_attn.k_norm.weight", LayerWeight::Size::kKeyWidth, 1.0f}};
    f.on_query_key = [](at::Tensor& q, at::Tensor& k, const LayerWeights& norms, const DecoderConfig& c, loom::Communicator* group) {
      q = rms_norm_over_heads(NormForm::kScale, q, norms[0], c.rms_norm_eps, c.num_attention_heads, group);
      k = rms_norm_over_heads(NormForm::kScale, k, norms[1], c.rms_norm_eps, c.num_key_value_heads, group);
    };
    f.hook_saved_per_token = [](const DecoderConfig& c) { return static_cast<std::uint64_t>(2 * (c.num_attention_heads + c.num_key_value_heads) * c.head_dim); };
    f.configure = [](DecoderConfig&, const json::Value* file) {
      if (file != nullptr && (*file)["clip_qkv"].present()) (*file)["clip_qkv"].fail("loom does not clamp q, k and v (OLMoE's clip_qkv); null expected");
    };
    return f;
  }();
  return f;
}

}  // namespace olmoe

LOOM_DECODER_FAMILY_PLUGIN("olmoe", "0.1.0", "OLMoE mixture-of-experts family from an HF folder or a random init", olmoe::family)
