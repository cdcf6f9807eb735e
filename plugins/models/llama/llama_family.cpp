// Model plugin `llama`: Llama, Mistral and Qwen2, the generic decoder as it stands, from an HF model
// folder or randomly initialised from shape options.
#include "loom/kit/decoder.hpp"

namespace loom::llama {

using kit::DecoderConfig;

const kit::DecoderFamily& family() {
  static const kit::DecoderFamily f = [] {
    kit::DecoderFamily f;
    f.plugin = "llama";
    f.model_types = {"llama", "mistral", "qwen2"};
    f.hf_class = [](const DecoderConfig& c) {
      return c.model_type == "qwen2" ? "Qwen2ForCausalLM" : c.model_type == "mistral" ? "MistralForCausalLM" : "LlamaForCausalLM";
    };
    f.configure = [](DecoderConfig& c, const kit::json::Value* file) {
      if (c.model_type == "qwen2") c.qkv_bias = true;  // Qwen2 always has q/k/v biases and none on o_proj
      // Local attention in folders without layer_types: every Mistral layer slides when sliding_window
      // is set (null when off); Qwen2's from max_window_layers on, when use_sliding_window says so.
      if (file == nullptr || !c.layer_attention.empty() || c.sliding_window == 0) return;
      if (c.model_type == "mistral") c.layer_attention.assign(static_cast<std::size_t>(c.num_hidden_layers), kit::AttentionKind::kSliding);
      if (c.model_type == "qwen2") kit::qwen_sliding_layers(c, *file);
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      // MistralConfig reads a missing sliding_window as 4,096: no window is said as null.
      if (c.model_type == "mistral" && c.sliding_window == 0) out["sliding_window"] = nullptr;
      if (c.model_type == "qwen2") {
        out.erase("attention_bias");  // Qwen2Config has neither: its biases are fixed
        out.erase("mlp_bias");
        kit::write_qwen_sliding_layers(c, out);
      }
    };
    return f;
  }();
  return f;
}

}  // namespace loom::llama

LOOM_DECODER_FAMILY_PLUGIN("llama", "0.2.0", "Llama / Mistral / Qwen2 decoder family from an HF folder or a random init", loom::llama::family)
