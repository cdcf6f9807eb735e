#pragma once
// The Llama / Mistral / Qwen2 / Qwen3 decoder family, described by an HF config.json.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "loom/model.hpp"
#include "loom/options.hpp"

namespace loom::llama {

inline constexpr std::int64_t kMaxDimension = std::int64_t{1} << 24;  // far above any real model, far below overflow
// The deepest real models have 126 (Llama 3.1 405B) to 160 layers; each layer is a block to plan.
inline constexpr std::int64_t kMaxLayers = 1024;

struct LlamaConfig {
  std::string model_type = "llama";  // llama | mistral | qwen2 | qwen3
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t vocab_size = 0;
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // bias on q, k, v and o (Llama's attention_bias)
  bool qkv_bias = false;        // bias on q, k, v only (Qwen2)
  bool mlp_bias = false;
  bool qk_norm = false;         // RMSNorm over each head of q and k before rotary (Qwen3): weights [head_dim]
  // rope_scaling: "default" (none), "linear" (positions / factor) or "llama3" (frequency bands).
  std::string rope_type = "default";
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  std::int64_t rope_original_max_positions = 8192;
  std::int64_t sliding_window = 0;  // Mistral / Qwen2 local attention span; 0: none
};

// The rotary inverse frequencies [head_dim / 2] after rope scaling, computed in double.
std::vector<double> rope_inverse_frequencies(const LlamaConfig& config);

// config.json text for this config, as HF's LlamaConfig / Qwen2Config would read it.
std::string config_json(const LlamaConfig& config);

// Reads and checks `<folder>/config.json` (or a config file given directly). Throws UserError
// naming the file and the key on anything missing, mistyped or inconsistent.
LlamaConfig read_config(const std::filesystem::path& path);

// Builds a config from the plugin's shape options (init = "random" without a folder).
LlamaConfig config_from_options(const Options& options);

// Throws UserError (prefixed with `where`) if the shape cannot be a working model.
void check_config(const LlamaConfig& config, const std::string& where);

// Block list with sizes, for placement: embed, layers.0..N-1, norm, head.
ModelStructure describe(const LlamaConfig& config);

}  // namespace loom::llama
