#pragma once
// GGUF v3 (ggml's docs/gguf.md), the file llama.cpp loads: little-endian values, strings as a u64
// length and bytes; a header (magic, version, counts), key-values, tensor infos, then the tensors'
// data, each at an offset aligned to 32 bytes. This is the layout; what goes in it (llama.cpp's
// names and keys, the tensors converted) is `loom export`'s (core/src/cli/export.cpp).
#include <cstdint>
#include <string>
#include <vector>

namespace loom::formats::gguf {

// ggml's tensor types loom writes.
enum TensorType : std::uint32_t { kF32 = 0, kF16 = 1, kQ8_0 = 8, kBF16 = 30 };
inline constexpr std::uint64_t kAlignment = 32;
// Q8_0 stores 32 values a block: an fp16 scale and 32 signed bytes.
inline constexpr std::int64_t kQ8Block = 32;

// The key-value metadata, in the order given.
class Metadata {
 public:
  void kv(const std::string& key, const std::string& value);
  void kv_u32(const std::string& key, std::uint32_t value);
  void kv_f32(const std::string& key, float value);
  void kv_bool(const std::string& key, bool value);
  void kv_strings(const std::string& key, const std::vector<std::string>& values);
  void kv_i32s(const std::string& key, const std::vector<std::int32_t>& values);
  std::uint64_t count() const { return count_; }
  const std::string& bytes() const { return bytes_; }

 private:
  void key(const std::string& key, std::uint32_t type);
  std::string bytes_;
  std::uint64_t count_ = 0;
};

struct TensorInfo {
  std::string name;                 // llama.cpp's
  std::vector<std::int64_t> shape;  // PyTorch's order (the file's is the reverse: the fastest dimension first)
  TensorType type = kF32;
};

// The bytes a tensor of `values` takes in `type`.
std::uint64_t tensor_bytes(TensorType type, std::uint64_t values);

// The file's layout: the header through the tensor infos, padded to the alignment (the data starts
// right after it), and each tensor's offset within the data.
struct Layout {
  std::string head;
  std::vector<std::uint64_t> offsets;
  std::uint64_t data_bytes = 0;  // the last tensor's end
};
Layout lay_out(const Metadata& metadata, const std::vector<TensorInfo>& tensors);

// llama.cpp's name for a Hugging Face tensor of the Llama/Qwen layout ("" for one it has none for).
std::string tensor_name(const std::string& hf);

}  // namespace loom::formats::gguf
