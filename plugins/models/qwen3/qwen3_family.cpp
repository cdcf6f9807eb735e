// Model plugin `qwen3`: Qwen3 is the generic decoder with an explicit head_dim and an RMSNorm over
// each head of q and k before rotary (weights [head_dim] per layer). That is all of it: loading,
// the cache, tensor parallelism (each rank's norms learn alike), pipelines, LoRA, 4-bit bases and
// saving come from the kit.
#include "loom/kit/decoder.hpp"

namespace qwen3 {

const loom::kit::DecoderFamily& family() {
  static const loom::kit::DecoderFamily f = [] {
    loom::kit::DecoderFamily f;
    f.plugin = "qwen3";
    f.model_types = {"qwen3"};
    f.hf_class = [](const loom::kit::DecoderConfig&) { return "Qwen3ForCausalLM"; };
    // Local layers in folders without layer_types: Qwen2's keys.
    f.configure = [](loom::kit::DecoderConfig& c, const loom::kit::json::Value* file) {
      if (file != nullptr && c.layer_attention.empty()) loom::kit::qwen_sliding_layers(c, *file);
    };
    f.write_config = loom::kit::write_qwen_sliding_layers;
    loom::kit::add_query_key_norms(f);
    return f;
  }();
  return f;
}

}  // namespace qwen3

LOOM_DECODER_FAMILY_PLUGIN("qwen3", "0.1.0", "Qwen3 decoder family from an HF folder or a random init", qwen3::family)
