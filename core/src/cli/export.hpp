#pragma once
// `loom export`: a model (an adapter merged into it) written as a Hugging Face folder that
// transformers loads as it loads a published one.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "config/session.hpp"
#include "runtime/hf_folder.hpp"
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

// Checks where an export will go before any work: `output` must not exist, and the nearest of its
// folders that does must be a folder loom can write in. Throws UserError naming `flag`.
void check_export_output(const std::filesystem::path& output, const std::string& flag);
// A name beside `output` no other export (or run) takes: ".NAME.TAG-<pid>-<random>", or
// ".NAME.TAG-<token>" when the ranks of one export share a token.
std::filesystem::path private_sibling(const std::filesystem::path& output, const std::string& tag, std::uint64_t token = 0);
// Moves `from` to `to` unless `to` exists (then UserError: another export took the name first,
// and `from` stays where it was).
void rename_without_replacing(const std::filesystem::path& from, const std::filesystem::path& to, const std::string& flag);

// Turns `saved` (what save_pretrained wrote: config.json and model.safetensors or shards) into
// `to.output`: the tensors cast and laid into shards of at most max_shard_bytes named as
// transformers names them (model.safetensors alone, or model-0000i-of-0000N.safetensors with
// model.safetensors.index.json), config.json with the dtype (both spellings), generation_config.json
// and the tokenizer's files. Written beside `to.output` and renamed into place: a failure leaves
// nothing there. Throws UserError.
HfExportResult write_hf_export(const std::filesystem::path& saved, const HfExport& to);

struct GgufExport {
  std::filesystem::path output;            // the .gguf file; must not exist yet
  std::string type = "f16";                // f32, f16, bf16 or q8_0: the matrices' type (norms stay f32)
  std::filesystem::path tokenizer_folder;  // its tokenizer.json (and tokenizer_config.json) become the vocabulary ("": none)
  std::filesystem::path model_folder;      // its config.json's special token ids ("": none)
  std::string name;                        // general.name
};

struct GgufExportResult {
  std::string architecture;  // llama.cpp's: llama, qwen2, qwen3
  std::size_t tensors = 0;
  std::uint64_t bytes = 0;  // of the file
  bool tokenizer = false;   // the vocabulary was written (llama.cpp cannot load a model without it)
  std::vector<std::string> notes;  // what was written otherwise than asked (a matrix not in q8_0 blocks)
};

// A GGUF matrix type loom writes (f32, f16, bf16, q8_0), else a UserError naming them.
void check_gguf_type(const std::string& type);

// Writes `saved` (what save_pretrained wrote) as one GGUF v3 file that llama.cpp reads: its
// architecture's metadata (llama.cpp's key names), the tensors under llama.cpp's names (a Llama's
// query and key rows reordered for its rotary layout, as its converter does) in `to.type` (Q8_0:
// blocks of 32 values, an fp16 scale absmax/127 and 32 rounded int8s), and a byte-level BPE
// tokenizer's vocabulary, merges, special tokens and chat template. Llama, Mistral (without a
// sliding window), Qwen2 and Qwen3 models; rope scaling is refused. Written beside `to.output` and
// renamed into place. Throws UserError.
GgufExportResult write_gguf_export(const std::filesystem::path& saved, const GgufExport& to);

}  // namespace loom::core
