#pragma once
// safetensors files: an 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte span, then the data. Every claim of the header is checked against the
// file before any tensor is touched, so a hostile file is a UserError, never a crash or a giant
// allocation.
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

struct SafetensorInfo {
  std::string name;
  std::string dtype;  // as written: "F32", "BF16", ...
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // byte span inside the data section
  std::uint64_t end = 0;
};

class LOOM_API SafetensorsFile {
 public:
  // Maps the file read-only and validates its header. Throws UserError naming the file.
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<SafetensorInfo>& tensors() const { return tensors_; }  // in file order
  const SafetensorInfo* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A CPU tensor over the mapped bytes (copied only when misaligned). It keeps the mapping
  // alive, so it may outlive this object. Throws UserError for an unknown name or a dtype
  // LibTorch cannot hold.
  at::Tensor tensor(const std::string& name) const;

 private:
  struct Mapping;
  std::filesystem::path path_;
  std::shared_ptr<Mapping> mapping_;
  const std::uint8_t* data_ = nullptr;  // start of the data section
  std::vector<SafetensorInfo> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (moved to CPU, made contiguous) in the order given, atomically.
LOOM_API void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                const std::map<std::string, std::string>& metadata = {});

}  // namespace loom::kit
