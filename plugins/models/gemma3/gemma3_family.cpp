// Model plugin `gemma3`: Gemma 3's language model (Gemma3ForCausalLM, model_type gemma3_text) is the
// kit's decoder with (1 + w) RMSNorms in fp32 before and after both halves of each layer, per-head
// q/k norms, an embedding scaled by sqrt(hidden_size), scores scaled by query_pre_attn_scalar,
// GeGLU, and local layers (a sliding window, their own rotary) between global ones; also the
// language model of a multimodal `gemma3` folder (Gemma3ForConditionalGeneration), its vision tower
// left unloaded. All of it is data the kit reads; loading, the cache (a ring on local layers),
// parallelism, LoRA, 4-bit and saving come from the kit.

#include "loom/kit/decoder.hpp"

namespace gemma3 {

using loom::kit::DecoderConfig;

const loom::kit::DecoderFamily& family() {
  static const loom::kit::DecoderFamily f = [] {
    loom::kit::DecoderFamily f;
    f.plugin = "gemma3";
    f.model_types = {"gemma3_text"};
    f.hf_class = [](const DecoderConfig&) { return "Gemma3ForCausalLM"; };
    f.norm_form = loom::kit::NormForm::kOffsetScale;
    f.embedding_scaled = true;
    f.names.post_attention_norm = "pre_feedforward_layernorm.weight";
    f.names.attention_out_norm = "post_attention_layernorm.weight";
    f.names.mlp_out_norm = "post_feedforward_layernorm.weight";
    f.configure = [](DecoderConfig& c, const loom::kit::json::Value* file) {
      loom::kit::read_gemma_keys(c, file);  // the soft-caps null in released folders
      if (file == nullptr) return;
      if ((*file)["use_bidirectional_attention"].opt_boolean().value_or(false))
        (*file)["use_bidirectional_attention"].fail("loom trains causal language models; an encoder's bidirectional attention is not one");
      if (!(*file)["tie_word_embeddings"].present()) c.tie_word_embeddings = true;  // Gemma3TextConfig's default
      // transformers 4's spelling: every sliding_window_pattern-th layer global, the local layers'
      // rotary a plain one of rope_local_base_freq.
      if (c.layer_attention.empty() && c.sliding_window > 0) {
        const std::int64_t pattern = (*file)["sliding_window_pattern"].opt_integer(1).value_or(6);
        for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
          c.layer_attention.push_back((i + 1) % pattern == 0 ? loom::kit::AttentionKind::kGlobal : loom::kit::AttentionKind::kSliding);
      }
      if (!c.local_rope && (*file).has("rope_local_base_freq")) {
        c.local_rope = loom::kit::RopeSettings{};
        c.local_rope->theta = (*file)["rope_local_base_freq"].number();
      }
    };
    f.write_config = loom::kit::write_gemma_keys;
    loom::kit::add_query_key_norms(f);  // (1 + w), as every Gemma norm
    // Gemma3ForConditionalGeneration's folders: transformers 4 names the language model
    // "language_model.model.*", 5 "model.language_model.*"; Gemma3TextConfig's defaults fill text_config.
    f.wrapper.model_types = {"gemma3"};
    f.wrapper.text_defaults = {{"vocab_size", 262208}, {"hidden_size", 2304}, {"intermediate_size", 9216}, {"num_hidden_layers", 26},
                               {"num_attention_heads", 8}, {"num_key_value_heads", 4}, {"head_dim", 256}, {"max_position_embeddings", 131072},
                               {"rms_norm_eps", 1e-6}, {"query_pre_attn_scalar", 256}, {"sliding_window", 4096}, {"sliding_window_pattern", 6},
                               {"rope_theta", 1000000.0}, {"rope_local_base_freq", 10000.0}, {"hidden_activation", "gelu_pytorch_tanh"}};
    f.wrapper.renames = {{"language_model.model.", "model."}, {"language_model.lm_head.", "lm_head."}, {"model.language_model.", "model."}};
    f.wrapper.skipped = {"vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."};
    f.wrapper.skipped_what = "the vision tower";
    return f;
  }();
  return f;
}

}  // namespace gemma3

LOOM_DECODER_FAMILY_PLUGIN("gemma3", "0.2.0", "Gemma 3 language model (gemma3_text, or a multimodal gemma3 folder's) from an HF folder or a random init", gemma3::family)
