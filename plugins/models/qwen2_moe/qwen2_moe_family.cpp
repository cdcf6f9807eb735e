// Model plugin `qwen2_moe` (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's layer (q, k and v with biases) with
// a mixture of experts in the layers decoder_sparse_step and mlp_only_layers leave sparse, and
// beside the routed experts a shared expert every token takes, weighed by the sigmoid of its gate
// (shared_expert_gate, one output). The router's weights are rounded to the hidden dtype.
#include "loom/kit/decoder.hpp"

namespace qwen2_moe {

using namespace loom::kit;

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("qwen2_moe", {"qwen2_moe"}, "Qwen2MoeForCausalLM");
    f.moe.enabled = true;
    f.moe.weights_in_hidden_dtype = true;
    f.moe.default_top_k = 4;
    f.names.shared_expert = "mlp.shared_expert.";
    f.names.shared_expert_gate = "mlp.shared_expert_gate";
    f.configure = [](DecoderConfig& c, const json::Value* file) {
      c.qkv_bias = file == nullptr || (*file)["qkv_bias"].opt_boolean().value_or(true);  // transformers 4: always
      if (file != nullptr && c.layer_attention.empty()) qwen_sliding_layers(c, *file);
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      out["qkv_bias"] = c.qkv_bias;
      write_qwen_sliding_layers(c, out);
    };
    return f;
  }();
  return f;
}

}  // namespace qwen2_moe

LOOM_DECODER_FAMILY_PLUGIN("qwen2_moe", "0.1.0", "Qwen2-MoE mixture-of-experts family (shared expert) from an HF folder or a random init", qwen2_moe::family)
