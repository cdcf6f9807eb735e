#include "cli/export.hpp"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/model.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace {

// The files transformers and tokenizers read for a tokenizer, whichever kind the folder holds.
const std::vector<std::string> kTokenizerFiles = {"tokenizer.json",  "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                                                  "vocab.json",      "merges.txt",            "added_tokens.json",       "chat_template.jinja",
                                                  "vocab.txt",       "spiece.model"};

// The saved tensors' files: the index's, or model.safetensors.
std::vector<fs::path> weight_files(const fs::path& saved) {
  std::error_code ec;
  if (fs::exists(saved / "model.safetensors", ec)) return {saved / "model.safetensors"};
  const auto index = kit::json::read_file(saved / "model.safetensors.index.json", 64u << 20, "safetensors index");
  std::vector<fs::path> files;
  for (const auto& [name, file] : index.at("weight_map").items())
    if (std::find(files.begin(), files.end(), saved / file.get<std::string>()) == files.end()) files.push_back(saved / file.get<std::string>());
  return files;
}

std::string config_dtype(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    default: return "float32";
  }
}

}  // namespace

HfExportResult write_hf_export(const fs::path& saved, const HfExport& to) {
  std::error_code ec;
  if (fs::exists(to.output, ec)) throw UserError("--output " + to.output.string() + " already exists; name a new folder (nothing was written)");
  const fs::path parent = to.output.parent_path().empty() ? fs::path(".") : to.output.parent_path();
  const fs::path tmp = parent / ("." + to.output.filename().string() + ".export-tmp");
  kit::remove_tree(tmp);
  fs::create_directories(tmp);
  HfExportResult result;
  try {
    // Each tensor once, in the saved order, with its size once cast.
    struct Entry {
      std::size_t file;
      std::string name;
      std::uint64_t bytes;
    };
    std::vector<std::unique_ptr<kit::SafetensorsFile>> files;
    std::vector<Entry> entries;
    const std::int64_t element = to.dtype ? static_cast<std::int64_t>(dtype_bytes(*to.dtype)) : 0;
    for (const auto& file : weight_files(saved)) {
      files.push_back(std::make_unique<kit::SafetensorsFile>(file));
      for (const auto& info : files.back()->tensors()) {
        std::uint64_t values = 1;
        for (const auto d : info.shape) values *= static_cast<std::uint64_t>(d);
        const bool floating = info.dtype == "F32" || info.dtype == "BF16" || info.dtype == "F16" || info.dtype == "F64";
        const std::uint64_t bytes = to.dtype && floating ? values * static_cast<std::uint64_t>(element) : info.end - info.begin;
        entries.push_back({files.size() - 1, info.name, bytes});
      }
    }
    // Shards filled in order up to the limit (a larger tensor alone in its own), as
    // transformers' save_pretrained fills them.
    std::vector<std::vector<std::size_t>> shards(1);
    std::uint64_t in_shard = 0;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      if (to.max_shard_bytes > 0 && !shards.back().empty() && in_shard + entries[i].bytes > to.max_shard_bytes) {
        shards.emplace_back();
        in_shard = 0;
      }
      shards.back().push_back(i);
      in_shard += entries[i].bytes;
      result.bytes += entries[i].bytes;
    }
    nlohmann::json weight_map = nlohmann::json::object();
    for (std::size_t s = 0; s < shards.size(); ++s) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      const std::string file = shards.size() == 1 ? "model.safetensors" : name;
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (const std::size_t i : shards[s]) {
        at::Tensor t = files[entries[i].file]->tensor(entries[i].name);
        if (to.dtype && at::isFloatingType(t.scalar_type())) t = t.to(scalar_type(*to.dtype));
        tensors.emplace_back(entries[i].name, t);
        weight_map[entries[i].name] = file;
      }
      kit::write_safetensors(tmp / file, tensors, {{"format", "pt"}});
    }
    result.tensors = entries.size();
    result.shards = shards.size();
    if (shards.size() > 1)
      kit::write_file_atomically(tmp / "model.safetensors.index.json",
                                 nlohmann::json{{"metadata", {{"total_size", result.bytes}}}, {"weight_map", weight_map}}.dump(2) + "\n");
    auto config = kit::json::read_file(saved / "config.json", 16u << 20, "model config");
    if (to.dtype) {
      config["torch_dtype"] = config_dtype(*to.dtype);  // transformers 4's key
      config["dtype"] = config_dtype(*to.dtype);        // transformers 5's
    }
    kit::write_file_atomically(tmp / "config.json", config.dump(2) + "\n");
    // generation_config.json: the model's own, else one from config.json's special tokens.
    if (!to.model_folder.empty() && fs::is_regular_file(to.model_folder / "generation_config.json", ec)) {
      fs::copy_file(to.model_folder / "generation_config.json", tmp / "generation_config.json");
    } else {
      nlohmann::json generation = {{"_from_model_config", true}};
      for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
        if (config.contains(key) && !config[key].is_null()) generation[key] = config[key];
      kit::write_file_atomically(tmp / "generation_config.json", generation.dump(2) + "\n");
    }
    result.copied.push_back("generation_config.json");
    if (!to.tokenizer_folder.empty())
      for (const auto& name : kTokenizerFiles)
        if (fs::is_regular_file(to.tokenizer_folder / name, ec)) {
          fs::copy_file(to.tokenizer_folder / name, tmp / name);
          result.copied.push_back(name);
        }
    fs::rename(tmp, to.output);
  } catch (const fs::filesystem_error& e) {
    kit::remove_tree(tmp);
    throw UserError("cannot write the export into " + to.output.string() + ": " + e.what() + " (nothing was left there)");
  } catch (...) {
    kit::remove_tree(tmp);
    throw;
  }
  return result;
}

}  // namespace loom::core
