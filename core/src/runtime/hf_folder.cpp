#include "runtime/hf_folder.hpp"

#include <nlohmann/json.hpp>

#include "loom/kit/atomic_file.hpp"
#include "loom/kit/json.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace {

// The files transformers and tokenizers read for a tokenizer, whichever kind the folder holds.
const std::vector<std::string> kTokenizerFiles = {"tokenizer.json",  "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                                                  "vocab.json",      "merges.txt",            "added_tokens.json",       "chat_template.jinja",
                                                  "vocab.txt",       "spiece.model"};

}  // namespace

// config.json as saved, over the model folder's own (which keeps what loom does not write: the
// special tokens' ids, architectures, transformers_version).
nlohmann::json merged_config(const fs::path& saved, const fs::path& model_folder) {
  auto config = kit::json::read_file(saved / "config.json", 16u << 20, "model config");
  std::error_code ec;
  if (model_folder.empty() || !fs::is_regular_file(model_folder / "config.json", ec)) return config;
  auto original = kit::json::read_file(model_folder / "config.json", 16u << 20, "model config");
  if (!original.is_object()) return config;
  original.update(config);
  return original;
}

std::vector<std::string> write_hf_companions(const fs::path& folder, const fs::path& model_folder, const fs::path& tokenizer_folder) {
  std::error_code ec;
  std::vector<std::string> written;
  // generation_config.json: the model's own, else one from config.json's special tokens.
  if (!model_folder.empty() && fs::is_regular_file(model_folder / "generation_config.json", ec)) {
    fs::copy_file(model_folder / "generation_config.json", folder / "generation_config.json", fs::copy_options::overwrite_existing);
  } else {
    const auto config = merged_config(folder, model_folder);
    nlohmann::json generation = {{"_from_model_config", true}};
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
      if (config.contains(key) && !config[key].is_null()) generation[key] = config[key];
    kit::write_file_atomically(folder / "generation_config.json", generation.dump(2) + "\n");
  }
  written.push_back("generation_config.json");
  if (!tokenizer_folder.empty())
    for (const auto& name : kTokenizerFiles)
      if (fs::is_regular_file(tokenizer_folder / name, ec)) {
        fs::copy_file(tokenizer_folder / name, folder / name, fs::copy_options::overwrite_existing);
        written.push_back(name);
      }
  return written;
}

}  // namespace loom::core
