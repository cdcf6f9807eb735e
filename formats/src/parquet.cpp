// Parquet, read as the format's specification (apache/parquet-format) lays it out: a footer of
// Thrift compact-protocol metadata, row groups of column chunks, each a run of pages.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include <nlohmann/json.hpp>

#include "loom/formats/decompress.hpp"
#include "loom/formats/file_bytes.hpp"
#include "loom/formats/table_rows.hpp"
#include "loom/error.hpp"

namespace loom::formats {
namespace {

constexpr int kMaxNesting = 64;
// Pages are a megabyte or so as writers make them; past this one is refused before it is inflated.
constexpr std::int64_t kMaxPageBytes = std::int64_t{256} << 20;
// What a row group's readers hold at once (inflated pages, dictionaries): past this the file is
// refused, however its columns share it out.
constexpr std::uint64_t kMaxHeldBytes = std::uint64_t{1} << 30;

// Thrift's compact protocol, as much of it as Parquet's metadata uses.
class Thrift {
 public:
  enum Type { kStop = 0, kTrue = 1, kFalse = 2, kByte = 3, kI16 = 4, kI32 = 5, kI64 = 6, kDouble = 7, kBinary = 8, kList = 9, kSet = 10, kMap = 11, kStruct = 12 };

  Thrift(const std::uint8_t* data, std::size_t size, std::string where) : p_(data), end_(data + size), where_(std::move(where)) {}

  std::size_t offset_from(const std::uint8_t* start) const { return static_cast<std::size_t>(p_ - start); }
  [[noreturn]] void fail(const std::string& why) const { throw UserError(where_ + "metadata is damaged (" + why + ")"); }

  std::uint8_t byte() {
    if (p_ == end_) fail("it ends early");
    return *p_++;
  }
  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      const std::uint8_t b = byte();
      v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("a number runs past 64 bits");
  }
  std::int64_t i64() {
    const std::uint64_t v = varint();
    return static_cast<std::int64_t>(v >> 1) ^ -static_cast<std::int64_t>(v & 1);
  }
  std::int32_t i32() {
    const std::int64_t v = i64();
    if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max()) fail("a 32-bit number out of range");
    return static_cast<std::int32_t>(v);
  }
  std::string binary() {
    const std::uint64_t n = varint();
    if (n > static_cast<std::uint64_t>(end_ - p_)) fail("a string runs past the end");
    std::string s(reinterpret_cast<const char*>(p_), static_cast<std::size_t>(n));
    p_ += n;
    return s;
  }

  // Each field of a struct: `field(id, type)` reads it (or calls skip).
  template <class Field>
  void fields(Field&& field) {
    if (++depth_ > kMaxNesting) fail("nested too deeply");
    std::int64_t last = 0;
    for (;;) {
      const std::uint8_t header = byte();
      const int type = header & 0x0f;
      if (type == kStop) break;
      const std::int64_t id = (header >> 4) ? last + (header >> 4) : i64();
      last = id;
      field(id, type);
    }
    --depth_;
  }
  // Each element of a list: `element(type)`.
  template <class Element>
  void list(int type, Element&& element) {
    if (type != kList && type != kSet) fail("a list was expected");
    const std::uint8_t header = byte();
    std::uint64_t n = header >> 4;
    if (n == 15) n = varint();
    if (n > static_cast<std::uint64_t>(end_ - p_)) fail("a list claims more elements than bytes left");  // each takes a byte at least
    for (std::uint64_t i = 0; i < n; ++i) element(header & 0x0f);
  }
  // A boolean field carries its value in its type.
  static bool boolean(int type) { return type == kTrue; }

  void skip(int type, bool in_list = false) {
    switch (type) {
      case kTrue:
      case kFalse:
        if (in_list) byte();
        return;
      case kByte: byte(); return;
      case kI16:
      case kI32:
      case kI64: varint(); return;
      case kDouble:
        if (end_ - p_ < 8) fail("it ends early");
        p_ += 8;
        return;
      case kBinary: binary(); return;
      case kList:
      case kSet:
        if (++depth_ > kMaxNesting) fail("nested too deeply");
        list(type, [&](int element) { skip(element, true); });
        --depth_;
        return;
      case kMap: {
        const std::uint64_t n = varint();
        if (n == 0) return;
        if (n > static_cast<std::uint64_t>(end_ - p_)) fail("a map claims more entries than bytes left");
        const std::uint8_t kinds = byte();
        if (++depth_ > kMaxNesting) fail("nested too deeply");
        for (std::uint64_t i = 0; i < n; ++i) {
          skip(kinds >> 4, true);
          skip(kinds & 0x0f, true);
        }
        --depth_;
        return;
      }
      case kStruct: fields([&](std::int64_t, int t) { skip(t); }); return;
      default: fail("unknown field type " + std::to_string(type));
    }
  }

 private:
  const std::uint8_t* p_;
  const std::uint8_t* end_;
  std::string where_;
  int depth_ = 0;
};

// Parquet's physical types, codecs, encodings and page kinds (parquet.thrift).
enum Physical { kBoolean = 0, kInt32 = 1, kInt64 = 2, kInt96 = 3, kFloat = 4, kDouble = 5, kByteArray = 6, kFixedBytes = 7 };
enum Encoding { kPlain = 0, kPlainDictionary = 2, kRle = 3, kBitPacked = 4, kDeltaBinaryPacked = 5, kDeltaLengthByteArray = 6, kDeltaByteArray = 7, kRleDictionary = 8, kByteStreamSplit = 9 };
enum PageKind { kDataPage = 0, kIndexPage = 1, kDictionaryPage = 2, kDataPageV2 = 3 };
enum Repetition { kRequired = 0, kOptional = 1, kRepeated = 2 };
// ConvertedType and LogicalType members that change how a number reads.
constexpr int kConvertedDecimal = 5, kConvertedUint8 = 11, kConvertedUint64 = 14, kConvertedBson = 20, kLogicalDecimal = 5, kLogicalInteger = 10, kLogicalBson = 13;

struct SchemaElement {
  int type = -1;
  int type_length = 0;
  int repetition = kRequired;
  std::string name;
  int num_children = 0;
  int converted = -1;
  int scale = 0;
  int logical = 0;  // the LogicalType union's member, 0 for none
  bool logical_signed = true;
};

struct ChunkMeta {
  int type = -1;
  std::vector<std::string> path;
  int codec = 0;
  std::int64_t compressed_size = -1, data_page_offset = -1, dictionary_page_offset = -1;
  bool external = false;  // held in another file (file_path)
  bool present = false;
};

struct RowGroupMeta {
  std::vector<ChunkMeta> columns;
  std::int64_t rows = -1;
};

struct FileMeta {
  std::vector<SchemaElement> schema;
  std::vector<RowGroupMeta> row_groups;
};

SchemaElement read_schema_element(Thrift& t) {
  SchemaElement e;
  t.fields([&](std::int64_t id, int type) {
    if (id == 1 && type == Thrift::kI32) e.type = t.i32();
    else if (id == 2 && type == Thrift::kI32) e.type_length = t.i32();
    else if (id == 3 && type == Thrift::kI32) e.repetition = t.i32();
    else if (id == 4 && type == Thrift::kBinary) e.name = t.binary();
    else if (id == 5 && type == Thrift::kI32) e.num_children = t.i32();
    else if (id == 6 && type == Thrift::kI32) e.converted = t.i32();
    else if (id == 7 && type == Thrift::kI32) e.scale = t.i32();
    else if (id == 10 && type == Thrift::kStruct) {
      t.fields([&](std::int64_t member, int member_type) {
        e.logical = static_cast<int>(member);
        if (member == kLogicalInteger && member_type == Thrift::kStruct) {
          t.fields([&](std::int64_t f, int ft) {
            if (f == 2 && (ft == Thrift::kTrue || ft == Thrift::kFalse)) e.logical_signed = Thrift::boolean(ft);
            else t.skip(ft);
          });
        } else if (member == kLogicalDecimal && member_type == Thrift::kStruct) {
          t.fields([&](std::int64_t f, int ft) {
            if (f == 1 && ft == Thrift::kI32) e.scale = t.i32();
            else t.skip(ft);
          });
        } else {
          t.skip(member_type);
        }
      });
    } else t.skip(type);
  });
  return e;
}

ChunkMeta read_chunk(Thrift& t) {
  ChunkMeta c;
  t.fields([&](std::int64_t id, int type) {
    if (id == 1 && type == Thrift::kBinary) c.external = !t.binary().empty();
    else if (id == 3 && type == Thrift::kStruct) {
      c.present = true;
      t.fields([&](std::int64_t f, int ft) {
        if (f == 1 && ft == Thrift::kI32) c.type = t.i32();
        else if (f == 3) t.list(ft, [&](int et) { et == Thrift::kBinary ? c.path.push_back(t.binary()) : t.skip(et, true); });
        else if (f == 4 && ft == Thrift::kI32) c.codec = t.i32();
        else if (f == 7 && ft == Thrift::kI64) c.compressed_size = t.i64();
        else if (f == 9 && ft == Thrift::kI64) c.data_page_offset = t.i64();
        else if (f == 11 && ft == Thrift::kI64) c.dictionary_page_offset = t.i64();
        else t.skip(ft);
      });
    } else t.skip(type);
  });
  return c;
}

FileMeta read_file_meta(Thrift& t) {
  FileMeta m;
  t.fields([&](std::int64_t id, int type) {
    if (id == 2) t.list(type, [&](int et) { et == Thrift::kStruct ? m.schema.push_back(read_schema_element(t)) : t.skip(et, true); });
    else if (id == 4)
      t.list(type, [&](int et) {
        if (et != Thrift::kStruct) return t.skip(et, true);
        RowGroupMeta g;
        t.fields([&](std::int64_t f, int ft) {
          if (f == 1) t.list(ft, [&](int ct) { ct == Thrift::kStruct ? g.columns.push_back(read_chunk(t)) : t.skip(ct, true); });
          else if (f == 3 && ft == Thrift::kI64) g.rows = t.i64();
          else t.skip(ft);
        });
        m.row_groups.push_back(std::move(g));
      });
    else t.skip(type);
  });
  return m;
}

struct PageHeader {
  int kind = -1;
  std::int64_t uncompressed = -1, compressed = -1;
  std::int64_t values = -1;
  int encoding = -1, definition_encoding = kRle;
  std::int64_t definition_bytes = 0, repetition_bytes = 0;  // data page v2
  bool v2_compressed = true;
};

PageHeader read_page_header(Thrift& t) {
  PageHeader h;
  t.fields([&](std::int64_t id, int type) {
    if (id == 1 && type == Thrift::kI32) h.kind = t.i32();
    else if (id == 2 && type == Thrift::kI32) h.uncompressed = t.i32();
    else if (id == 3 && type == Thrift::kI32) h.compressed = t.i32();
    else if ((id == 5 || id == 7 || id == 8) && type == Thrift::kStruct) {
      t.fields([&](std::int64_t f, int ft) {
        if (f == 1 && ft == Thrift::kI32) h.values = t.i32();
        else if (id == 5 && f == 2 && ft == Thrift::kI32) h.encoding = t.i32();
        else if (id == 5 && f == 3 && ft == Thrift::kI32) h.definition_encoding = t.i32();
        else if (id == 7 && f == 2 && ft == Thrift::kI32) h.encoding = t.i32();
        else if (id == 8 && f == 4 && ft == Thrift::kI32) h.encoding = t.i32();
        else if (id == 8 && f == 5 && ft == Thrift::kI32) h.definition_bytes = t.i32();
        else if (id == 8 && f == 6 && ft == Thrift::kI32) h.repetition_bytes = t.i32();
        else if (id == 8 && f == 7 && (ft == Thrift::kTrue || ft == Thrift::kFalse)) h.v2_compressed = Thrift::boolean(ft);
        else t.skip(ft);
      });
    } else t.skip(type);
  });
  return h;
}

// `width` bits (up to 64) from `bit` on, least significant first, as Parquet packs them.
std::uint64_t read_bits(const std::uint8_t* data, std::size_t size, std::uint64_t bit, int width, const std::string& where) {
  if (width == 0) return 0;
  if (bit / 8 >= size || (bit + static_cast<std::uint64_t>(width) + 7) / 8 > size) throw UserError(where + "bit-packed values run past the end of their page");
  std::uint64_t value = 0;
  for (int got = 0; got < width;) {
    const std::uint64_t at = bit + static_cast<std::uint64_t>(got);
    const int in_byte = static_cast<int>(at % 8);
    const int take = std::min(8 - in_byte, width - got);
    const std::uint64_t bits = (data[at / 8] >> in_byte) & ((1u << take) - 1);
    value |= bits << got;
    got += take;
  }
  return value;
}

std::uint64_t read_varint(const std::uint8_t* data, std::size_t size, std::size_t& at, const std::string& where) {
  std::uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at >= size) throw UserError(where + "an encoded number runs past the end of its page");
    const std::uint8_t b = data[at++];
    v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
  throw UserError(where + "an encoded number runs past 64 bits");
}

// Parquet's RLE / bit-packing hybrid (definition levels, dictionary indices, booleans).
class RleHybrid {
 public:
  RleHybrid() = default;
  RleHybrid(const std::uint8_t* data, std::size_t size, int width, const std::string* where) : data_(data), size_(size), width_(width), where_(where) {
    if (width < 0 || width > 32) throw UserError(*where + "a bit width of " + std::to_string(width) + " (at most 32 is allowed)");
  }
  std::uint32_t next() {
    while (left_ == 0) start_run();
    --left_;
    if (repeated_) return value_;
    return static_cast<std::uint32_t>(read_bits(data_ + packed_at_, size_ - packed_at_, packed_index_++ * static_cast<std::uint64_t>(width_), width_, *where_));
  }

 private:
  void start_run() {
    if (at_ >= size_) throw UserError(*where_ + "run-length encoded values end before the page's values do");
    const std::uint64_t header = read_varint(data_, size_, at_, *where_);
    if (header & 1) {
      const std::uint64_t groups = header >> 1;
      if (groups > (std::uint64_t{1} << 32)) throw UserError(*where_ + "a bit-packed run is impossibly long");
      repeated_ = false;
      left_ = groups * 8;
      packed_at_ = at_;
      packed_index_ = 0;
      // The last run of a page may be cut short of its padding: reads check the bytes present.
      at_ += static_cast<std::size_t>(std::min<std::uint64_t>(groups * static_cast<std::uint64_t>(width_), size_ - at_));
    } else {
      repeated_ = true;
      left_ = header >> 1;
      const int bytes = (width_ + 7) / 8;
      if (size_ - at_ < static_cast<std::size_t>(bytes)) throw UserError(*where_ + "a run's value runs past the end of its page");
      value_ = 0;
      for (int i = 0; i < bytes; ++i) value_ |= static_cast<std::uint32_t>(data_[at_ + i]) << (8 * i);
      at_ += bytes;
      if (width_ < 32 && value_ >> width_) throw UserError(*where_ + "a run's value does not fit its bit width");
    }
  }

  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0, at_ = 0;
  int width_ = 0;
  const std::string* where_ = nullptr;
  std::uint64_t left_ = 0;
  bool repeated_ = false;
  std::uint32_t value_ = 0;
  std::size_t packed_at_ = 0;
  std::uint64_t packed_index_ = 0;
};

// DELTA_BINARY_PACKED: blocks of miniblocks of bit-packed deltas from a minimum.
class DeltaPacked {
 public:
  DeltaPacked(const std::uint8_t* data, std::size_t size, const std::string* where) : data_(data), size_(size), where_(where) {
    block_size_ = read_varint(data, size, at_, *where);
    miniblocks_ = read_varint(data, size, at_, *where);
    total_ = read_varint(data, size, at_, *where);
    const std::uint64_t first = read_varint(data, size, at_, *where);
    last_ = (first >> 1) ^ -(first & 1);
    if (block_size_ == 0 || block_size_ % 128 || block_size_ > (1u << 20) || miniblocks_ == 0 || block_size_ % miniblocks_ || (block_size_ / miniblocks_) % 32)
      throw UserError(*where + "a delta-encoded block of " + std::to_string(block_size_) + " values in " + std::to_string(miniblocks_) +
                      " miniblocks breaks the format's rules");
    per_mini_ = block_size_ / miniblocks_;
  }
  std::uint64_t count() const { return total_; }
  std::uint64_t next() {
    if (emitted_ >= total_) throw UserError(*where_ + "more values are read than the delta encoding holds");
    if (emitted_++ == 0) return last_;
    if (!in_block_ || mini_pos_ == per_mini_) next_miniblock();
    const int width = widths_[mini_];
    last_ += min_delta_ + read_bits(data_ + mini_at_, size_ - mini_at_, mini_pos_++ * static_cast<std::uint64_t>(width), width, *where_);
    return last_;  // wraps as the format's arithmetic does
  }
  // Where the encoded values end (the next encoding of the page starts there).
  std::size_t end() const {
    std::size_t at = at_;
    std::vector<std::uint8_t> widths;
    for (std::uint64_t left = total_ > 0 ? total_ - 1 : 0; left > 0;) {
      (void)read_varint(data_, size_, at, *where_);
      if (size_ - at < miniblocks_) throw UserError(*where_ + "delta-encoded values end early");
      widths.assign(data_ + at, data_ + at + miniblocks_);
      at += miniblocks_;
      for (std::uint64_t m = 0; m < miniblocks_ && left > 0; ++m) {
        at += static_cast<std::size_t>(per_mini_ * widths[m] / 8);
        if (at > size_) throw UserError(*where_ + "delta-encoded values end early");
        left -= std::min(left, per_mini_);
      }
    }
    return at;
  }

 private:
  void next_miniblock() {
    if (in_block_ && mini_ + 1 < miniblocks_) {
      mini_at_ += static_cast<std::size_t>(per_mini_ * widths_[mini_] / 8);
      ++mini_;
    } else {
      std::size_t at = in_block_ ? mini_at_ + static_cast<std::size_t>(per_mini_ * widths_[mini_] / 8) : at_;
      if (at > size_) throw UserError(*where_ + "delta-encoded values end early");
      const std::uint64_t zigzag = read_varint(data_, size_, at, *where_);
      min_delta_ = (zigzag >> 1) ^ -(zigzag & 1);
      if (size_ - at < miniblocks_) throw UserError(*where_ + "delta-encoded values end early");
      widths_.assign(data_ + at, data_ + at + miniblocks_);
      mini_at_ = at + miniblocks_;
      mini_ = 0;
      in_block_ = true;
    }
    if (mini_at_ > size_) throw UserError(*where_ + "delta-encoded values end early");
    // Checked once entered: the widths of a last block's unused miniblocks may be anything.
    if (widths_[mini_] > 64) throw UserError(*where_ + "a delta miniblock of bit width " + std::to_string(widths_[mini_]));
    mini_pos_ = 0;
  }

  const std::uint8_t* data_;
  std::size_t size_, at_ = 0;
  const std::string* where_;
  std::uint64_t block_size_ = 0, miniblocks_ = 0, per_mini_ = 0, total_ = 0, emitted_ = 0;
  std::uint64_t last_ = 0, min_delta_ = 0;
  std::vector<std::uint8_t> widths_;
  bool in_block_ = false;
  std::uint64_t mini_ = 0, mini_pos_ = 0;
  std::size_t mini_at_ = 0;
};

// What a leaf column holds and how its numbers read.
struct Column {
  std::string name;
  int type = -1;
  int type_length = 0;
  bool optional = false;
  bool is_unsigned = false;
  bool decimal = false;
  int scale = 0;
  std::size_t chunk = 0;  // its place among the row group's column chunks

  nlohmann::ordered_json integer(std::int64_t v) const {
    if (decimal) return static_cast<double>(v) / std::pow(10.0, scale);
    if (is_unsigned) return type == kInt32 ? nlohmann::ordered_json(static_cast<std::uint32_t>(v)) : nlohmann::ordered_json(static_cast<std::uint64_t>(v));
    return v;
  }
  std::size_t width() const {
    switch (type) {
      case kInt32:
      case kFloat: return 4;
      case kInt64:
      case kDouble: return 8;
      case kFixedBytes: return static_cast<std::size_t>(type_length);
      default: return 0;
    }
  }
  // A fixed-width value's bytes (little-endian) as JSON.
  nlohmann::ordered_json fixed(const std::uint8_t* p) const {
    switch (type) {
      case kInt32: {
        std::int32_t v;
        std::memcpy(&v, p, 4);
        return integer(v);
      }
      case kInt64: {
        std::int64_t v;
        std::memcpy(&v, p, 8);
        return integer(v);
      }
      case kFloat: {
        float v;
        std::memcpy(&v, p, 4);
        return float_value(v);
      }
      case kDouble: {
        double v;
        std::memcpy(&v, p, 8);
        return v;
      }
      default: return std::string(reinterpret_cast<const char*>(p), static_cast<std::size_t>(type_length));
    }
  }
};

// The values of one data page, decoded one at a time as rows ask for them.
class Values {
 public:
  virtual ~Values() = default;
  virtual nlohmann::ordered_json next() = 0;
};

class PlainValues : public Values {
 public:
  PlainValues(const Column& column, const std::uint8_t* data, std::size_t size, const std::string* where) : c_(column), data_(data), size_(size), where_(where) {}
  nlohmann::ordered_json next() override {
    if (c_.type == kBoolean) return read_bits(data_, size_, bit_++, 1, *where_) != 0;
    if (c_.type == kByteArray) {
      if (size_ - at_ < 4) throw ended();
      std::uint32_t n;
      std::memcpy(&n, data_ + at_, 4);
      at_ += 4;
      if (size_ - at_ < n) throw ended();
      std::string s(reinterpret_cast<const char*>(data_ + at_), n);
      at_ += n;
      return s;
    }
    const std::size_t w = c_.width();
    if (size_ - at_ < w) throw ended();
    at_ += w;
    return c_.fixed(data_ + at_ - w);
  }

 private:
  UserError ended() const { return UserError(*where_ + "a page's plain values end before its value count does"); }
  const Column& c_;
  const std::uint8_t* data_;
  std::size_t size_, at_ = 0;
  std::uint64_t bit_ = 0;
  const std::string* where_;
};

class DictionaryValues : public Values {
 public:
  DictionaryValues(const std::vector<nlohmann::ordered_json>& dictionary, const std::uint8_t* data, std::size_t size, const std::string* where)
      : dictionary_(dictionary), where_(where) {
    if (size == 0) throw UserError(*where + "a dictionary-encoded page has no bit width");
    indices_ = RleHybrid(data + 1, size - 1, data[0], where);
  }
  nlohmann::ordered_json next() override {
    const std::uint32_t i = indices_.next();
    if (i >= dictionary_.size())
      throw UserError(*where_ + "a value refers to entry " + std::to_string(i) + " of a dictionary of " + std::to_string(dictionary_.size()));
    return dictionary_[i];
  }

 private:
  const std::vector<nlohmann::ordered_json>& dictionary_;
  RleHybrid indices_;
  const std::string* where_;
};

// RLE-encoded booleans: a 4-byte length, then the hybrid at bit width 1.
class RleBooleans : public Values {
 public:
  RleBooleans(const std::uint8_t* data, std::size_t size, const std::string* where) {
    if (size < 4) throw UserError(*where + "RLE booleans without their length");
    std::uint32_t n;
    std::memcpy(&n, data, 4);
    if (n > size - 4) throw UserError(*where + "RLE booleans run past the end of their page");
    bits_ = RleHybrid(data + 4, n, 1, where);
  }
  nlohmann::ordered_json next() override { return bits_.next() != 0; }

 private:
  RleHybrid bits_;
};

class DeltaIntegers : public Values {
 public:
  DeltaIntegers(const Column& column, const std::uint8_t* data, std::size_t size, const std::string* where) : c_(column), deltas_(data, size, where) {}
  nlohmann::ordered_json next() override {
    const std::uint64_t v = deltas_.next();
    return c_.integer(c_.type == kInt32 ? static_cast<std::int32_t>(static_cast<std::uint32_t>(v)) : static_cast<std::int64_t>(v));
  }

 private:
  const Column& c_;
  DeltaPacked deltas_;
};

// DELTA_LENGTH_BYTE_ARRAY: every length (delta-packed), then every value's bytes back to back.
class DeltaLengthStrings : public Values {
 public:
  DeltaLengthStrings(const std::uint8_t* data, std::size_t size, const std::string* where) : lengths_(data, size, where), data_(data), size_(size), where_(where) {
    at_ = lengths_.end();
  }
  std::string next_string() {
    const auto n = static_cast<std::int64_t>(lengths_.next());
    if (n < 0 || static_cast<std::uint64_t>(n) > size_ - at_) throw UserError(*where_ + "a delta-length value runs past the end of its page");
    std::string s(reinterpret_cast<const char*>(data_ + at_), static_cast<std::size_t>(n));
    at_ += static_cast<std::size_t>(n);
    return s;
  }
  nlohmann::ordered_json next() override { return next_string(); }
  std::size_t end() const { return at_; }

 private:
  DeltaPacked lengths_;
  const std::uint8_t* data_;
  std::size_t size_, at_;
  const std::string* where_;
};

// DELTA_BYTE_ARRAY: each value is the previous one's first `prefix` bytes and a suffix.
class DeltaStrings : public Values {
 public:
  DeltaStrings(const std::uint8_t* data, std::size_t size, const std::string* where)
      : prefixes_(data, size, where), suffixes_(data + prefixes_.end(), size - prefixes_.end(), where), where_(where) {}
  nlohmann::ordered_json next() override {
    const auto prefix = static_cast<std::int64_t>(prefixes_.next());
    if (prefix < 0 || static_cast<std::uint64_t>(prefix) > previous_.size())
      throw UserError(*where_ + "a delta value keeps " + std::to_string(prefix) + " bytes of a previous value of " + std::to_string(previous_.size()));
    previous_.resize(static_cast<std::size_t>(prefix));
    previous_ += suffixes_.next_string();
    // A value built of a previous one's prefix and a suffix may not grow past a record's bound.
    if (previous_.size() > kMaxRecordBytes) throw UserError(*where_ + "a delta-encoded value grows past 64 MiB");
    return previous_;
  }

 private:
  DeltaPacked prefixes_;
  DeltaLengthStrings suffixes_;
  std::string previous_;
  const std::string* where_;
};

// BYTE_STREAM_SPLIT: byte k of value i at k * count + i.
class SplitValues : public Values {
 public:
  SplitValues(const Column& column, const std::uint8_t* data, std::size_t size, const std::string* where) : c_(column), data_(data), where_(where) {
    width_ = column.width();
    if (width_ == 0) throw UserError(*where + "byte-stream-split values in a column that is not fixed-width");
    if (size % width_) throw UserError(*where + "byte-stream-split values do not fill their page evenly");
    count_ = size / width_;
  }
  nlohmann::ordered_json next() override {
    if (i_ >= count_) throw UserError(*where_ + "a page's values end before its value count does");
    std::string bytes(width_, '\0');
    for (std::size_t k = 0; k < width_; ++k) bytes[k] = static_cast<char>(data_[k * count_ + i_]);
    ++i_;
    return c_.fixed(reinterpret_cast<const std::uint8_t*>(bytes.data()));
  }

 private:
  const Column& c_;
  const std::uint8_t* data_;
  std::size_t width_ = 0, count_ = 0, i_ = 0;
  const std::string* where_;
};

// One column chunk of a row group, page by page.
class ChunkReader {
 public:
  // `held`: what the row group's readers hold in all, shared among them.
  ChunkReader(const Column& column, std::string bytes, Codec codec, std::string where, std::uint64_t& held)
      : c_(column), bytes_(std::move(bytes)), codec_(codec), where_(std::move(where)), held_(held) {}
  ~ChunkReader() { held_ -= holding_; }
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  nlohmann::ordered_json next() {
    while (left_ == 0) load_page();
    --left_;
    if (c_.optional && levels_.next() == 0) return nullptr;
    return values_->next();
  }

 private:
  const std::uint8_t* at(std::size_t offset) const { return reinterpret_cast<const std::uint8_t*>(bytes_.data()) + offset; }

  void load_page() {
    if (pos_ >= bytes_.size()) throw UserError(where_ + "its pages end before the row group's rows do");
    Thrift t(at(pos_), bytes_.size() - pos_, where_ + "page header: ");
    const PageHeader h = read_page_header(t);
    pos_ += t.offset_from(at(pos_));
    if (h.compressed < 0 || h.uncompressed < 0 || static_cast<std::uint64_t>(h.compressed) > bytes_.size() - pos_)
      throw UserError(where_ + "a page of " + std::to_string(h.compressed) + " bytes runs past its column chunk");
    if (h.uncompressed > kMaxPageBytes)
      throw UserError(where_ + "a page of " + std::to_string(h.uncompressed) + " bytes, more than loom reads in one page (256 MiB); write the file with smaller pages");
    const std::uint8_t* raw = at(pos_);
    const auto raw_size = static_cast<std::size_t>(h.compressed);
    pos_ += raw_size;
    if (h.kind == kDictionaryPage) {
      if (h.encoding != kPlain && h.encoding != kPlainDictionary) throw UserError(where_ + "a dictionary page in encoding " + std::to_string(h.encoding));
      if (c_.type == kBoolean) throw UserError(where_ + "a dictionary of booleans, which the format does not allow");
      hold(0);
      const std::string page = decompress(codec_, raw, raw_size, static_cast<std::size_t>(h.uncompressed), where_);
      PlainValues plain(c_, reinterpret_cast<const std::uint8_t*>(page.data()), page.size(), &where_);
      dictionary_.clear();
      std::uint64_t bytes = 0;
      for (std::int64_t i = 0; i < h.values; ++i) {  // each takes page bytes: bounded by the page
        dictionary_.push_back(plain.next());
        bytes += sizeof(nlohmann::ordered_json) + (dictionary_.back().is_string() ? 32 + dictionary_.back().get_ref<const std::string&>().size() : 0);
        if (i % 1024 == 0) hold(bytes);
      }
      hold(bytes);
      dictionary_bytes_ = bytes;
      has_dictionary_ = true;
      return;
    }
    if (h.kind != kDataPage && h.kind != kDataPageV2) return;  // index pages carry no values
    if (h.values < 0) throw UserError(where_ + "a data page with a negative value count");
    std::size_t levels_size = 0;
    if (h.kind == kDataPageV2) {
      if (h.repetition_bytes != 0) throw UserError(where_ + "a flat column's page has repetition levels");
      if (h.definition_bytes < 0 || static_cast<std::uint64_t>(h.definition_bytes) > raw_size || h.definition_bytes > h.uncompressed)
        throw UserError(where_ + "a page's definition levels run past the page");
      const auto d = static_cast<std::size_t>(h.definition_bytes);
      // Levels come uncompressed before the values, whatever the codec; a page of nulls may have
      // no value bytes at all, not even a compressed empty stream (parquet-java writes them so).
      page_.assign(reinterpret_cast<const char*>(raw), d);
      const bool no_values = raw_size == d && static_cast<std::size_t>(h.uncompressed) == d;
      if (!no_values)
        page_ += decompress(h.v2_compressed ? codec_ : Codec::kNone, raw + d, raw_size - d, static_cast<std::size_t>(h.uncompressed) - d, where_);
      levels_size = d;
      if (c_.optional) levels_ = RleHybrid(at_page(0), d, 1, &where_);
    } else {
      page_ = decompress(codec_, raw, raw_size, static_cast<std::size_t>(h.uncompressed), where_);
      if (c_.optional) {
        if (h.definition_encoding != kRle) throw UserError(where_ + "definition levels in encoding " + std::to_string(h.definition_encoding) + " (RLE is read)");
        if (page_.size() < 4) throw UserError(where_ + "a page ends before its definition levels");
        std::uint32_t n;
        std::memcpy(&n, page_.data(), 4);
        if (n > page_.size() - 4) throw UserError(where_ + "a page's definition levels run past the page");
        levels_ = RleHybrid(at_page(4), n, 1, &where_);
        levels_size = 4 + n;
      }
    }
    hold(dictionary_bytes_ + page_.size());
    const std::uint8_t* v = at_page(levels_size);
    const std::size_t n = page_.size() - levels_size;
    switch (h.encoding) {
      case kPlain: values_ = std::make_unique<PlainValues>(c_, v, n, &where_); break;
      case kPlainDictionary:
      case kRleDictionary:
        if (!has_dictionary_) throw UserError(where_ + "a dictionary-encoded page comes without a dictionary page");
        values_ = std::make_unique<DictionaryValues>(dictionary_, v, n, &where_);
        break;
      case kRle:
        if (c_.type != kBoolean) throw UserError(where_ + "RLE values in a column that is not boolean");
        values_ = std::make_unique<RleBooleans>(v, n, &where_);
        break;
      case kDeltaBinaryPacked:
        if (c_.type != kInt32 && c_.type != kInt64) throw UserError(where_ + "delta-packed values in a column that is not an integer");
        values_ = std::make_unique<DeltaIntegers>(c_, v, n, &where_);
        break;
      case kDeltaLengthByteArray:
        if (c_.type != kByteArray) throw UserError(where_ + "delta-length values in a column that is not a byte array");
        values_ = std::make_unique<DeltaLengthStrings>(v, n, &where_);
        break;
      case kDeltaByteArray:
        if (c_.type != kByteArray && c_.type != kFixedBytes) throw UserError(where_ + "delta strings in a column that holds no bytes");
        values_ = std::make_unique<DeltaStrings>(v, n, &where_);
        break;
      case kByteStreamSplit: values_ = std::make_unique<SplitValues>(c_, v, n, &where_); break;
      default: throw UserError(where_ + "values in encoding " + std::to_string(h.encoding) + ", which loom does not read");
    }
    left_ = static_cast<std::uint64_t>(h.values);
  }
  const std::uint8_t* at_page(std::size_t offset) const { return reinterpret_cast<const std::uint8_t*>(page_.data()) + offset; }
  // This reader now holds `bytes`: counted with the other readers' against kMaxHeldBytes.
  void hold(std::uint64_t bytes) {
    held_ = held_ - holding_ + bytes;
    holding_ = bytes;
    if (held_ > kMaxHeldBytes)
      throw UserError(where_ + "the row group's pages and dictionaries come to more than 1 GiB at once; the file is damaged or its pages are far larger than "
                               "writers make them");
  }

  const Column& c_;
  std::string bytes_;
  Codec codec_;
  std::string where_;
  std::size_t pos_ = 0;
  std::vector<nlohmann::ordered_json> dictionary_;
  bool has_dictionary_ = false;
  std::string page_;
  RleHybrid levels_;
  std::unique_ptr<Values> values_;
  std::uint64_t left_ = 0;
  std::uint64_t& held_;
  std::uint64_t holding_ = 0, dictionary_bytes_ = 0;
};

Codec codec_of(int codec, const std::string& where) {
  switch (codec) {
    case 0: return Codec::kNone;
    case 1: return Codec::kSnappy;
    case 2: return Codec::kGzip;
    case 6: return Codec::kZstd;
    default: {
      static const char* const names[] = {"UNCOMPRESSED", "SNAPPY", "GZIP", "LZO", "BROTLI", "LZ4", "ZSTD", "LZ4_RAW"};
      const std::string name = codec >= 0 && codec < 8 ? names[codec] : "codec " + std::to_string(codec);
      throw UserError(where + "its pages are compressed with " + name + ", which loom does not read (uncompressed, SNAPPY, GZIP and ZSTD are read); "
                              "write the file again with one of those");
    }
  }
}

class ParquetRows : public TableRows {
 public:
  explicit ParquetRows(const std::filesystem::path& path) : file_(path, "data file") {
    const std::string& name = file_.name();
    describe(name, file_.size());
    if (file_.size() < 12) throw UserError(name + ": is not a Parquet file (too short for its header and footer)");
    const std::string head = file_.read(0, 4, "the header"), tail = file_.read(file_.size() - 8, 8, "the footer");
    if (tail.substr(4) == "PARE") throw UserError(name + ": is an encrypted Parquet file, which loom does not read");
    if (head != "PAR1" || tail.substr(4) != "PAR1") throw UserError(name + ": is not a Parquet file (no PAR1 at its start and end)");
    std::uint32_t footer_size;
    std::memcpy(&footer_size, tail.data(), 4);
    if (footer_size > file_.size() - 12) throw UserError(name + ": its footer claims " + std::to_string(footer_size) + " bytes, more than the file holds");
    const std::string footer = file_.read(file_.size() - 8 - footer_size, footer_size, "the footer");
    Thrift t(reinterpret_cast<const std::uint8_t*>(footer.data()), footer.size(), name + ": ");
    meta_ = read_file_meta(t);
    read_columns();
    for (std::size_t g = 0; g < meta_.row_groups.size(); ++g) {
      const auto& group = meta_.row_groups[g];
      if (group.rows < 0) throw UserError(name + ": row group " + std::to_string(g) + " has no row count");
      if (group.columns.size() != leaves_) throw UserError(name + ": row group " + std::to_string(g) + " holds " + std::to_string(group.columns.size()) +
                                                          " column chunks where the schema has " + std::to_string(leaves_) + " columns");
      claim_rows(static_cast<std::uint64_t>(group.rows));
      if (group.rows > 0) chunk_ranges(g);  // every group's layout checked before the first row is read
    }
  }

  bool read(nlohmann::ordered_json& row) override {
    while (row_ == group_rows_) {
      if (group_ == meta_.row_groups.size()) return false;
      open_group(group_++);
    }
    ++row_;
    row = nlohmann::ordered_json::object();
    for (std::size_t i = 0; i < columns_.size(); ++i) row[columns_[i].name] = readers_[i]->next();
    return true;
  }

 private:
  // The schema's top-level leaves become columns; groups (lists, structs, maps) and repeated leaves
  // are left out, their leaves still counted for the column chunks' places.
  void read_columns() {
    const auto& schema = meta_.schema;
    if (schema.empty()) throw UserError(file_.name() + ": has no schema");
    std::size_t next_element = 1;
    const std::function<void(int)> skip_group = [&](int depth) {
      if (depth > kMaxNesting) throw UserError(file_.name() + ": its schema is nested too deeply");
      if (next_element >= schema.size()) throw UserError(file_.name() + ": its schema ends early");
      const SchemaElement& e = schema[next_element++];
      if (e.num_children < 0) throw UserError(file_.name() + ": its schema is damaged");
      if (e.num_children == 0) ++leaves_;
      for (int c = 0; c < e.num_children; ++c) skip_group(depth + 1);
    };
    std::vector<std::string> names;
    for (int child = 0; child < schema[0].num_children; ++child) {
      if (next_element >= schema.size()) throw UserError(file_.name() + ": its schema ends early");
      const SchemaElement& e = schema[next_element];
      names.push_back(e.name);
      if (e.num_children > 0 || e.repetition == kRepeated) {
        unread_.push_back(e.name + " (nested: a list, struct or map)");
        skip_group(1);
        continue;
      }
      ++next_element;
      Column c;
      c.name = e.name;
      c.type = e.type;
      c.type_length = e.type_length;
      c.optional = e.repetition == kOptional;
      c.decimal = e.converted == kConvertedDecimal || e.logical == kLogicalDecimal;
      c.scale = e.scale;
      c.is_unsigned = (e.converted >= kConvertedUint8 && e.converted <= kConvertedUint64) || (e.logical == kLogicalInteger && !e.logical_signed);
      c.chunk = leaves_++;
      if (e.type == kInt96) unread_.push_back(e.name + " (INT96 timestamps)");
      else if (e.type < kBoolean || e.type > kFixedBytes) unread_.push_back(e.name + " (physical type " + std::to_string(e.type) + ")");
      else if (e.type == kFixedBytes) unread_.push_back(e.name + " (fixed-length bytes: a decimal, float16, UUID or interval)");
      else if (e.type == kByteArray && c.decimal) unread_.push_back(e.name + " (a decimal in bytes)");
      else if (e.type == kByteArray && (e.logical == kLogicalBson || e.converted == kConvertedBson)) unread_.push_back(e.name + " (BSON)");
      else columns_.push_back(c);
    }
    if (next_element != schema.size()) throw UserError(file_.name() + ": its schema has elements no column accounts for");
    check_unique_columns(names, file_.name());
  }

  // Where each read column's chunk lies in row group `g`, in the columns' order. Every chunk is
  // checked against the file and against the others before any is read: chunks that overlap would
  // let one stretch of the file be read (and inflated) once a column, thousands of times over.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> chunk_ranges(std::size_t g) const {
    const auto& group = meta_.row_groups[g];
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    for (const Column& c : columns_) {
      const ChunkMeta& chunk = group.columns[c.chunk];
      const std::string where = file_.name() + ": row group " + std::to_string(g) + ", column '" + c.name + "': ";
      if (!chunk.present) throw UserError(where + "has no metadata (an encrypted column?)");
      if (chunk.external) throw UserError(where + "is held in another file, which loom does not read");
      if (chunk.path.size() != 1 || chunk.path[0] != c.name || chunk.type != c.type) throw UserError(where + "its chunk does not match the schema");
      codec_of(chunk.codec, where);
      std::int64_t start = chunk.data_page_offset;
      if (chunk.dictionary_page_offset > 0 && chunk.dictionary_page_offset < start) start = chunk.dictionary_page_offset;
      if (start < 4 || chunk.compressed_size < 0) throw UserError(where + "its chunk has no place in the file");
      const auto offset = static_cast<std::uint64_t>(start), length = static_cast<std::uint64_t>(chunk.compressed_size);
      if (offset > file_.size() || length > file_.size() - offset)
        throw UserError(where + "its chunk (" + std::to_string(length) + " bytes at " + std::to_string(offset) + ") lies past the end of the file (" +
                        std::to_string(file_.size()) + " bytes); the file is truncated or damaged");
      ranges.emplace_back(offset, length);
    }
    auto sorted = ranges;
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t i = 1; i < sorted.size(); ++i)
      if (sorted[i - 1].first + sorted[i - 1].second > sorted[i].first)
        throw UserError(file_.name() + ": row group " + std::to_string(g) + ": two column chunks overlap (at bytes " + std::to_string(sorted[i - 1].first) +
                        " and " + std::to_string(sorted[i].first) + "); the file is damaged");
    return ranges;
  }

  void open_group(std::size_t g) {
    const auto& group = meta_.row_groups[g];
    readers_.clear();
    group_rows_ = static_cast<std::uint64_t>(group.rows);
    row_ = 0;
    if (group_rows_ == 0) return;  // nothing of it is read
    const auto ranges = chunk_ranges(g);
    for (std::size_t i = 0; i < columns_.size(); ++i) {
      const Column& c = columns_[i];
      const std::string where = file_.name() + ": row group " + std::to_string(g) + ", column '" + c.name + "': ";
      readers_.push_back(std::make_unique<ChunkReader>(c, file_.read(ranges[i].first, ranges[i].second, "a column chunk"),
                                                       codec_of(group.columns[c.chunk].codec, where), where, held_));
    }
  }

  FileBytes file_;
  FileMeta meta_;
  std::size_t leaves_ = 0;
  std::vector<Column> columns_;
  std::uint64_t held_ = 0;  // declared before the readers, which give back what they hold
  std::vector<std::unique_ptr<ChunkReader>> readers_;
  std::size_t group_ = 0;
  std::uint64_t group_rows_ = 0, row_ = 0;
};

}  // namespace

std::unique_ptr<TableRows> open_parquet(const std::filesystem::path& file) { return std::make_unique<ParquetRows>(file); }

}  // namespace loom::formats
