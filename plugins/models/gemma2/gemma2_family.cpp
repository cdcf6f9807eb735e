// Model plugin `gemma2`: Gemma 2 is the kit's decoder described: (1 + w) RMSNorms in fp32 before and
// after both halves of each layer, an embedding scaled by sqrt(hidden_size), scores scaled by
// query_pre_attn_scalar and soft-capped (attn_logit_softcapping), GeGLU, sliding layers between
// global ones (even layers slide where layer_types is absent) and soft-capped logits.
#include <cmath>

#include "loom/kit/decoder.hpp"

namespace gemma2 {

using namespace loom::kit;

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("gemma2", {"gemma2"}, "Gemma2ForCausalLM");
    f.norm_form = NormForm::kOffsetScale;
    f.embedding_scaled = true;
    f.names.post_attention_norm = "pre_feedforward_layernorm.weight";
    f.names.attention_out_norm = "post_attention_layernorm.weight";
    f.names.mlp_out_norm = "post_feedforward_layernorm.weight";
    f.configure = [](DecoderConfig& c, const json::Value* file) {
      const auto geglu = Activation::kGeluTanh;
      c.activation = file != nullptr ? read_activation((*file)["hidden_activation"], geglu) : geglu;
      const double scalar = file != nullptr ? (*file)["query_pre_attn_scalar"].opt_number().value_or(256.0) : static_cast<double>(c.head_dim);
      if (!(scalar > 0)) (*file)["query_pre_attn_scalar"].fail("must be positive");
      c.attention_scale = 1.0 / std::sqrt(scalar);
      // Gemma2Config's defaults, for a random model too; null in a file turns a cap off.
      c.attention_softcap = file != nullptr ? (*file)["attn_logit_softcapping"].opt_number().value_or(0.0) : 50.0;
      c.final_logit_softcap = file != nullptr ? (*file)["final_logit_softcapping"].opt_number().value_or(0.0) : 30.0;
      if (file == nullptr) return;
      if (!(*file)["tie_word_embeddings"].present()) c.tie_word_embeddings = true;  // Gemma2Config's default
      if (c.layer_attention.empty() && c.sliding_window > 0)  // transformers 4: every other layer, the first sliding
        for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) c.layer_attention.push_back(i % 2 == 0 ? AttentionKind::kSliding : AttentionKind::kGlobal);
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      out["hidden_activation"] = out["hidden_act"];
      const double scalar = 1.0 / (c.attention_scale * c.attention_scale);  // an integer in every published config
      out["query_pre_attn_scalar"] = std::abs(scalar - std::round(scalar)) < 1e-9 * scalar ? std::round(scalar) : scalar;
      out["attn_logit_softcapping"] = c.attention_softcap > 0 ? nlohmann::json(c.attention_softcap) : nlohmann::json();
      out["final_logit_softcapping"] = c.final_logit_softcap > 0 ? nlohmann::json(c.final_logit_softcap) : nlohmann::json();
    };
    return f;
  }();
  return f;
}

}  // namespace gemma2

LOOM_DECODER_FAMILY_PLUGIN("gemma2", "0.1.0", "Gemma 2 decoder family from an HF folder or a random init", gemma2::family)
