// Model plugin `qwen3`: Qwen3 is the generic decoder with an explicit head_dim and an RMSNorm over
// each head of q and k before rotary (weights [head_dim] per layer). That is all of it: loading,
// the cache, tensor parallelism (each rank's norms learn alike), pipelines, LoRA, 4-bit bases and
// saving come from the kit.
#include "loom/kit/blocks.hpp"
#include "loom/kit/decoder.hpp"

namespace qwen3 {
namespace {

using loom::kit::DecoderConfig;
using loom::kit::LayerWeight;

const loom::kit::DecoderFamily& family() {
  static const loom::kit::DecoderFamily f = [] {
    loom::kit::DecoderFamily f;
    f.plugin = "qwen3";
    f.model_types = {"qwen3"};
    f.hf_class = [](const DecoderConfig&) { return "Qwen3ForCausalLM"; };
    // Local layers in folders without layer_types: Qwen2's keys.
    f.configure = [](DecoderConfig& c, const loom::kit::json::Value* file) {
      if (file != nullptr && c.layer_attention.empty()) loom::kit::qwen_sliding_layers(c, *file);
    };
    f.write_config = loom::kit::write_qwen_sliding_layers;
    f.layer_weights = {{"self_attn.q_norm.weight", LayerWeight::Size::kHeadDim, 1.0f},
                       {"self_attn.k_norm.weight", LayerWeight::Size::kHeadDim, 1.0f}};
    f.on_query_key = [](at::Tensor& q, at::Tensor& k, const loom::kit::LayerWeights& norms, const DecoderConfig& c) {
      q = loom::kit::rms_norm(q, norms[0], c.rms_norm_eps);
      k = loom::kit::rms_norm(k, norms[1], c.rms_norm_eps);
    };
    // Backward keeps q and k before their norms.
    f.hook_saved_per_token = [](const DecoderConfig& c) {
      return static_cast<std::uint64_t>((c.num_attention_heads + c.num_key_value_heads) * c.head_dim);
    };
    return f;
  }();
  return f;
}

std::vector<loom::OptionSpec> options() { return loom::kit::decoder_options(family()); }
std::unique_ptr<loom::Plugin> create(const loom::Options& o) { return loom::kit::create_decoder(family(), o); }
std::vector<std::string> model_types() { return family().model_types; }

}  // namespace
}  // namespace qwen3

LOOM_MODEL_PLUGIN("qwen3", "0.1.0", "Qwen3 decoder family from an HF folder or a random init", qwen3::options, qwen3::create, qwen3::model_types)
