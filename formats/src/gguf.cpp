#include "loom/formats/gguf.hpp"

#include <utility>

namespace loom::formats::gguf {
namespace {

// GGUF's value types.
enum ValueType : std::uint32_t { kU32 = 4, kI32 = 5, kF32Value = 6, kBool = 7, kString = 8, kArray = 9 };

void raw(std::string& out, const void* p, std::size_t n) { out.append(static_cast<const char*>(p), n); }
void u32(std::string& out, std::uint32_t v) { raw(out, &v, 4); }
void u64(std::string& out, std::uint64_t v) { raw(out, &v, 8); }
void str(std::string& out, const std::string& v) {
  u64(out, v.size());
  out += v;
}
std::uint64_t aligned(std::uint64_t at) { return (at + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

void Metadata::key(const std::string& key, std::uint32_t type) {
  str(bytes_, key);
  u32(bytes_, type);
  ++count_;
}

void Metadata::kv(const std::string& k, const std::string& v) {
  key(k, kString);
  str(bytes_, v);
}

void Metadata::kv_u32(const std::string& k, std::uint32_t v) {
  key(k, kU32);
  u32(bytes_, v);
}

void Metadata::kv_f32(const std::string& k, float v) {
  key(k, kF32Value);
  raw(bytes_, &v, 4);
}

void Metadata::kv_bool(const std::string& k, bool v) {
  key(k, kBool);
  bytes_.push_back(v ? 1 : 0);
}

void Metadata::kv_strings(const std::string& k, const std::vector<std::string>& v) {
  key(k, kArray);
  u32(bytes_, kString);
  u64(bytes_, v.size());
  for (const auto& x : v) str(bytes_, x);
}

void Metadata::kv_i32s(const std::string& k, const std::vector<std::int32_t>& v) {
  key(k, kArray);
  u32(bytes_, kI32);
  u64(bytes_, v.size());
  for (const auto x : v) raw(bytes_, &x, 4);
}

std::uint64_t tensor_bytes(TensorType type, std::uint64_t values) {
  switch (type) {
    case kQ8_0: return values / kQ8Block * 34;
    case kF32: return values * 4;
    default: return values * 2;
  }
}

Layout lay_out(const Metadata& metadata, const std::vector<TensorInfo>& tensors) {
  Layout layout;
  std::string infos;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    std::uint64_t values = 1;
    for (const auto d : t.shape) values *= static_cast<std::uint64_t>(d);
    offset = aligned(offset);
    layout.offsets.push_back(offset);
    str(infos, t.name);
    u32(infos, static_cast<std::uint32_t>(t.shape.size()));
    for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) u64(infos, static_cast<std::uint64_t>(*d));  // ggml: the fastest dimension first
    u32(infos, t.type);
    u64(infos, offset);
    offset += tensor_bytes(t.type, values);
  }
  layout.data_bytes = offset;
  u32(layout.head, 0x46554747);  // "GGUF"
  u32(layout.head, 3);
  u64(layout.head, tensors.size());
  u64(layout.head, metadata.count());
  layout.head += metadata.bytes() + infos;
  layout.head.resize(aligned(layout.head.size()), '\0');
  return layout;
}

std::string tensor_name(const std::string& hf) {
  static const std::vector<std::pair<std::string, std::string>> whole = {
      {"model.embed_tokens.weight", "token_embd.weight"}, {"model.norm.weight", "output_norm.weight"}, {"lm_head.weight", "output.weight"}};
  for (const auto& [from, to] : whole)
    if (hf == from) return to;
  static const std::vector<std::pair<std::string, std::string>> layer = {
      {"input_layernorm.weight", "attn_norm.weight"},      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},        {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},            {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},            {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},   {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"}, {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},             {"mlp.down_proj.weight", "ffn_down.weight"}};
  const std::string prefix = "model.layers.";
  if (hf.rfind(prefix, 0) != 0) return "";
  const auto dot = hf.find('.', prefix.size());
  if (dot == std::string::npos) return "";
  const std::string index = hf.substr(prefix.size(), dot - prefix.size()), rest = hf.substr(dot + 1);
  if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) return "";
  for (const auto& [from, to] : layer)
    if (rest == from) return "blk." + index + "." + to;
  return "";
}

}  // namespace loom::formats::gguf
