// Model plugin `llama`: the Llama / Mistral / Qwen2 / Qwen3 decoder family from an HF model folder, or
// randomly initialised from shape options.
#include "llama_config.hpp"
#include "llama_model.hpp"
#include "loom/error.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"

namespace loom::llama {
namespace {

const char* const kShapeKeys[] = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "vocab_size"};

std::vector<OptionSpec> options() {
  return {
      OptionSpec::string("path", std::nullopt, "HF model folder (config.json + safetensors)").path(),
      OptionSpec::string("init", "pretrained", "\"pretrained\": weights from path; \"random\": fresh weights for the config at path or the shape below")
          .one_of({"pretrained", "random"}),
      OptionSpec::string("architecture", "llama", "shape: model family when no config.json is used").one_of({"llama", "mistral", "qwen2", "qwen3"}),
      OptionSpec::integer("hidden_size", std::nullopt, "shape: model width").at_least(1).at_most(kMaxDimension),
      OptionSpec::integer("intermediate_size", std::nullopt, "shape: MLP width").at_least(1).at_most(kMaxDimension),
      OptionSpec::integer("num_hidden_layers", std::nullopt, "shape: decoder layers").at_least(1).at_most(kMaxLayers),
      OptionSpec::integer("num_attention_heads", std::nullopt, "shape: attention heads").at_least(1).at_most(kMaxDimension),
      OptionSpec::integer("num_key_value_heads", std::nullopt, "shape: key/value heads (GQA); default num_attention_heads").at_least(1).at_most(kMaxDimension),
      OptionSpec::integer("vocab_size", std::nullopt, "shape: vocabulary size").at_least(1).at_most(kMaxDimension),
      OptionSpec::integer("max_position_embeddings", 2048, "shape: longest sequence").at_least(1).at_most(kMaxDimension),
      OptionSpec::real("rope_theta", 10000.0, "shape: rotary base").at_least(0),
      OptionSpec::real("rms_norm_eps", 1e-6, "shape: RMSNorm epsilon").at_least(0),
      OptionSpec::boolean("tie_word_embeddings", false, "shape: head shares the embedding matrix"),
  };
}

class LlamaModel final : public Model {
 public:
  LlamaModel(LlamaConfig config, std::filesystem::path weights) : config_(std::move(config)), weights_(std::move(weights)) {}
  ModelStructure structure() const override { return describe(config_); }
  std::unique_ptr<LoadedModel> load(const LoadRequest& request) const override { return load_llama(config_, weights_, request); }
  TensorParallelSupport tensor_parallel(int tensor) const override { return llama_tensor_parallel(config_, tensor); }

 private:
  LlamaConfig config_;
  std::filesystem::path weights_;  // empty: random init
};

std::unique_ptr<Plugin> create(const Options& o) {
  bool any_shape = false;
  for (const char* key : kShapeKeys) any_shape = any_shape || o.has(key);
  if (o.has("path")) {
    if (any_shape) throw UserError("shape keys (hidden_size, ...) describe a model without a folder; remove them or remove path");
    const std::string& path = o.get_string("path");
    const bool random = o.get_string("init") == "random";
    return std::make_unique<LlamaModel>(read_config(path), random ? std::filesystem::path() : std::filesystem::path(path));
  }
  if (o.get_string("init") == "pretrained")
    throw UserError("needs path = \"MODEL_FOLDER\" (an HF folder with config.json), or init = \"random\" with shape keys");
  std::string missing;
  for (const char* key : kShapeKeys)
    if (!o.has(key) && std::string(key) != "num_key_value_heads") missing += (missing.empty() ? "" : ", ") + std::string(key);
  if (!missing.empty()) throw UserError("init = \"random\" without path needs the shape keys " + missing);
  return std::make_unique<LlamaModel>(config_from_options(o), std::filesystem::path());
}

}  // namespace
}  // namespace loom::llama

LOOM_PLUGIN(loom::kKindModel, "llama", "0.1.0", "Llama / Mistral / Qwen2 / Qwen3 decoder family from an HF folder or a random init",
            loom::llama::options, loom::llama::create)
