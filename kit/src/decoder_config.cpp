// The generic decoder's configuration: config.json and shape options read, checked and written.
#include "loom/kit/decoder.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/decoder_block.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <system_error>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/kit/json.hpp"

namespace loom::kit {
namespace fs = std::filesystem;
namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// config.json files are a few KiB; the bound keeps a wrong path from being read whole.
constexpr std::uintmax_t kMaxConfigBytes = 16u << 20;

// A rotary setting from rope_scaling / rope_parameters (or one kind of layer's part of it) over
// `rope` (rope_theta read already). `original_max`: the config's top-level
// original_max_position_embeddings, which Phi-3 writes and transformers prefers to the object's.
RopeSettings read_rope(const json::Value& r, RopeSettings rope, std::int64_t max_positions, std::optional<std::int64_t> original_max) {
  r.object();
  rope.theta = r["rope_theta"].opt_number().value_or(rope.theta);
  rope.type = r.has("rope_type") ? r["rope_type"].string() : r["type"].opt_string().value_or("default");
  if (rope.type == "su") rope.type = "longrope";  // Phi-3's first folders' name for it
  if (rope.type != "default" && rope.type != "linear" && rope.type != "llama3" && rope.type != "yarn" && rope.type != "longrope")
    r.fail("rope_type \"" + rope.type + "\" is not supported (default, linear, llama3, yarn, longrope)");
  if (rope.type == "yarn" && !r["factor"].present()) r.fail("a yarn rotary needs its factor");
  rope.original_max_positions = original_max.value_or(r["original_max_position_embeddings"].opt_integer(1, kMaxDimension).value_or(max_positions));
  // longrope without a factor: the context's growth, as transformers derives it.
  const double grown = static_cast<double>(max_positions) / static_cast<double>(rope.original_max_positions);
  rope.factor = r["factor"].opt_number().value_or(rope.type == "longrope" ? grown : 1.0);
  rope.low_freq_factor = r["low_freq_factor"].opt_number().value_or(1.0);
  rope.high_freq_factor = r["high_freq_factor"].opt_number().value_or(4.0);
  if (!(rope.factor > 0)) r.fail("factor must be positive");
  if (rope.type == "llama3" && !(rope.high_freq_factor > rope.low_freq_factor)) r.fail("high_freq_factor must be greater than low_freq_factor");
  const auto given_attention = r["attention_factor"].opt_number();
  if (given_attention && !(*given_attention > 0)) r["attention_factor"].fail("must be positive");
  if (rope.type == "yarn") {
    rope.beta_fast = r["beta_fast"].opt_number().value_or(32.0);
    rope.beta_slow = r["beta_slow"].opt_number().value_or(1.0);
    rope.truncate = r["truncate"].opt_boolean().value_or(true);
    if (!(rope.beta_fast > 0) || !(rope.beta_slow > 0)) r.fail("beta_fast and beta_slow must be positive");
    const auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    const double m = r["mscale"].opt_number().value_or(0.0), all = r["mscale_all_dim"].opt_number().value_or(0.0);
    rope.attention_factor = given_attention.value_or(m != 0 && all != 0 ? mscale(rope.factor, m) / mscale(rope.factor, all) : mscale(rope.factor, 1.0));
  } else if (rope.type == "longrope") {
    for (auto [key, factors] : {std::pair{"short_factor", &rope.short_factor}, std::pair{"long_factor", &rope.long_factor}}) {
      const auto list = r[key];
      list.array();
      factors->clear();
      for (std::size_t i = 0; i < list.size(); ++i) {
        factors->push_back(list[i].number());
        if (!(factors->back() > 0)) list[i].fail("must be positive");
      }
    }
    const double original = static_cast<double>(rope.original_max_positions);
    rope.attention_factor = given_attention.value_or(rope.factor <= 1 ? 1.0 : std::sqrt(1 + std::log(rope.factor) / std::log(original)));
  }
  return rope;
}

// A layer_types entry as a kind of attention, for config.json and the shape options alike; the
// refusal's text otherwise.
std::optional<AttentionKind> attention_kind_named(const std::string& kind) {
  if (kind == "full_attention") return AttentionKind::kGlobal;
  if (kind == "sliding_attention") return AttentionKind::kSliding;
  return std::nullopt;
}
std::string unknown_attention_kind(const std::string& kind) {
  return "\"" + kind + "\" is not a kind of attention loom runs (full_attention, sliding_attention)";
}

// Every layer global when nothing said otherwise; no window kept where no layer slides.
void settle_layer_attention(DecoderConfig& c) {
  if (c.layer_attention.empty()) c.layer_attention.assign(static_cast<std::size_t>(std::max<std::int64_t>(c.num_hidden_layers, 0)), AttentionKind::kGlobal);
  if (std::count(c.layer_attention.begin(), c.layer_attention.end(), AttentionKind::kSliding) == 0) {
    c.sliding_window = 0;
    c.local_rope.reset();
  }
}

// A mixture of experts' keys, in transformers 4's and 5's spellings (num_experts, num_local_experts).
void read_moe(const DecoderFamily& family, DecoderConfig& c, const json::Value& config) {
  const auto& f = family.moe;
  MoeConfig& m = c.moe;
  // The count's spellings: Qwen's num_experts, Mixtral's num_local_experts, DeepSeek's n_routed_experts.
  m.num_experts = config[config.has("num_experts") ? "num_experts" : config.has("n_routed_experts") ? "n_routed_experts" : "num_local_experts"].integer();
  if (config.has("num_experts") && config.has("num_local_experts") && config["num_local_experts"].integer() != m.num_experts)
    config["num_local_experts"].fail("differs from num_experts " + std::to_string(m.num_experts) + "; a config names one expert count");
  m.top_k = config["num_experts_per_tok"].opt_integer().value_or(f.default_top_k);
  m.expert_intermediate_size = config[f.expert_size_key].integer();
  m.normalize = f.normalize ? *f.normalize : config["norm_topk_prob"].opt_boolean().value_or(false);
  m.sparse_step = config["decoder_sparse_step"].opt_integer().value_or(1);
  if (config.has("mlp_only_layers")) {
    const auto list = config["mlp_only_layers"];
    list.array();
    for (std::size_t i = 0; i < list.size(); ++i) {
      m.dense_layers.push_back(list[i].integer());
      if (m.dense_layers.back() < 0 || m.dense_layers.back() >= c.num_hidden_layers)
        list[i].fail("is not a layer of the " + std::to_string(c.num_hidden_layers) + " (num_hidden_layers)");
    }
  }
  m.aux_loss_coef = config["router_aux_loss_coef"].opt_number().value_or(0.001);
  m.aux_loss = config["output_router_logits"].opt_boolean().value_or(false);
  if (!family.names.shared_expert.empty()) m.shared_expert_intermediate_size = config[f.shared_size_key].integer(1, kMaxDimension);
}

}  // namespace

Activation read_activation(const json::Value& value, Activation absent) {
  if (!value.present()) return absent;
  const std::string name = value.string();
  if (name == "silu" || name == "swish") return Activation::kSilu;
  if (name == "gelu_pytorch_tanh" || name == "gelu_new") return Activation::kGeluTanh;
  if (name == "gelu") return Activation::kGelu;
  value.fail("\"" + name + "\" is not an activation loom runs (silu, gelu_pytorch_tanh, gelu_new, gelu)");
}

std::string activation_name(Activation a) {
  return a == Activation::kSilu ? "silu" : a == Activation::kGeluTanh ? "gelu_pytorch_tanh" : "gelu";
}

std::int64_t layer_window(const DecoderConfig& c, std::size_t layer) {
  return layer < c.layer_attention.size() && c.layer_attention[layer] == AttentionKind::kSliding ? c.sliding_window : 0;
}

const RopeSettings& layer_rope(const DecoderConfig& c, std::size_t layer) {
  return c.local_rope && layer_window(c, layer) > 0 ? *c.local_rope : c.rope;
}

bool layer_is_sparse(const DecoderConfig& c, std::size_t layer) {
  const MoeConfig& m = c.moe;
  if (m.num_experts == 0 || (static_cast<std::int64_t>(layer) + 1) % m.sparse_step != 0) return false;
  return std::find(m.dense_layers.begin(), m.dense_layers.end(), static_cast<std::int64_t>(layer)) == m.dense_layers.end();
}

void qwen_sliding_layers(DecoderConfig& c, const json::Value& file) {
  if (!file["use_sliding_window"].opt_boolean().value_or(false) || c.sliding_window == 0) return;
  const std::int64_t from = file["max_window_layers"].opt_integer(0).value_or(28);
  c.layer_attention.clear();
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) c.layer_attention.push_back(i >= from ? AttentionKind::kSliding : AttentionKind::kGlobal);
}

void alternate_sliding_layers(DecoderConfig& c) {
  if (!c.layer_attention.empty() || c.sliding_window == 0) return;
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) c.layer_attention.push_back(i % 2 == 0 ? AttentionKind::kSliding : AttentionKind::kGlobal);
}

void read_gemma_keys(DecoderConfig& c, const json::Value* file) {
  const auto geglu = Activation::kGeluTanh;
  c.activation = file != nullptr ? read_activation((*file)["hidden_activation"], geglu) : geglu;
  const double scalar = file != nullptr ? (*file)["query_pre_attn_scalar"].opt_number().value_or(256.0) : static_cast<double>(c.head_dim);
  if (!(scalar > 0)) (*file)["query_pre_attn_scalar"].fail("must be positive");
  c.attention_scale = 1.0 / std::sqrt(scalar);
  if (file == nullptr) return;
  c.final_logit_softcap = (*file)["final_logit_softcapping"].opt_number().value_or(0.0);
  c.attention_softcap = (*file)["attn_logit_softcapping"].opt_number().value_or(0.0);
}

void write_gemma_keys(const DecoderConfig& c, nlohmann::json& out) {
  out["hidden_activation"] = out["hidden_act"];
  const double scalar = 1.0 / (c.attention_scale * c.attention_scale);  // an integer in every published config
  out["query_pre_attn_scalar"] = std::abs(scalar - std::round(scalar)) < 1e-9 * scalar ? std::round(scalar) : scalar;
  out["final_logit_softcapping"] = c.final_logit_softcap > 0 ? nlohmann::json(c.final_logit_softcap) : nlohmann::json();
  out["attn_logit_softcapping"] = c.attention_softcap > 0 ? nlohmann::json(c.attention_softcap) : nlohmann::json();
}

void write_qwen_sliding_layers(const DecoderConfig& c, nlohmann::json& out) {
  const auto first = std::find(c.layer_attention.begin(), c.layer_attention.end(), AttentionKind::kSliding);
  out["use_sliding_window"] = first != c.layer_attention.end();
  // max_window_layers says only a run of sliding layers to the end; layer_types says any pattern.
  if (first != c.layer_attention.end() && std::find(first, c.layer_attention.end(), AttentionKind::kGlobal) == c.layer_attention.end())
    out["max_window_layers"] = first - c.layer_attention.begin();
}

DecoderConfig read_decoder_config(const DecoderFamily& family, const fs::path& path) {
  std::error_code ec;
  const fs::path file = fs::is_directory(path, ec) ? path / "config.json" : path;
  if (!fs::exists(file, ec))
    throw UserError(file.string() + " does not exist; [model] path must be an HF model folder holding config.json");
  const auto j = json::read_file(file, kMaxConfigBytes, "model config");
  const json::Value root(j, file.string());
  root.object();

  DecoderConfig c;
  c.model_type = root["model_type"].string();
  const auto& wrappers = family.wrapper.model_types;
  const bool wrapped = std::find(wrappers.begin(), wrappers.end(), c.model_type) != wrappers.end();
  if (!wrapped && std::find(family.model_types.begin(), family.model_types.end(), c.model_type) == family.model_types.end())
    root["model_type"].fail("\"" + c.model_type + "\" is not a model_type the " + family.plugin + " plugin reads (" + joined(family.all_model_types()) +
                            "); `loom plugins` lists the model families");
  // A wrapper's language model: its text_config over the keys the wrapper's class fills.
  nlohmann::json text;
  if (wrapped) {
    root["text_config"].object();
    text = family.wrapper.text_defaults;
    for (const auto& [key, value] : root["text_config"].raw().items()) text[key] = value;
    c.wrapper_type = c.model_type;
    c.model_type = family.model_types.front();
  }
  const json::Value config = wrapped ? json::Value(text, file.string() + ": text_config") : root;
  c.hidden_size = config["hidden_size"].integer();
  c.intermediate_size = config["intermediate_size"].integer();
  c.num_hidden_layers = config["num_hidden_layers"].integer();
  c.num_attention_heads = config["num_attention_heads"].integer();
  c.num_key_value_heads = config["num_key_value_heads"].opt_integer().value_or(c.num_attention_heads);
  c.vocab_size = config["vocab_size"].integer();
  c.head_dim = config["head_dim"].opt_integer().value_or(c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.max_position_embeddings = config["max_position_embeddings"].opt_integer().value_or(2048);
  c.rms_norm_eps = config["rms_norm_eps"].opt_number().value_or(1e-6);
  c.rope.theta = config["rope_theta"].opt_number().value_or(10000.0);
  c.tie_word_embeddings = config["tie_word_embeddings"].opt_boolean().value_or(false);
  c.attention_bias = config["attention_bias"].opt_boolean().value_or(false);
  c.mlp_bias = config["mlp_bias"].opt_boolean().value_or(false);
  c.activation = read_activation(config["hidden_act"], Activation::kSilu);
  // Rotary settings: transformers 4 writes rope_theta + rope_scaling, transformers 5 may write
  // rope_parameters holding both, or one such object per kind of layer (full_attention,
  // sliding_attention). Either is an object or null.
  for (const char* key : {"rope_parameters", "rope_scaling"})
    if (config.has(key)) config[key].object();
  const char* rope_key = config.has("rope_parameters") ? "rope_parameters" : config.has("rope_scaling") ? "rope_scaling" : nullptr;
  const auto original_max = config["original_max_position_embeddings"].opt_integer(1, kMaxDimension);
  // The share of a head rotary turns: in rope_parameters (transformers 5, which takes it over a
  // top-level one: a StableLM folder written by 5.17 holds 0.25 top-level and runs rope_parameters'
  // 0.5), else top-level (transformers 4, Phi-3).
  std::optional<double> partial;
  if (rope_key != nullptr) {
    const auto r = config[rope_key];
    if (r.has("full_attention") || r.has("sliding_attention")) {
      for (const char* kind : {"full_attention", "sliding_attention"})
        if (!r.has(kind)) r.fail("names rotary settings for one kind of layer but not for \"" + std::string(kind) + "\"");
      const RopeSettings base = c.rope;
      c.rope = read_rope(r["full_attention"], base, c.max_position_embeddings, original_max);
      c.local_rope = read_rope(r["sliding_attention"], base, c.max_position_embeddings, original_max);
      if (*c.local_rope == c.rope) c.local_rope.reset();
    } else {
      c.rope = read_rope(r, c.rope, c.max_position_embeddings, original_max);
      if (std::string(rope_key) == "rope_parameters") partial = r["partial_rotary_factor"].opt_number();
    }
  }
  if (!partial) partial = config["partial_rotary_factor"].opt_number();
  c.partial_rotary_factor = partial.value_or(1.0);
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1))
    config[config.has("partial_rotary_factor") ? "partial_rotary_factor" : rope_key].fail("partial_rotary_factor must be in (0, 1]");
  // Local attention: transformers 5 writes layer_types; older folders leave it to the family's own
  // keys (its configure). sliding_window stays 0 unless a layer slides.
  // Null: none; 0 too where use_sliding_window says no layer slides (Qwen2-MoE writes it so), a
  // window of no position elsewhere.
  const bool windows_off = config["use_sliding_window"].opt_boolean() == std::optional<bool>(false);
  const std::int64_t window = config["sliding_window"].opt_integer(windows_off ? 0 : 1, kMaxDimension).value_or(0);
  if (config.has("layer_types")) {
    const auto types = config["layer_types"];
    types.array();
    if (static_cast<std::int64_t>(types.size()) != c.num_hidden_layers)
      types.fail("holds " + std::to_string(types.size()) + " entries for " + std::to_string(c.num_hidden_layers) + " layers (num_hidden_layers)");
    for (std::size_t i = 0; i < types.size(); ++i) {
      const std::string kind = types[i].string();
      const auto known = attention_kind_named(kind);
      if (!known) types[i].fail(unknown_attention_kind(kind));
      c.layer_attention.push_back(*known);
    }
  }
  c.sliding_window = window;
  if (family.moe.enabled) read_moe(family, c, config);
  if (family.configure) family.configure(c, &config);
  settle_layer_attention(c);
  if (c.sliding_window == 0 && std::count(c.layer_attention.begin(), c.layer_attention.end(), AttentionKind::kSliding) > 0)
    config["sliding_window"].fail("must be a window of at least one position: the config names sliding layers");
  check_decoder_config(c, file.string());
  return c;
}

DecoderConfig decoder_config_from_options(const DecoderFamily& family, const Options& o) {
  DecoderConfig c;
  c.model_type = o.has("architecture") ? o.get_string("architecture") : family.model_types.front();
  c.hidden_size = o.get_int("hidden_size");
  c.intermediate_size = o.get_int("intermediate_size");
  c.num_hidden_layers = o.get_int("num_hidden_layers");
  c.num_attention_heads = o.get_int("num_attention_heads");
  c.num_key_value_heads = o.has("num_key_value_heads") ? o.get_int("num_key_value_heads") : c.num_attention_heads;
  c.head_dim = c.hidden_size / c.num_attention_heads;
  c.vocab_size = o.get_int("vocab_size");
  c.max_position_embeddings = o.get_int("max_position_embeddings");
  c.rms_norm_eps = o.get_float("rms_norm_eps");
  c.rope.theta = o.get_float("rope_theta");
  c.partial_rotary_factor = o.get_float("partial_rotary_factor");
  c.tie_word_embeddings = o.get_bool("tie_word_embeddings");
  c.sliding_window = o.has("sliding_window") ? o.get_int("sliding_window") : 0;
  if (o.has("layer_types")) {
    const auto& types = o.get_string_list("layer_types");
    if (static_cast<std::int64_t>(types.size()) != c.num_hidden_layers)
      throw UserError("[model] layer_types holds " + std::to_string(types.size()) + " entries for " + std::to_string(c.num_hidden_layers) +
                      " layers (num_hidden_layers)");
    for (const auto& kind : types) {
      const auto known = attention_kind_named(kind);
      if (!known) throw UserError("[model] layer_types: " + unknown_attention_kind(kind));
      c.layer_attention.push_back(*known);
    }
  } else if (c.sliding_window > 0) {
    c.layer_attention.assign(static_cast<std::size_t>(c.num_hidden_layers), AttentionKind::kSliding);
  }
  if (family.moe.enabled) {
    MoeConfig& m = c.moe;
    m.num_experts = o.get_int("num_experts");
    m.top_k = o.get_int("num_experts_per_tok");
    m.expert_intermediate_size = o.has("moe_intermediate_size") ? o.get_int("moe_intermediate_size") : c.intermediate_size;
    m.normalize = family.moe.normalize ? *family.moe.normalize : o.get_bool("norm_topk_prob");
    m.sparse_step = o.get_int("decoder_sparse_step");
    if (o.has("mlp_only_layers")) m.dense_layers = o.get_int_list("mlp_only_layers");
    for (const std::int64_t layer : m.dense_layers)
      if (layer < 0 || layer >= c.num_hidden_layers)
        throw UserError("[model] mlp_only_layers: " + std::to_string(layer) + " is not a layer of the " + std::to_string(c.num_hidden_layers));
    m.aux_loss = o.has("output_router_logits") && o.get_bool("output_router_logits");
    if (o.has("router_aux_loss_coef")) m.aux_loss_coef = o.get_float("router_aux_loss_coef");
    if (!family.names.shared_expert.empty())
      m.shared_expert_intermediate_size = o.has("shared_expert_intermediate_size") ? o.get_int("shared_expert_intermediate_size") : m.expert_intermediate_size;
  }
  if (family.configure) family.configure(c, nullptr);
  const bool slides = std::count(c.layer_attention.begin(), c.layer_attention.end(), AttentionKind::kSliding) > 0;
  if (slides && c.sliding_window == 0) throw UserError("[model] layer_types names sliding layers: set sliding_window to their window");
  settle_layer_attention(c);
  check_decoder_config(c, "[model]");
  return c;
}

void check_decoder_config(const DecoderConfig& c, const std::string& where) {
  const auto positive = [&](const char* key, std::int64_t v) {
    if (v <= 0 || v > kMaxDimension)
      throw UserError(where + ": " + key + " = " + std::to_string(v) + " must be between 1 and " + std::to_string(kMaxDimension));
  };
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  if (c.num_hidden_layers > kMaxLayers)
    throw UserError(where + ": num_hidden_layers = " + std::to_string(c.num_hidden_layers) + " is more than the " + std::to_string(kMaxLayers) +
                    " loom plans for (the deepest real models have 126 to 160)");
  positive("num_attention_heads", c.num_attention_heads);
  positive("num_key_value_heads", c.num_key_value_heads);
  positive("head_dim", c.head_dim);
  positive("vocab_size", c.vocab_size);
  positive("max_position_embeddings", c.max_position_embeddings);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw UserError(where + ": num_key_value_heads " + std::to_string(c.num_key_value_heads) + " must divide num_attention_heads " +
                    std::to_string(c.num_attention_heads));
  if (c.head_dim % 2 != 0) throw UserError(where + ": head_dim " + std::to_string(c.head_dim) + " must be even for rotary embeddings");
  const std::int64_t turned = rotary_dim(c);
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1) || turned < 2 || turned % 2 != 0)
    throw UserError(where + ": partial_rotary_factor " + std::to_string(c.partial_rotary_factor) + " turns " + std::to_string(turned) + " of head_dim " +
                    std::to_string(c.head_dim) + " dimensions; rotary needs an even number, at least 2");
  for (const RopeSettings* rope : {&c.rope, c.local_rope ? &*c.local_rope : nullptr}) {
    if (rope == nullptr || rope->type != "longrope") continue;
    const auto want = static_cast<std::size_t>(turned / 2);
    if (rope->short_factor.size() != want || rope->long_factor.size() != want)
      throw UserError(where + ": longrope's short_factor and long_factor hold " + std::to_string(rope->short_factor.size()) + " and " +
                      std::to_string(rope->long_factor.size()) + " factors; the rotary's " + std::to_string(turned) + " dimensions need " +
                      std::to_string(want) + " each");
  }
  if (!(c.rms_norm_eps > 0)) throw UserError(where + ": rms_norm_eps must be positive");
  if (!(c.rope.theta > 0) || (c.local_rope && !(c.local_rope->theta > 0))) throw UserError(where + ": rope_theta must be positive");
  if (c.sliding_window < 0 || c.sliding_window > kMaxDimension)
    throw UserError(where + ": sliding_window = " + std::to_string(c.sliding_window) + " must be between 1 and " + std::to_string(kMaxDimension));
  if (const MoeConfig& m = c.moe; m.num_experts != 0) {
    positive("num_experts", m.num_experts);
    positive("the experts' intermediate size", m.expert_intermediate_size);
    positive("decoder_sparse_step", m.sparse_step);
    if (m.top_k < 1 || m.top_k > m.num_experts)
      throw UserError(where + ": num_experts_per_tok = " + std::to_string(m.top_k) + " must be between 1 and num_experts (" +
                      std::to_string(m.num_experts) + ")");
    if (!(m.aux_loss_coef >= 0)) throw UserError(where + ": router_aux_loss_coef must be at least 0");
    // Every count the planner multiplies stays far inside 64 bits: the largest published mixtures
    // hold about 1e10 expert weights a layer.
    const double expert_weights = 3.0 * static_cast<double>(m.num_experts) * static_cast<double>(m.expert_intermediate_size) * static_cast<double>(c.hidden_size);
    if (expert_weights > 1e13)
      throw UserError(where + ": " + std::to_string(m.num_experts) + " experts of " + std::to_string(m.expert_intermediate_size) + " units over a hidden size of " +
                      std::to_string(c.hidden_size) + " hold more weights a layer (" + std::to_string(expert_weights) + ") than loom plans for (1e13)");
  }
  if (static_cast<std::int64_t>(c.layer_attention.size()) != c.num_hidden_layers)
    throw std::logic_error(where + ": " + std::to_string(c.layer_attention.size()) + " attention kinds for " + std::to_string(c.num_hidden_layers) +
                           " layers (a family's configure must set one a layer)");
}

std::int64_t rotary_dim(const DecoderConfig& c) {
  return static_cast<std::int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
}

std::vector<double> rope_inverse_frequencies(const RopeSettings& rope, std::int64_t dim, bool long_context) {
  const std::int64_t half = dim / 2;
  std::vector<double> inv(static_cast<std::size_t>(half));
  const double pi = std::acos(-1.0);
  // yarn: frequencies below the ramp (turning fewer than beta_slow times over the original context)
  // are interpolated (divided by factor), those above it (beta_fast) kept, the ramp blends them.
  double ramp_low = 0, ramp_high = 0;
  if (rope.type == "yarn") {
    const auto correction_dim = [&](double rotations) {
      return static_cast<double>(dim) * std::log(static_cast<double>(rope.original_max_positions) / (rotations * 2 * pi)) / (2 * std::log(rope.theta));
    };
    ramp_low = correction_dim(rope.beta_fast);
    ramp_high = correction_dim(rope.beta_slow);
    if (rope.truncate) {
      ramp_low = std::floor(ramp_low);
      ramp_high = std::ceil(ramp_high);
    }
    ramp_low = std::max(ramp_low, 0.0);
    ramp_high = std::min(ramp_high, static_cast<double>(dim - 1));
    if (ramp_low == ramp_high) ramp_high += 0.001;  // as transformers: no zero-width ramp
  }
  for (std::int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(rope.theta, static_cast<double>(2 * i) / static_cast<double>(dim));
    if (rope.type == "linear") {
      f /= rope.factor;
    } else if (rope.type == "llama3") {
      // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
      const double old_context = static_cast<double>(rope.original_max_positions);
      const double low_freq_wavelen = old_context / rope.low_freq_factor;
      const double high_freq_wavelen = old_context / rope.high_freq_factor;
      const double wavelen = 2 * pi / f;
      if (wavelen > low_freq_wavelen) {
        f /= rope.factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
        f = (1 - smooth) * f / rope.factor + smooth * f;
      }
    } else if (rope.type == "yarn") {
      const double kept = 1 - std::clamp((static_cast<double>(i) - ramp_low) / (ramp_high - ramp_low), 0.0, 1.0);
      f = f / rope.factor * (1 - kept) + f * kept;
    } else if (rope.type == "longrope") {
      f /= (long_context ? rope.long_factor : rope.short_factor).at(static_cast<std::size_t>(i));
    }
    inv[static_cast<std::size_t>(i)] = f;
  }
  return inv;
}

std::vector<std::string> DecoderNames::layer_linears(bool sparse) const {
  std::vector<std::string> out;
  if (qkv.empty()) out = {q, k, v};
  else out = {qkv};
  out.push_back(o);
  if (sparse) {
    if (!shared_expert.empty()) out.insert(out.end(), {shared_expert + "gate_proj", shared_expert + "up_proj", shared_expert + "down_proj"});
    if (!shared_expert_gate.empty()) out.push_back(shared_expert_gate);
    return out;
  }
  if (gate_up.empty()) out.insert(out.end(), {gate, up});
  else out.push_back(gate_up);
  out.push_back(down);
  return out;
}

std::vector<std::int64_t> DecoderNames::output_pieces(const std::string& linear, const DecoderConfig& c) const {
  const std::int64_t kv = c.num_key_value_heads * c.head_dim;
  if (!qkv.empty() && linear == qkv) return {c.num_attention_heads * c.head_dim, kv, kv};
  if (!gate_up.empty() && linear == gate_up) return {c.intermediate_size, c.intermediate_size};
  return {};
}

std::string decoder_config_json(const DecoderFamily& family, const DecoderConfig& c) {
  nlohmann::json j = {{"model_type", c.model_type},
                      {"architectures", {family.hf_class(c)}},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_key_value_heads},
                      {"head_dim", c.head_dim},
                      {"vocab_size", c.vocab_size},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {"hidden_act", activation_name(c.activation)},
                      {"attention_bias", c.attention_bias},
                      {"mlp_bias", c.mlp_bias}};
  // One setting for every layer in transformers 4's spelling, which 5 reads too; one a kind of
  // layer only in 5's (rope_parameters by layer kind), since 4 has no such form.
  const auto rope_json = [](const RopeSettings& r) {
    nlohmann::json out = {{"rope_type", r.type}, {"factor", r.factor}};
    if (r.type == "llama3") {
      out["low_freq_factor"] = r.low_freq_factor;
      out["high_freq_factor"] = r.high_freq_factor;
    }
    if (r.type == "yarn") {
      out["beta_fast"] = r.beta_fast;
      out["beta_slow"] = r.beta_slow;
      out["truncate"] = r.truncate;
    }
    if (r.type == "longrope") {
      out["short_factor"] = r.short_factor;
      out["long_factor"] = r.long_factor;
    }
    if (r.type == "llama3" || r.type == "yarn" || r.type == "longrope") out["original_max_position_embeddings"] = r.original_max_positions;
    if (r.type == "yarn" || r.type == "longrope") out["attention_factor"] = r.attention_factor;  // as resolved: no default to derive again
    return out;
  };
  if (c.local_rope) {
    nlohmann::json full = rope_json(c.rope), local = rope_json(*c.local_rope);
    full["rope_theta"] = c.rope.theta;
    local["rope_theta"] = c.local_rope->theta;
    j["rope_parameters"] = {{"full_attention", full}, {"sliding_attention", local}};
  } else {
    j["rope_theta"] = c.rope.theta;
    if (c.rope.type != "default") j["rope_scaling"] = rope_json(c.rope);
  }
  if (c.partial_rotary_factor != 1.0) j["partial_rotary_factor"] = c.partial_rotary_factor;
  if (c.sliding_window > 0) {
    j["sliding_window"] = c.sliding_window;
    nlohmann::json types = nlohmann::json::array();
    for (const auto kind : c.layer_attention) types.push_back(kind == AttentionKind::kSliding ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  if (const MoeConfig& m = c.moe; family.moe.enabled) {
    // Both spellings of the count: transformers 4's class reads one, 5's the other.
    j["num_experts"] = m.num_experts;
    j["num_local_experts"] = m.num_experts;
    j["num_experts_per_tok"] = m.top_k;
    j[family.moe.expert_size_key] = m.expert_intermediate_size;
    if (!family.moe.normalize) j["norm_topk_prob"] = m.normalize;
    j["decoder_sparse_step"] = m.sparse_step;
    j["mlp_only_layers"] = m.dense_layers;
    j["router_aux_loss_coef"] = m.aux_loss_coef;
    j["output_router_logits"] = m.aux_loss;
    if (m.shared_expert_intermediate_size > 0) j[family.moe.shared_size_key] = m.shared_expert_intermediate_size;
  }
  if (family.write_config) family.write_config(c, j);
  return j.dump(2) + "\n";
}

namespace {
// A dense MLP's gate, up and their SwiGLU (3f: kit::swiglu recomputes silu(gate) in backward;
// GeGLU's composite keeps gelu(gate) too, 4f).
std::uint64_t mlp_saved_per_token(const DecoderConfig& c) {
  return (c.activation == Activation::kSilu ? 3 : 4) * static_cast<std::uint64_t>(c.intermediate_size);
}
}  // namespace

TokenCountedMemory::Values dense_layer_values(const DecoderConfig& c, const BlockInfo& block, std::uint64_t tokens, std::int64_t value_bytes) {
  TokenCountedMemory::Values v{block.activation_values_per_token, block.working_values_per_token};
  const auto f = static_cast<std::uint64_t>(c.intermediate_size), h = static_cast<std::uint64_t>(c.hidden_size);
  const std::uint64_t mlp = mlp_saved_per_token(c);
  if (block.kind != BlockKind::kDecoderLayer || tokens == 0 || v.activation_values_per_token < mlp ||
      !mlp_runs_in_chunks(static_cast<std::int64_t>(tokens), c.intermediate_size, value_bytes))
    return v;
  // The MLP keeps its input; a slice's backward holds the slice's saved set, the gradients of gate
  // and up and of its rows, beside the residual stream's gradient.
  const auto slice = static_cast<std::uint64_t>(mlp_chunk_rows(c.intermediate_size, value_bytes)) * (mlp + 2 * f + 2 * h);
  v.activation_values_per_token = v.activation_values_per_token - mlp + h;
  v.working_values_per_token = 2 * h + (slice + tokens - 1) / tokens;
  return v;
}

ModelStructure describe_decoder(const DecoderFamily& family, const DecoderConfig& c) {
  const auto h = static_cast<std::uint64_t>(c.hidden_size);
  const auto f = static_cast<std::uint64_t>(c.intermediate_size);
  const auto v = static_cast<std::uint64_t>(c.vocab_size);
  const auto q = static_cast<std::uint64_t>(c.num_attention_heads * c.head_dim);
  const auto kv = static_cast<std::uint64_t>(c.num_key_value_heads * c.head_dim);
  const std::string tied = c.tie_word_embeddings ? "embed_tokens" : "";

  ModelStructure s;
  s.architecture = c.model_type;
  if (!c.wrapper_type.empty())
    s.architecture += " (the language model of a " + c.wrapper_type + " folder" + (family.wrapper.skipped_what.empty() ? "" : "; " + family.wrapper.skipped_what + " is not loaded") + ")";
  s.vocab_size = c.vocab_size;
  s.hidden_size = c.hidden_size;
  s.max_positions = c.max_position_embeddings;

  BlockInfo embed{"embed", BlockKind::kEmbedding, v * h, 0, h, 0, tied, {}};
  s.blocks.push_back(embed);

  // Megatron's split: heads and the FFN's hidden units by column, their output projections by row
  // (a fused linear is split by column too, each of its pieces on its own).
  const DecoderNames& n = family.names;
  const auto shapes_of = [&](bool sparse) {
    std::vector<LinearInfo> shapes;
    const std::int64_t shared = c.moe.shared_expert_intermediate_size;
    for (const std::string& name : n.layer_linears(sparse)) {
      if (!n.shared_expert.empty() && name.rfind(n.shared_expert, 0) == 0) {  // the shared expert: a gated MLP of its own width
        const bool down = name == n.shared_expert + "down_proj";
        shapes.push_back({name, down ? shared : c.hidden_size, down ? c.hidden_size : shared, down ? ParallelStyle::kRow : ParallelStyle::kColumn});
        continue;
      }
      if (name == n.shared_expert_gate) {
        shapes.push_back({name, c.hidden_size, 1, ParallelStyle::kReplicated});
        continue;
      }
      const bool attention_out = name == n.o, mlp_out = name == n.down;
      std::int64_t out = 0;
      for (const std::int64_t piece : n.output_pieces(name, c)) out += piece;
      if (out == 0)
        out = name == n.q ? static_cast<std::int64_t>(q) : name == n.k || name == n.v ? static_cast<std::int64_t>(kv) : attention_out || mlp_out ? c.hidden_size : c.intermediate_size;
      const std::int64_t in = attention_out ? static_cast<std::int64_t>(q) : mlp_out ? c.intermediate_size : c.hidden_size;
      shapes.push_back({name, in, out, attention_out || mlp_out ? ParallelStyle::kRow : ParallelStyle::kColumn});
    }
    return shapes;
  };
  const auto matmul_of = [](const std::vector<LinearInfo>& shapes) {
    std::uint64_t out = 0;
    for (const auto& l : shapes) out += static_cast<std::uint64_t>(l.in_features) * static_cast<std::uint64_t>(l.out_features);
    return out;
  };
  const std::vector<LinearInfo> dense_shapes = shapes_of(false), sparse_shapes = shapes_of(true);
  std::uint64_t biases = 0;
  if (c.attention_bias) biases += q + 2 * kv + h;
  for (const auto& w : family.layer_weights) biases += static_cast<std::uint64_t>(w.length(c));
  std::uint64_t norms = 0;
  for (const std::string* name : n.layer_norms()) norms += name->empty() ? 0 : h;
  if (c.qkv_bias) biases += q + 2 * kv;
  const std::uint64_t mlp_biases = c.mlp_bias ? 2 * f + h : 0;
  // Saved for backward per token: the two residual inputs and their normed copies (4h), q/k/v
  // before and after rotary (2q + 2kv), the attention output (q), and the MLP's (mlp_saved_per_token);
  // output norms keep their input and output (2h each).
  const std::uint64_t out_norms = (n.attention_out_norm.empty() ? 0 : 2 * h) + (n.mlp_out_norm.empty() ? 0 : 2 * h);
  const std::uint64_t attention_saved = 4 * h + 3 * q + 2 * kv + out_norms + (family.hook_saved_per_token ? family.hook_saved_per_token(c) : 0);
  const std::uint64_t dense_saved = attention_saved + mlp_saved_per_token(c);
  // The MLP's backward holds gradients of gate and up at once, plus the residual stream.
  const std::uint64_t dense_working = 2 * f + 2 * h;
  // A sparse layer: the router's weight and every expert's; a token's k picks each keep its input
  // row, gate and up, their SwiGLU and the expert's output (k (2h + 3i)), beside the router's
  // logits and fp32 probabilities (3e). Backward holds a pick's gate and up gradients and its row's.
  const auto e = static_cast<std::uint64_t>(c.moe.num_experts), k = static_cast<std::uint64_t>(c.moe.top_k);
  const auto i = static_cast<std::uint64_t>(c.moe.expert_intermediate_size);
  const std::uint64_t experts = e * h + 3 * e * i * h;
  // A shared expert keeps its gate, up and SwiGLU (3s) and its gate's output.
  const auto shared_units = static_cast<std::uint64_t>(c.moe.shared_expert_intermediate_size);
  const std::uint64_t sparse_saved = attention_saved + k * (2 * h + 3 * i) + 3 * e + (shared_units > 0 ? 3 * shared_units + 1 : 0);
  const std::uint64_t sparse_working = k * (2 * i + 2 * h) + 2 * h;
  for (std::int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const bool sparse = layer_is_sparse(c, static_cast<std::size_t>(layer));
    if (family.block) {
      // A family's block says its own linears and weights (built on the meta device); what it keeps
      // for backward is counted as the description's dense layer keeps it.
      BlockShape shape = block_shape(family, c, static_cast<std::size_t>(layer));
      for (auto& l : shape.linears) l.name = n.layers + std::to_string(layer) + "." + l.name;
      const std::uint64_t products = matmul_of(shape.linears);
      s.blocks.push_back({"layers." + std::to_string(layer), BlockKind::kDecoderLayer, shape.parameters, dense_saved, dense_working, 2 * products, "",
                          std::move(shape.linears)});
      continue;
    }
    std::vector<LinearInfo> linears = sparse ? sparse_shapes : dense_shapes;
    for (auto& l : linears) l.name = n.layers + std::to_string(layer) + "." + l.name;
    const std::uint64_t matmul = matmul_of(linears);
    if (sparse)
      s.blocks.push_back({"layers." + std::to_string(layer), BlockKind::kDecoderLayer, matmul + experts + biases + norms, sparse_saved, sparse_working,
                          2 * (matmul + e * h + k * 3 * i * h), "", std::move(linears)});
    else
      s.blocks.push_back({"layers." + std::to_string(layer), BlockKind::kDecoderLayer, matmul + biases + mlp_biases + norms, dense_saved,
                          dense_working, 2 * matmul, "", std::move(linears)});
  }

  s.blocks.push_back({"norm", BlockKind::kNorm, norm_has_bias(family.norm_form) ? 2 * h : h, h, h, 0, "", {}});
  // The head keeps its normed input; logits and their gradient are the largest transient of the model.
  s.blocks.push_back({"head", BlockKind::kHead, v * h, h, 2 * v, 2 * v * h, tied, {}});
  return s;
}

}  // namespace loom::kit
