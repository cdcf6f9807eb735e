// Model plugin `qwen3_moe`: Qwen3-MoE is Qwen3 (per-head q/k norms) with a mixture of experts in
// place of the MLP in the layers decoder_sparse_step and mlp_only_layers leave sparse: a router
// picks each token's top num_experts_per_tok experts (renormalised where norm_topk_prob says, the
// weights rounded to the hidden dtype), each a SwiGLU MLP of moe_intermediate_size units.
#include "loom/kit/decoder.hpp"

namespace qwen3_moe {

const loom::kit::DecoderFamily& family() {
  static const loom::kit::DecoderFamily f = [] {
    loom::kit::DecoderFamily f;
    f.plugin = "qwen3_moe";
    f.model_types = {"qwen3_moe"};
    f.hf_class = [](const loom::kit::DecoderConfig&) { return "Qwen3MoeForCausalLM"; };
    f.moe.enabled = true;
    f.moe.weights_in_hidden_dtype = true;
    f.moe.default_top_k = 8;
    f.configure = [](loom::kit::DecoderConfig& c, const loom::kit::json::Value* file) {
      if (file != nullptr && c.layer_attention.empty()) loom::kit::qwen_sliding_layers(c, *file);
    };
    f.write_config = loom::kit::write_qwen_sliding_layers;
    loom::kit::add_query_key_norms(f);
    return f;
  }();
  return f;
}

}  // namespace qwen3_moe

LOOM_DECODER_FAMILY_PLUGIN("qwen3_moe", "0.1.0", "Qwen3-MoE mixture-of-experts family from an HF folder or a random init", qwen3_moe::family)
