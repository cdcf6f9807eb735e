// Model plugin `phi3`: Phi-3 mini and medium, Phi-3.5 mini, Phi-4 and Phi-4-mini (model_type phi3):
// the kit's decoder with q, k and v fused into one projection (qkv_proj) and gate and up into another
// (gate_up_proj), rotary over a share of each head (partial_rotary_factor, Phi-4-mini's 0.75), the
// 128k models' longrope, and a sliding window over every layer where sliding_window is set. LoRA
// targets the fused projections as PEFT does; tensor parallelism splits each of their pieces.
#include "loom/kit/decoder.hpp"

namespace phi3 {

using loom::kit::DecoderConfig;

const loom::kit::DecoderFamily& family() {
  static const loom::kit::DecoderFamily f = [] {
    loom::kit::DecoderFamily f;
    f.plugin = "phi3";
    f.model_types = {"phi3"};
    f.hf_class = [](const DecoderConfig&) { return "Phi3ForCausalLM"; };
    f.names.qkv = "self_attn.qkv_proj";
    f.names.gate_up = "mlp.gate_up_proj";
    f.configure = [](DecoderConfig& c, const loom::kit::json::Value* file) {
      // Phi3Model is Mistral's: every layer slides when sliding_window is set.
      if (file != nullptr && c.layer_attention.empty() && c.sliding_window > 0)
        c.layer_attention.assign(static_cast<std::size_t>(c.num_hidden_layers), loom::kit::AttentionKind::kSliding);
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      // Phi3Config's own key, which transformers prefers to the one in rope_scaling.
      if (c.rope.type == "longrope") out["original_max_position_embeddings"] = c.rope.original_max_positions;
    };
    return f;
  }();
  return f;
}

}  // namespace phi3

LOOM_DECODER_FAMILY_PLUGIN("phi3", "0.1.0", "Phi-3 / Phi-3.5 / Phi-4 language models (phi3) from an HF folder or a random init", phi3::family)
