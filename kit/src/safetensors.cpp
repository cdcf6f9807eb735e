#include "loom/kit/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <ATen/Functions.h>
#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"

namespace loom::kit {
namespace {

// Real headers are kilobytes to a few megabytes (a 405B checkpoint's index is ~1 MiB); the
// bound keeps a hostile length from turning into an allocation.
constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;

struct DtypeInfo {
  const char* name;
  std::uint64_t bytes;
  c10::ScalarType torch;
  bool supported;
};
constexpr DtypeInfo kDtypes[] = {
    {"F64", 8, c10::ScalarType::Double, true},  {"F32", 4, c10::ScalarType::Float, true},
    {"F16", 2, c10::ScalarType::Half, true},    {"BF16", 2, c10::ScalarType::BFloat16, true},
    {"I64", 8, c10::ScalarType::Long, true},    {"I32", 4, c10::ScalarType::Int, true},
    {"I16", 2, c10::ScalarType::Short, true},   {"I8", 1, c10::ScalarType::Char, true},
    {"U8", 1, c10::ScalarType::Byte, true},     {"BOOL", 1, c10::ScalarType::Bool, true},
    {"F8_E4M3", 1, c10::ScalarType::Byte, false}, {"F8_E5M2", 1, c10::ScalarType::Byte, false},
    {"U16", 2, c10::ScalarType::Short, false},  {"U32", 4, c10::ScalarType::Int, false},
    {"U64", 8, c10::ScalarType::Long, false},
};

const DtypeInfo* dtype_info(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

const DtypeInfo* dtype_of(c10::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.supported && d.torch == t) return &d;
  return nullptr;
}

}  // namespace

struct SafetensorsFile::Mapping {
  void* address = nullptr;
  std::size_t size = 0;
  ~Mapping() {
    if (address != nullptr && address != MAP_FAILED) ::munmap(address, size);
  }
};

SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  const std::string where = path.string();
  const auto bad = [&](const std::string& why) { return UserError(where + ": not a valid safetensors file: " + why); };

  const int fd = open_regular_file(path, "safetensors file");
  struct stat st {};
  ::fstat(fd, &st);
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    throw bad("file is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  }
  mapping_ = std::make_shared<Mapping>();
  mapping_->size = static_cast<std::size_t>(file_size);
  mapping_->address = ::mmap(nullptr, mapping_->size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (mapping_->address == MAP_FAILED) throw UserError(where + ": cannot map: " + std::strerror(errno));
  const auto* bytes = static_cast<const std::uint8_t*>(mapping_->address);

  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > file_size - 8)
    throw bad("header claims " + std::to_string(header_len) + " bytes but the file has " + std::to_string(file_size - 8) + " after the length");
  if (header_len > kMaxHeaderBytes) throw bad("header of " + std::to_string(header_len) + " bytes is larger than the 100 MiB allowed");
  data_ = bytes + 8 + header_len;
  const std::uint64_t data_size = file_size - 8 - header_len;

  const nlohmann::json header =
      json::parse(std::string_view(reinterpret_cast<const char*>(bytes + 8), static_cast<std::size_t>(header_len)), where + " (header)");
  if (!header.is_object()) throw bad("header is not a JSON object");

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw bad("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) throw bad("__metadata__ value of '" + k + "' is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string who = "tensor '" + name + "'";
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      throw bad(who + " lacks dtype, shape or data_offsets");
    if (!entry["dtype"].is_string()) throw bad(who + ": dtype is not a string");
    SafetensorInfo info;
    info.name = name;
    info.dtype = entry["dtype"].get<std::string>();
    const DtypeInfo* dt = dtype_info(info.dtype);
    if (dt == nullptr) throw bad(who + ": unknown dtype \"" + info.dtype + "\"");
    const auto& shape = entry["shape"];
    if (!shape.is_array() || shape.size() > 16) throw bad(who + ": shape is not an array of at most 16 dimensions");
    std::uint64_t elements = 1;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) throw bad(who + ": shape holds " + json::describe(d) + ", not a non-negative integer");
      const auto dim = d.get<std::uint64_t>();
      if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (dim != 0 && elements > std::numeric_limits<std::uint64_t>::max() / dim))
        throw bad(who + ": shape overflows");
      elements *= dim;
      info.shape.push_back(static_cast<std::int64_t>(dim));
    }
    const auto& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
      throw bad(who + ": data_offsets is not [begin, end]");
    info.begin = offsets[0].get<std::uint64_t>();
    info.end = offsets[1].get<std::uint64_t>();
    if (info.begin > info.end) throw bad(who + ": data_offsets begin after they end");
    if (info.end > data_size)
      throw bad(who + ": bytes " + std::to_string(info.begin) + ".." + std::to_string(info.end) + " lie past the end of the data (" +
                std::to_string(data_size) + " bytes; truncated file?)");
    if (elements > std::numeric_limits<std::uint64_t>::max() / dt->bytes || elements * dt->bytes != info.end - info.begin)
      throw bad(who + ": shape and dtype need " + std::to_string(elements) + " x " + std::to_string(dt->bytes) + " bytes but the span holds " +
                std::to_string(info.end - info.begin));
    tensors_.push_back(std::move(info));
  }
  // Spans must tile the data section exactly, as the format requires: no overlap, no gaps.
  std::vector<const SafetensorInfo*> by_offset;
  for (const auto& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return std::tie(a->begin, a->end) < std::tie(b->begin, b->end); });
  std::uint64_t cursor = 0;
  for (const auto* t : by_offset) {
    if (t->begin < cursor) throw bad("tensor '" + t->name + "' overlaps the tensor before it");
    if (t->begin > cursor) throw bad("a gap of " + std::to_string(t->begin - cursor) + " bytes precedes tensor '" + t->name + "'");
    cursor = t->end;
  }
  if (cursor != data_size) throw bad(std::to_string(data_size - cursor) + " bytes after the last tensor belong to none");
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const SafetensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorInfo* info = find(name);
  if (info == nullptr) throw UserError(path_.string() + ": no tensor named '" + name + "'");
  const DtypeInfo* dt = dtype_info(info->dtype);
  if (!dt->supported) throw UserError(path_.string() + ": tensor '" + name + "' has dtype " + info->dtype + ", which loom cannot load");
  auto options = at::TensorOptions().dtype(dt->torch).device(c10::kCPU);
  void* address = const_cast<std::uint8_t*>(data_ + info->begin);
  if (reinterpret_cast<std::uintptr_t>(address) % dt->bytes != 0) {
    at::Tensor copy = at::empty(info->shape, options);
    std::memcpy(copy.data_ptr(), address, info->end - info->begin);
    return copy;
  }
  auto keep = mapping_;
  // The mapping is read-only: callers copy (to(), clone()) before writing.
  return at::from_blob(address, info->shape, [keep](void*) {}, options);
}

void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> cpu;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const DtypeInfo* dt = dtype_of(t.scalar_type());
    if (dt == nullptr) throw UserError("cannot write tensor '" + name + "' of type " + std::string(c10::toString(t.scalar_type())) + " to safetensors");
    if (header.contains(name)) throw UserError("cannot write tensor '" + name + "' twice to " + path.string());
    at::Tensor c = t.detach().to(c10::kCPU).contiguous();
    const std::uint64_t size = static_cast<std::uint64_t>(c.numel()) * dt->bytes;
    header[name] = {{"dtype", dt->name}, {"shape", c.sizes().vec()}, {"data_offsets", {offset, offset + size}}};
    offset += size;
    cpu.push_back(std::move(c));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned, as the reference writer does
  std::uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  AtomicFileWriter out(path);
  out.write(length, 8);
  out.write(text);
  for (const auto& c : cpu) out.write(c.data_ptr(), static_cast<std::size_t>(c.numel()) * c.element_size());
  out.commit();
}

}  // namespace loom::kit
