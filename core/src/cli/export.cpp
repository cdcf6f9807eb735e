#include "cli/export.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <random>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/formats/gguf.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/hub_cache.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/model.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace gguf = formats::gguf;
namespace {

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
  const fs::path tmp = private_sibling(to.output, "export");
  fs::create_directories(tmp.parent_path().empty() ? fs::path(".") : tmp.parent_path());
  if (!fs::create_directory(tmp)) throw UserError("cannot make the folder " + tmp.string() + ": it exists");
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
    auto config = merged_config(saved, to.model_folder);
    if (to.dtype) {
      config["torch_dtype"] = config_dtype(*to.dtype);  // transformers 4's key
      config["dtype"] = config_dtype(*to.dtype);        // transformers 5's
    }
    kit::write_file_atomically(tmp / "config.json", config.dump(2) + "\n");
    result.copied = write_hf_companions(tmp, to.model_folder, to.tokenizer_folder);
    rename_without_replacing(tmp, to.output, "--output");
  } catch (const fs::filesystem_error& e) {
    kit::remove_tree(tmp);
    throw UserError("cannot write the export into " + to.output.string() + ": " + e.what() + " (nothing was left there)");
  } catch (...) {
    kit::remove_tree(tmp);
    throw;
  }
  return result;
}

namespace {

// Q8_0 blocks of a float32 matrix's rows: per 32 values an fp16 scale d = absmax / 127 and the 32
// values rounded to multiples of d, as ggml's reference quantize_row_q8_0 writes them.
at::Tensor q8_0_blocks(const at::Tensor& matrix) {
  const at::Tensor x = matrix.to(at::kFloat).contiguous().view({-1, formats::gguf::kQ8Block});
  const at::Tensor d = x.abs().amax(1) / 127.0f;
  const at::Tensor inverse = at::where(d > 0, 1.0f / d, at::zeros_like(d));
  const at::Tensor q = (x * inverse.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar);
  return at::cat({d.to(at::kHalf).unsqueeze(1).view(at::kByte), q.view(at::kByte)}, 1).contiguous();
}

std::string read_text(const fs::path& file) { return kit::read_regular_file(file, 64u << 20, "tokenizer file"); }

}  // namespace

void check_export_output(const fs::path& output, const std::string& flag) {
  std::error_code ec;
  if (fs::symlink_status(output, ec).type() != fs::file_type::not_found)
    throw UserError(flag + " " + output.string() + " already exists; name a new one (nothing was written)");
  // The nearest folder that exists: the export creates the rest.
  fs::path existing = output.parent_path().empty() ? fs::path(".") : output.parent_path();
  while (!existing.empty() && fs::symlink_status(existing, ec).type() == fs::file_type::not_found) existing = existing.parent_path();
  if (existing.empty()) existing = ".";
  if (!fs::is_directory(existing, ec))
    throw UserError(flag + " " + output.string() + ": " + existing.string() + " is not a folder; name a path under a folder");
  if (::access(existing.c_str(), W_OK | X_OK) != 0)
    throw UserError(flag + " " + output.string() + ": cannot write in " + existing.string() + ": " + std::strerror(errno) + "; name a place loom may write");
}

fs::path private_sibling(const fs::path& output, const std::string& tag, std::uint64_t token) {
  const fs::path parent = output.parent_path().empty() ? fs::path(".") : output.parent_path();
  if (token == 0) {
    std::random_device entropy;
    token = (static_cast<std::uint64_t>(::getpid()) << 32) ^ (static_cast<std::uint64_t>(entropy()) << 8) ^ entropy();
  }
  char hex[24];
  std::snprintf(hex, sizeof hex, "%llx", static_cast<unsigned long long>(token));
  return parent / ("." + output.filename().string() + "." + tag + "-" + hex);
}

void rename_without_replacing(const fs::path& from, const fs::path& to, const std::string& flag) {
  // rename(2) would replace a file, or an empty folder, that appeared at `to` meanwhile.
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  const int error = errno;
  if (error == EEXIST)
    throw UserError(flag + " " + to.string() + " appeared while this export ran (another export to it?); it was left as it is");
  if (error == EINVAL || error == ENOSYS) {  // a filesystem without RENAME_NOREPLACE
    std::error_code ec;
    if (fs::symlink_status(to, ec).type() != fs::file_type::not_found)
      throw UserError(flag + " " + to.string() + " appeared while this export ran (another export to it?); it was left as it is");
    fs::rename(from, to);
    return;
  }
  throw UserError("cannot move the export into " + to.string() + ": " + std::strerror(error));
}

void check_gguf_type(const std::string& type) {
  if (type != "f32" && type != "f16" && type != "bf16" && type != "q8_0") throw UserError("--gguf-type " + type + ": use f32, f16, bf16 or q8_0");
}

GgufExportResult write_gguf_export(const fs::path& saved, const GgufExport& to) {
  std::error_code ec;
  if (fs::exists(to.output, ec)) throw UserError("--output " + to.output.string() + " already exists; name a new file (nothing was written)");
  check_gguf_type(to.type);
  const auto config = merged_config(saved, to.model_folder);
  const kit::json::Value c(config, (saved / "config.json").string());
  const std::string model_type = c["model_type"].string();
  GgufExportResult result;
  bool permute_rotary = false;
  if (model_type == "llama" || model_type == "mistral") {
    result.architecture = "llama";
    permute_rotary = true;  // llama.cpp's llama rotates pairs of adjacent values, transformers' the two halves
  } else if (model_type == "qwen2" || model_type == "qwen3") {
    result.architecture = model_type;  // rotates halves, as transformers does
  } else {
    throw UserError("GGUF export writes Llama, Mistral, Qwen2 and Qwen3 models; this one's model_type is \"" + model_type +
                    "\": export it as a Hugging Face folder (leave out --format gguf) and convert that with llama.cpp's convert_hf_to_gguf.py");
  }
  if (config.contains("rope_scaling") && !config["rope_scaling"].is_null())
    throw UserError("GGUF export does not write rope scaling (config.json's rope_scaling) yet; export a Hugging Face folder and convert it with "
                    "llama.cpp's convert_hf_to_gguf.py");
  if (model_type == "mistral" && config.contains("sliding_window") && !config["sliding_window"].is_null())
    throw UserError("GGUF export does not write a sliding window (config.json's sliding_window) yet; export a Hugging Face folder instead");
  const auto hidden = c["hidden_size"].integer(1, 1 << 20), heads = c["num_attention_heads"].integer(1, 1 << 16);
  const auto kv_heads = config.contains("num_key_value_heads") && !config["num_key_value_heads"].is_null() ? c["num_key_value_heads"].integer(1, heads) : heads;
  const auto head_dim = config.contains("head_dim") && !config["head_dim"].is_null() ? c["head_dim"].integer(1, 1 << 16) : hidden / heads;
  double rope_theta = 10000.0;
  if (config.contains("rope_theta")) rope_theta = c["rope_theta"].number();
  else if (config.contains("rope_parameters") && config["rope_parameters"].contains("rope_theta")) rope_theta = c["rope_parameters"]["rope_theta"].number();

  gguf::Metadata h;
  const std::string& a = result.architecture;
  h.kv("general.architecture", a);
  h.kv("general.name", to.name);
  const std::map<std::string, std::uint32_t> file_types = {{"f32", 0}, {"f16", 1}, {"q8_0", 7}, {"bf16", 32}};
  h.kv_u32("general.file_type", file_types.at(to.type));
  if (to.type == "q8_0") h.kv_u32("general.quantization_version", 2);
  h.kv_u32(a + ".context_length", static_cast<std::uint32_t>(c["max_position_embeddings"].integer(1, std::int64_t{1} << 31)));
  h.kv_u32(a + ".embedding_length", static_cast<std::uint32_t>(hidden));
  h.kv_u32(a + ".block_count", static_cast<std::uint32_t>(c["num_hidden_layers"].integer(1, 1 << 16)));
  h.kv_u32(a + ".feed_forward_length", static_cast<std::uint32_t>(c["intermediate_size"].integer(1, std::int64_t{1} << 31)));
  h.kv_u32(a + ".attention.head_count", static_cast<std::uint32_t>(heads));
  h.kv_u32(a + ".attention.head_count_kv", static_cast<std::uint32_t>(kv_heads));
  h.kv_f32(a + ".attention.layer_norm_rms_epsilon", static_cast<float>(config.contains("rms_norm_eps") ? c["rms_norm_eps"].number() : 1e-6));
  h.kv_f32(a + ".rope.freq_base", static_cast<float>(rope_theta));
  h.kv_u32(a + ".rope.dimension_count", static_cast<std::uint32_t>(head_dim));
  if (head_dim != hidden / heads) {
    h.kv_u32(a + ".attention.key_length", static_cast<std::uint32_t>(head_dim));
    h.kv_u32(a + ".attention.value_length", static_cast<std::uint32_t>(head_dim));
  }
  const auto vocab_size = c["vocab_size"].integer(1, std::int64_t{1} << 31);
  if (a == "llama") h.kv_u32("llama.vocab_size", static_cast<std::uint32_t>(vocab_size));

  // The vocabulary of a byte-level BPE tokenizer.json, as llama.cpp's "gpt2" tokenizer model reads
  // it: every id up to vocab_size a token (a gap "[PADn]", unused), added special tokens control.
  if (!to.tokenizer_folder.empty() && fs::is_regular_file(to.tokenizer_folder / "tokenizer.json", ec)) {
    const fs::path file = to.tokenizer_folder / "tokenizer.json";
    const auto tokenizer = kit::json::parse(read_text(file), file.string());
    const auto& model = tokenizer.at("model");
    // Byte-level: a ByteLevel pre-tokenizer (alone or in a sequence) and no byte fallback; a
    // SentencePiece-style BPE (Llama 2, Mistral v0.3: Metaspace, byte_fallback) is llama.cpp's
    // "llama" model, with scores, which this writer does not write.
    const auto byte_level = [](const nlohmann::json& pre) {
      if (!pre.is_object()) return false;
      if (pre.value("type", "") == "ByteLevel") return true;
      if (pre.value("type", "") != "Sequence" || !pre.contains("pretokenizers") || !pre["pretokenizers"].is_array()) return false;
      for (const auto& p : pre["pretokenizers"])
        if (p.is_object() && p.value("type", "") == "ByteLevel") return true;
      return false;
    };
    const bool bpe = model.is_object() && model.value("type", "") == "BPE" && model.contains("vocab") && model["vocab"].is_object();
    const bool fallback = bpe && model.contains("byte_fallback") && model["byte_fallback"].is_boolean() && model["byte_fallback"].get<bool>();
    if (!bpe || fallback || !tokenizer.contains("pre_tokenizer") || !byte_level(tokenizer["pre_tokenizer"]))
      throw UserError(file.string() + ": GGUF export writes byte-level BPE tokenizers (Llama 3, Qwen) only; this one is " +
                      (!bpe ? "a " + (model.is_object() ? model.value("type", std::string("?")) : std::string("?")) + " model"
                            : fallback ? "a BPE with byte fallback (SentencePiece-style: Llama 2, Mistral)" : "a BPE without a ByteLevel pre-tokenizer") +
                      ": export a Hugging Face folder and convert it with llama.cpp's convert_hf_to_gguf.py");
    std::vector<std::string> tokens(static_cast<std::size_t>(vocab_size));
    std::vector<std::int32_t> types(static_cast<std::size_t>(vocab_size), 5);  // unused
    std::vector<bool> set(static_cast<std::size_t>(vocab_size), false);
    const auto place = [&](const std::string& token, std::int64_t id, std::int32_t type) {
      if (id < 0 || id >= vocab_size)
        throw UserError(file.string() + ": token " + kit::json::quote(token, 40) + " has id " + std::to_string(id) + ", outside the model's " +
                        std::to_string(vocab_size) + " (config.json's vocab_size)");
      tokens[static_cast<std::size_t>(id)] = token;
      types[static_cast<std::size_t>(id)] = type;
      set[static_cast<std::size_t>(id)] = true;
    };
    for (const auto& [token, id] : model["vocab"].items()) place(token, id.get<std::int64_t>(), 1);
    if (tokenizer.contains("added_tokens") && tokenizer["added_tokens"].is_array())
      for (const auto& t : tokenizer["added_tokens"]) place(t.at("content").get<std::string>(), t.at("id").get<std::int64_t>(), t.value("special", false) ? 3 : 4);
    for (std::size_t i = 0; i < tokens.size(); ++i)
      if (!set[i]) tokens[i] = "[PAD" + std::to_string(i) + "]";
    std::vector<std::string> merges;
    if (model.contains("merges"))
      for (const auto& m : model["merges"]) {
        if (m.is_string()) merges.push_back(m.get<std::string>());
        else if (m.is_array() && m.size() == 2) merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
      }
    h.kv("tokenizer.ggml.model", "gpt2");
    h.kv("tokenizer.ggml.pre", a == "llama" ? "llama-bpe" : "qwen2");
    h.kv_strings("tokenizer.ggml.tokens", tokens);
    h.kv_i32s("tokenizer.ggml.token_type", types);
    h.kv_strings("tokenizer.ggml.merges", merges);
    for (const auto& [key, name] : std::vector<std::pair<std::string, std::string>>{
             {"bos_token_id", "tokenizer.ggml.bos_token_id"}, {"eos_token_id", "tokenizer.ggml.eos_token_id"}, {"pad_token_id", "tokenizer.ggml.padding_token_id"}}) {
      const auto it = config.find(key);
      if (it == config.end() || it->is_null()) continue;
      const auto id = it->is_array() ? (it->empty() ? -1 : (*it)[0].get<std::int64_t>()) : it->get<std::int64_t>();
      if (id >= 0 && id < vocab_size) h.kv_u32(name, static_cast<std::uint32_t>(id));
    }
    std::string chat_template;
    if (fs::is_regular_file(to.tokenizer_folder / "chat_template.jinja", ec)) chat_template = read_text(to.tokenizer_folder / "chat_template.jinja");
    if (fs::is_regular_file(to.tokenizer_folder / "tokenizer_config.json", ec)) {
      const auto tc = kit::json::parse(read_text(to.tokenizer_folder / "tokenizer_config.json"), (to.tokenizer_folder / "tokenizer_config.json").string());
      if (chat_template.empty() && tc.contains("chat_template") && tc["chat_template"].is_string()) chat_template = tc["chat_template"].get<std::string>();
      if (tc.contains("add_bos_token") && tc["add_bos_token"].is_boolean()) h.kv_bool("tokenizer.ggml.add_bos_token", tc["add_bos_token"].get<bool>());
    }
    if (!chat_template.empty()) h.kv("tokenizer.chat_template", chat_template);
    result.tokenizer = true;
  }

  // The tensors, in the saved order, each converted when written (one at a time in memory).
  std::vector<std::unique_ptr<kit::SafetensorsFile>> files;
  std::vector<std::pair<std::size_t, std::string>> sources;  // each tensor's file and HF name
  std::vector<gguf::TensorInfo> infos;
  for (const auto& path : weight_files(saved)) {
    files.push_back(std::make_unique<kit::SafetensorsFile>(path));
    for (const auto& info : files.back()->tensors()) {
      const std::string name = gguf::tensor_name(info.name);
      if (name.empty()) throw UserError("GGUF export has no llama.cpp name for the tensor " + info.name + " of this " + model_type + " model");
      gguf::TensorType type = gguf::kF32;
      if (info.shape.size() == 2) {
        type = to.type == "f16" ? gguf::kF16 : to.type == "bf16" ? gguf::kBF16 : to.type == "q8_0" ? gguf::kQ8_0 : gguf::kF32;
        if (type == gguf::kQ8_0 && info.shape[1] % gguf::kQ8Block != 0) {
          type = gguf::kF16;
          result.notes.push_back(name + " in f16: its rows of " + std::to_string(info.shape[1]) + " values are no whole number of q8_0 blocks");
        }
      }
      sources.emplace_back(files.size() - 1, info.name);
      infos.push_back({name, info.shape, type});
    }
  }
  const gguf::Layout layout = gguf::lay_out(h, infos);
  const std::string& head = layout.head;

  const fs::path tmp = private_sibling(to.output, "tmp");
  if (!to.output.parent_path().empty()) fs::create_directories(to.output.parent_path());
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw UserError("cannot write " + tmp.string());
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
    std::uint64_t written = 0;
    for (std::size_t i = 0; i < infos.size(); ++i) {
      const gguf::TensorInfo& e = infos[i];
      const std::uint64_t at = layout.offsets[i];
      const std::string pad(at - written, '\0');
      out.write(pad.data(), static_cast<std::streamsize>(pad.size()));
      at::Tensor t = files[sources[i].first]->tensor(sources[i].second).to(at::kFloat);
      const bool query = e.name.find(".attn_q.") != std::string::npos, key = e.name.find(".attn_k.") != std::string::npos;
      if (permute_rotary && (query || key)) {
        // Each head's rows from transformers' halves order (the first half of a head's rotary
        // pairs, then the second) to llama.cpp's interleaved pairs.
        const std::int64_t n = query ? heads : kv_heads, rows = t.size(0);
        auto shape = t.sizes().vec();
        shape[0] = rows / n / 2;
        shape.insert(shape.begin(), {n, 2});
        t = t.reshape(shape).transpose(1, 2).reshape(t.sizes()).contiguous();
      }
      at::Tensor data = e.type == gguf::kQ8_0 ? q8_0_blocks(t)
                        : e.type == gguf::kF16 ? t.to(at::kHalf).contiguous()
                        : e.type == gguf::kBF16 ? t.to(at::kBFloat16).contiguous()
                                                : t.contiguous();
      const std::uint64_t bytes = gguf::tensor_bytes(e.type, static_cast<std::uint64_t>(t.numel()));
      if (static_cast<std::uint64_t>(data.numel()) * data.element_size() != bytes) throw std::logic_error("gguf tensor size for " + e.name);
      out.write(static_cast<const char*>(data.data_ptr()), static_cast<std::streamsize>(bytes));
      written = at + bytes;
    }
    out.flush();
    if (!out) throw UserError("cannot write " + tmp.string() + " (a full disk?)");
    out.close();
    rename_without_replacing(tmp, to.output, "--output");
    result.bytes = head.size() + written;
  } catch (...) {
    fs::remove(tmp, ec);
    throw;
  }
  result.tensors = infos.size();
  return result;
}

}  // namespace loom::core
