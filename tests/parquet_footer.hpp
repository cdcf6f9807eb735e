#pragma once
// Parquet footers written by hand, for tests of hostile files (a footer that lies about where its
// column chunks are). Header-only and torch-free: loom_tests and the formats library's own tests
// share it.
#include <cstdint>
#include <string>
#include <vector>

namespace loom::test {

// Thrift's compact protocol, as Parquet writes its footer: enough to lay out a file's metadata.
class CompactWriter {
 public:
  enum Type { kI32 = 5, kI64 = 6, kBinary = 8, kList = 9, kStruct = 12 };
  void i32(int id, std::int32_t v) {
    field(id, kI32);
    varint(zigzag(v));
  }
  void i64(int id, std::int64_t v) {
    field(id, kI64);
    varint(zigzag(v));
  }
  void binary(int id, const std::string& s) {
    field(id, kBinary);
    varint(s.size());
    out_ += s;
  }
  // A list of `n` structs: each written between begin_element() and end_struct().
  void struct_list(int id, std::size_t n) {
    field(id, kList);
    if (n < 15) out_ += static_cast<char>((n << 4) | kStruct);
    else out_ += static_cast<char>(0xF0 | kStruct), varint(n);
  }
  void binary_list(int id, const std::vector<std::string>& items) {
    field(id, kList);
    out_ += static_cast<char>((items.size() << 4) | kBinary);
    for (const auto& item : items) varint(item.size()), out_ += item;
  }
  void begin_element() { last_.push_back(0); }
  void begin_struct(int id) {
    field(id, kStruct);
    last_.push_back(0);
  }
  void end_struct() {
    out_ += '\0';
    last_.pop_back();
  }
  const std::string& bytes() const { return out_; }

 private:
  static std::uint64_t zigzag(std::int64_t v) { return (static_cast<std::uint64_t>(v) << 1) ^ static_cast<std::uint64_t>(v >> 63); }
  void varint(std::uint64_t v) {
    for (; v >= 0x80; v >>= 7) out_ += static_cast<char>((v & 0x7F) | 0x80);
    out_ += static_cast<char>(v);
  }
  void field(int id, int type) {
    const int delta = id - last_.back();
    if (delta > 0 && delta <= 15) out_ += static_cast<char>((delta << 4) | type);
    else out_ += static_cast<char>(type), varint(zigzag(id));
    last_.back() = id;
  }
  std::string out_;
  std::vector<int> last_{0};
};

// A Parquet file of one row group whose string columns `names` each claim the chunk of `claimed`
// bytes at offset 4 (the same bytes for all: a damaged or hostile footer), `chunk` bytes there.
inline std::string parquet_with_shared_chunk(const std::vector<std::string>& names, std::size_t chunk, std::size_t claimed = 0) {
  if (claimed == 0) claimed = chunk;
  CompactWriter w;
  w.begin_element();
  w.i32(1, 1);  // version
  w.struct_list(2, names.size() + 1);
  w.begin_element();
  w.binary(4, "schema");
  w.i32(5, static_cast<std::int32_t>(names.size()));
  w.end_struct();
  for (const auto& name : names) {
    w.begin_element();
    w.i32(1, 6);  // BYTE_ARRAY
    w.i32(3, 0);  // required
    w.binary(4, name);
    w.end_struct();
  }
  w.i64(3, 1);  // rows
  w.struct_list(4, 1);
  w.begin_element();
  w.struct_list(1, names.size());
  for (const auto& name : names) {
    w.begin_element();
    w.i64(2, 4);
    w.begin_struct(3);
    w.i32(1, 6);
    w.binary_list(3, {name});
    w.i32(4, 0);  // uncompressed
    w.i64(5, 1);
    w.i64(6, static_cast<std::int64_t>(claimed));
    w.i64(7, static_cast<std::int64_t>(claimed));
    w.i64(9, 4);
    w.end_struct();
    w.end_struct();
  }
  w.i64(2, static_cast<std::int64_t>(chunk));
  w.i64(3, 1);
  w.end_struct();
  w.end_struct();
  const std::string& footer = w.bytes();
  std::string file = "PAR1" + std::string(chunk, 'x') + footer;
  for (int i = 0; i < 4; ++i) file.push_back(static_cast<char>((footer.size() >> (8 * i)) & 0xFF));
  return file + "PAR1";
}

}  // namespace loom::test
