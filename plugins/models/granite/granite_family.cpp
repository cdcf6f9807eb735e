// Model plugin `granite` (Granite 3.x dense): Llama's layer with both residual branches times
// residual_multiplier, the embedding times embedding_multiplier, attention scores scaled by
// attention_multiplier (in place of 1 / sqrt(head_dim)) and the logits divided by logits_scaling.
#include "loom/kit/decoder_block.hpp"
#include "loom/layers.hpp"

namespace granite {

using namespace loom::kit;

class Block final : public DecoderBlock {
 public:
  explicit Block(BlockBuilder& b)
      : input_norm_(b.norm("input_layernorm", NormForm::kScale)),
        mlp_norm_(b.norm("post_attention_layernorm", NormForm::kScale)),
        attention_(grouped_query_attention(b, "self_attn.", b.config().attention_bias, b.config().attention_bias)),
        mlp_(gated_mlp(b, "mlp.", b.config().mlp_bias)),
        residual_(b.config().family.value("residual_multiplier", 1.0)) {
    scores_.extras.scale = b.config().attention_scale;
  }
  at::Tensor forward(const at::Tensor& x, LayerPass& pass) override {
    const at::Tensor mid = x + attention_(input_norm_(x), pass, scores_) * residual_;
    return mid + mlp_(mlp_norm_(mid)) * residual_;
  }

 private:
  Norm input_norm_, mlp_norm_;
  GroupedQueryAttention attention_;
  Mlp mlp_;
  double residual_;
  AttendOptions scores_;
};

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("granite", {"granite"}, "GraniteForCausalLM");
    f.configure = [](DecoderConfig& c, const json::Value* file) {
      const auto key = [&](const char* name) { return file != nullptr ? (*file)[name].opt_number().value_or(1.0) : 1.0; };
      c.embedding_multiplier = key("embedding_multiplier");
      c.family["residual_multiplier"] = key("residual_multiplier");
      c.attention_scale = key("attention_multiplier");
      const double logits_scaling = key("logits_scaling");
      if (!(logits_scaling > 0)) (*file)["logits_scaling"].fail("must be positive");
      c.logit_multiplier = 1.0 / logits_scaling;
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      out["embedding_multiplier"] = c.embedding_multiplier;
      out["residual_multiplier"] = c.family.value("residual_multiplier", 1.0);
      out["attention_multiplier"] = c.attention_scale;
      out["logits_scaling"] = 1.0 / c.logit_multiplier;
    };
    f.block = [](BlockBuilder& b) { return std::make_shared<Block>(b); };
    return f;
  }();
  return f;
}

}  // namespace granite

LOOM_DECODER_FAMILY_PLUGIN("granite", "0.1.0", "Granite 3 dense decoder family from an HF folder or a random init", granite::family)
