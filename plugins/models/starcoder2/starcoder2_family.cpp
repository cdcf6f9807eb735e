// Model plugin `starcoder2`: LayerNorms with biases, attention with biases on q, k, v and o, a plain
// MLP (c_fc, GELU, c_proj) with biases, a tied head, and every layer windowed when sliding_window
// is set (its folders have no layer_types: the Mistral rule). Reads norm_epsilon and use_bias.
#include "loom/kit/decoder_block.hpp"
#include "loom/layers.hpp"

namespace starcoder2 {

using namespace loom::kit;

class Block final : public DecoderBlock {
 public:
  explicit Block(BlockBuilder& b)
      : input_norm_(b.norm("input_layernorm", NormForm::kLayer)),
        mlp_norm_(b.norm("post_attention_layernorm", NormForm::kLayer)),
        attention_(grouped_query_attention(b, "self_attn.", b.config().attention_bias, b.config().attention_bias)),
        mlp_(plain_mlp(b, "mlp.c_fc", "mlp.c_proj", b.config().mlp_bias)) {}
  at::Tensor forward(const at::Tensor& x, LayerPass& pass) override {
    const at::Tensor mid = x + attention_(input_norm_(x), pass);
    return mid + mlp_(mlp_norm_(mid));
  }

 private:
  Norm input_norm_, mlp_norm_;
  GroupedQueryAttention attention_;
  Mlp mlp_;
};

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("starcoder2", {"starcoder2"}, "Starcoder2ForCausalLM");
    f.norm_form = NormForm::kLayer;
    f.configure = [](DecoderConfig& c, const json::Value* file) {
      c.attention_bias = c.mlp_bias = file == nullptr || (*file)["use_bias"].opt_boolean().value_or(true);
      if (file == nullptr) return;
      c.rms_norm_eps = (*file)["norm_epsilon"].opt_number().value_or(1e-5);
      if (!(*file)["tie_word_embeddings"].present()) c.tie_word_embeddings = true;  // Starcoder2Config's default
      if (c.layer_attention.empty() && c.sliding_window > 0) c.layer_attention.assign(static_cast<std::size_t>(c.num_hidden_layers), AttentionKind::kSliding);
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      out["norm_epsilon"] = c.rms_norm_eps;
      out["use_bias"] = c.attention_bias;
      if (c.sliding_window == 0) out["sliding_window"] = nullptr;
    };
    f.block = [](BlockBuilder& b) { return std::make_shared<Block>(b); };
    return f;
  }();
  return f;
}

}  // namespace starcoder2

LOOM_DECODER_FAMILY_PLUGIN("starcoder2", "0.1.0", "StarCoder 2 decoder family from an HF folder or a random init", starcoder2::family)
