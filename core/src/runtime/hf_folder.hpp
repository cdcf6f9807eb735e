#pragma once
// What a saved model folder needs beside its weights to load as a published one, shared by a run's
// model outputs (runtime/trainer) and `loom export` (cli/export).
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace loom::core {

// config.json as saved in `saved`, over the model folder's own (which keeps what loom does not
// write: the special tokens' ids, architectures, transformers_version).
nlohmann::json merged_config(const std::filesystem::path& saved, const std::filesystem::path& model_folder);

// generation_config.json (the model folder's, or one from config.json's special tokens) and the
// tokenizer folder's files, written into `folder`. Returns the names written.
std::vector<std::string> write_hf_companions(const std::filesystem::path& folder, const std::filesystem::path& model_folder,
                                             const std::filesystem::path& tokenizer_folder);

}  // namespace loom::core
