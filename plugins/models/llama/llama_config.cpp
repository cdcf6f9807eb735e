#include "llama_config.hpp"

#include <fstream>
#include <limits>
#include <system_error>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"

namespace loom::llama {
namespace fs = std::filesystem;
namespace {

// config.json files are a few KiB; the bound keeps a wrong path from being read whole.
constexpr std::uintmax_t kMaxConfigBytes = 16u << 20;
constexpr std::int64_t kMaxDimension = std::int64_t{1} << 24;  // far above any real model, far below overflow

std::int64_t int_field(const nlohmann::json& j, const std::string& file, const char* key, std::optional<std::int64_t> def) {
  if (!j.contains(key) || j[key].is_null()) {
    if (def) return *def;
    throw UserError(file + ": missing \"" + key + "\"");
  }
  if (!j[key].is_number_integer()) throw UserError(file + ": \"" + key + "\" must be an integer, got " + j[key].dump());
  return j[key].get<std::int64_t>();
}

double float_field(const nlohmann::json& j, const std::string& file, const char* key, double def) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_number()) throw UserError(file + ": \"" + key + "\" must be a number, got " + j[key].dump());
  return j[key].get<double>();
}

bool bool_field(const nlohmann::json& j, const std::string& file, const char* key, bool def) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_boolean()) throw UserError(file + ": \"" + key + "\" must be true or false, got " + j[key].dump());
  return j[key].get<bool>();
}

}  // namespace

LlamaConfig read_config(const fs::path& path) {
  std::error_code ec;
  const fs::path file = fs::is_directory(path, ec) ? path / "config.json" : path;
  const std::string name = file.string();
  const auto size = fs::file_size(file, ec);
  if (ec) throw UserError(name + ": cannot read model config (" + ec.message() + "); [model] path must be an HF model folder holding config.json");
  if (size > kMaxConfigBytes) throw UserError(name + ": " + std::to_string(size) + " bytes is too large for a config.json");
  std::ifstream in(file);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw UserError(name + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw UserError(name + ": expected a JSON object");

  LlamaConfig c;
  c.model_type = j.value("model_type", std::string());
  if (c.model_type != "llama" && c.model_type != "mistral" && c.model_type != "qwen2")
    throw UserError(name + ": model_type \"" + c.model_type + "\" is not served by the llama plugin (it reads llama, mistral and qwen2)");
  c.hidden_size = int_field(j, name, "hidden_size", std::nullopt);
  c.intermediate_size = int_field(j, name, "intermediate_size", std::nullopt);
  c.num_hidden_layers = int_field(j, name, "num_hidden_layers", std::nullopt);
  c.num_attention_heads = int_field(j, name, "num_attention_heads", std::nullopt);
  c.num_key_value_heads = int_field(j, name, "num_key_value_heads", c.num_attention_heads);
  c.vocab_size = int_field(j, name, "vocab_size", std::nullopt);
  c.head_dim = int_field(j, name, "head_dim", c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.max_position_embeddings = int_field(j, name, "max_position_embeddings", 2048);
  c.rms_norm_eps = float_field(j, name, "rms_norm_eps", 1e-6);
  c.rope_theta = float_field(j, name, "rope_theta", 10000.0);
  c.tie_word_embeddings = bool_field(j, name, "tie_word_embeddings", false);
  c.attention_bias = bool_field(j, name, "attention_bias", false);
  c.mlp_bias = bool_field(j, name, "mlp_bias", false);
  c.qkv_bias = c.model_type == "qwen2";  // Qwen2 always has q/k/v biases and none on o_proj
  check_config(c, name);
  return c;
}

LlamaConfig config_from_options(const Options& o) {
  LlamaConfig c;
  c.model_type = o.get_string("architecture");
  c.hidden_size = o.get_int("hidden_size");
  c.intermediate_size = o.get_int("intermediate_size");
  c.num_hidden_layers = o.get_int("num_hidden_layers");
  c.num_attention_heads = o.get_int("num_attention_heads");
  c.num_key_value_heads = o.has("num_key_value_heads") ? o.get_int("num_key_value_heads") : c.num_attention_heads;
  c.head_dim = c.hidden_size / c.num_attention_heads;
  c.vocab_size = o.get_int("vocab_size");
  c.max_position_embeddings = o.get_int("max_position_embeddings");
  c.rms_norm_eps = o.get_float("rms_norm_eps");
  c.rope_theta = o.get_float("rope_theta");
  c.tie_word_embeddings = o.get_bool("tie_word_embeddings");
  c.qkv_bias = c.model_type == "qwen2";
  check_config(c, "[model]");
  return c;
}

void check_config(const LlamaConfig& c, const std::string& where) {
  const auto positive = [&](const char* key, std::int64_t v) {
    if (v <= 0 || v > kMaxDimension)
      throw UserError(where + ": " + key + " = " + std::to_string(v) + " must be between 1 and " + std::to_string(kMaxDimension));
  };
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  positive("num_key_value_heads", c.num_key_value_heads);
  positive("head_dim", c.head_dim);
  positive("vocab_size", c.vocab_size);
  positive("max_position_embeddings", c.max_position_embeddings);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw UserError(where + ": num_key_value_heads " + std::to_string(c.num_key_value_heads) + " must divide num_attention_heads " +
                    std::to_string(c.num_attention_heads));
  if (c.head_dim % 2 != 0) throw UserError(where + ": head_dim " + std::to_string(c.head_dim) + " must be even for rotary embeddings");
  if (!(c.rms_norm_eps > 0)) throw UserError(where + ": rms_norm_eps must be positive");
  if (!(c.rope_theta > 0)) throw UserError(where + ": rope_theta must be positive");
}

ModelStructure describe(const LlamaConfig& c) {
  const auto h = static_cast<std::uint64_t>(c.hidden_size);
  const auto f = static_cast<std::uint64_t>(c.intermediate_size);
  const auto v = static_cast<std::uint64_t>(c.vocab_size);
  const auto q = static_cast<std::uint64_t>(c.num_attention_heads * c.head_dim);
  const auto kv = static_cast<std::uint64_t>(c.num_key_value_heads * c.head_dim);
  const std::string tied = c.tie_word_embeddings ? "embed_tokens" : "";

  ModelStructure s;
  s.architecture = c.model_type;
  s.vocab_size = c.vocab_size;
  s.hidden_size = c.hidden_size;
  s.max_positions = c.max_position_embeddings;

  BlockInfo embed{"embed", BlockKind::kEmbedding, v * h, 0, h, 0, tied, {}};
  s.blocks.push_back(embed);

  const std::vector<LinearInfo> linears = {
      {"self_attn.q_proj", c.hidden_size, static_cast<std::int64_t>(q)},
      {"self_attn.k_proj", c.hidden_size, static_cast<std::int64_t>(kv)},
      {"self_attn.v_proj", c.hidden_size, static_cast<std::int64_t>(kv)},
      {"self_attn.o_proj", static_cast<std::int64_t>(q), c.hidden_size},
      {"mlp.gate_proj", c.hidden_size, c.intermediate_size},
      {"mlp.up_proj", c.hidden_size, c.intermediate_size},
      {"mlp.down_proj", c.intermediate_size, c.hidden_size},
  };
  std::uint64_t matmul = 0;
  for (const auto& l : linears) matmul += static_cast<std::uint64_t>(l.in_features) * static_cast<std::uint64_t>(l.out_features);
  std::uint64_t biases = 0;
  if (c.attention_bias) biases += q + 2 * kv + h;
  if (c.qkv_bias) biases += q + 2 * kv;
  if (c.mlp_bias) biases += 2 * f + h;
  // Saved for backward per token: the two residual inputs and their normed copies (4h), q/k/v
  // before and after rotary (2q + 2kv), the attention output (q), and gate, up, silu(gate) and
  // their product (4f).
  const std::uint64_t saved = 4 * h + 3 * q + 2 * kv + 4 * f;
  // The MLP's backward holds gradients of gate and up at once, plus the residual stream.
  const std::uint64_t working = 2 * f + 2 * h;
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
    s.blocks.push_back({"layers." + std::to_string(i), BlockKind::kDecoderLayer, matmul + biases + 2 * h, saved, working, 2 * matmul, "",
                        linears});

  s.blocks.push_back({"norm", BlockKind::kNorm, h, h, h, 0, "", {}});
  // The head keeps its normed input; logits and their gradient are the largest transient of the model.
  s.blocks.push_back({"head", BlockKind::kHead, v * h, h, 2 * v, 2 * v * h, tied, {{"lm_head", c.hidden_size, c.vocab_size}}});
  return s;
}

}  // namespace loom::llama
