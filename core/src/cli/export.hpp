#pragma once
// `loom export`: a model (an adapter merged into it) written as a Hugging Face folder that
// transformers loads as it loads a published one.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "loom/devices.hpp"

namespace loom::core {

struct HfExport {
  std::filesystem::path output;            // must not exist yet
  std::optional<DType> dtype;              // every floating tensor cast to it (none: as saved)
  std::uint64_t max_shard_bytes = 0;       // a shard's most bytes (0: one file)
  std::filesystem::path tokenizer_folder;  // its tokenizer files are copied ("" : none)
  std::filesystem::path model_folder;      // its generation_config.json is copied ("" or none there: one from config.json)
};

struct HfExportResult {
  std::size_t tensors = 0, shards = 0;
  std::uint64_t bytes = 0;
  std::vector<std::string> copied;  // the tokenizer and generation files written beside the weights
};

// Turns `saved` (what save_pretrained wrote: config.json and model.safetensors or shards) into
// `to.output`: the tensors cast and laid into shards of at most max_shard_bytes named as
// transformers names them (model.safetensors alone, or model-0000i-of-0000N.safetensors with
// model.safetensors.index.json), config.json with the dtype (both spellings), generation_config.json
// and the tokenizer's files. Written beside `to.output` and renamed into place: a failure leaves
// nothing there. Throws UserError.
HfExportResult write_hf_export(const std::filesystem::path& saved, const HfExport& to);

}  // namespace loom::core
