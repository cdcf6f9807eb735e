// Model plugin `mixtral`: Mixtral is Mistral's decoder with a mixture of experts in every layer's
// place of the MLP: a router picks each token's top 2 of 8 experts (renormalised, weights in fp32),
// each expert a SwiGLU MLP. On disk the router is block_sparse_moe.gate and each expert's linears
// block_sparse_moe.experts.N.w1 (gate), w3 (up) and w2 (down); the kit keeps each layer's experts
// stacked, as transformers 5 does, and saves them back as published.
#include "loom/kit/decoder.hpp"

namespace mixtral {

const loom::kit::DecoderFamily& family() {
  static const loom::kit::DecoderFamily f = [] {
    loom::kit::DecoderFamily f;
    f.plugin = "mixtral";
    f.model_types = {"mixtral"};
    f.hf_class = [](const loom::kit::DecoderConfig&) { return "MixtralForCausalLM"; };
    auto& moe = f.moe;
    moe.enabled = true;
    moe.expert_size_key = "intermediate_size";
    moe.normalize = true;
    moe.default_top_k = 2;
    moe.disk_router = "block_sparse_moe.gate";
    moe.disk_experts = "block_sparse_moe.experts.";
    moe.gate = "w1";
    moe.up = "w3";
    moe.down = "w2";
    // Mistral's window: every layer slides over sliding_window where the config sets one.
    f.configure = [](loom::kit::DecoderConfig& c, const loom::kit::json::Value* file) {
      if (file != nullptr && c.layer_attention.empty() && c.sliding_window > 0)
        c.layer_attention.assign(static_cast<std::size_t>(c.num_hidden_layers), loom::kit::AttentionKind::kSliding);
    };
    // No window is said as null, as MixtralConfig writes it.
    f.write_config = [](const loom::kit::DecoderConfig& c, nlohmann::json& out) {
      if (c.sliding_window == 0) out["sliding_window"] = nullptr;
    };
    return f;
  }();
  return f;
}

}  // namespace mixtral

LOOM_DECODER_FAMILY_PLUGIN("mixtral", "0.1.0", "Mixtral mixture-of-experts family from an HF folder or a random init", mixtral::family)
