// Model plugin `gemma2`: Gemma 2 is the kit's decoder described: (1 + w) RMSNorms in fp32 before and
// after both halves of each layer, an embedding scaled by sqrt(hidden_size), scores scaled by
// query_pre_attn_scalar and soft-capped (attn_logit_softcapping), GeGLU, sliding layers between
// global ones (even layers slide where layer_types is absent) and soft-capped logits.
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
      read_gemma_keys(c, file);
      if (file == nullptr) {  // Gemma2Config's soft-caps (null in a file turns one off)
        c.attention_softcap = 50.0;
        c.final_logit_softcap = 30.0;
        return;
      }
      if (!(*file)["tie_word_embeddings"].present()) c.tie_word_embeddings = true;  // Gemma2Config's default
      alternate_sliding_layers(c);  // transformers 4 wrote no layer_types
    };
    f.write_config = write_gemma_keys;
    return f;
  }();
  return f;
}

}  // namespace gemma2

LOOM_DECODER_FAMILY_PLUGIN("gemma2", "0.1.0", "Gemma 2 decoder family from an HF folder or a random init", gemma2::family)
