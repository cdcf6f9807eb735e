// Arrow IPC (the columnar format's specification, apache/arrow format/): messages whose metadata is
// a flatbuffer (Message.fbs, Schema.fbs) followed by a body of buffers. `datasets` writes the
// streaming form into its .arrow files; the file form wraps the same messages in ARROW1 magic.
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "loom/formats/file_bytes.hpp"
#include "loom/formats/table_rows.hpp"
#include "loom/error.hpp"
#include "loom/formats/regular_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/utf8.hpp"

#include "arrow_generated.h"

namespace loom::formats {
namespace {
namespace fbs = arrow::fbs;

// A JSON file of `datasets` (state.json, dataset_dict.json): a regular file, bounded.
nlohmann::json read_json_file(const std::filesystem::path& file, std::uintmax_t max_bytes, const std::string& what) {
  return kit::json::parse(kit::without_bom(read_regular_file(file, max_bytes, what)), file.string());
}


constexpr std::uint32_t kMaxMetadataBytes = 64u << 20;
constexpr int kMaxNesting = 64;

// A message's or the footer's metadata, checked whole by flatbuffers' verifier (every offset, size,
// string and nesting within the buffer; tables bounded) before anything of it is read; then read
// through the accessors flatc generated from arrow.fbs.
template <class Root>
const Root* verified(const std::string& buffer, const std::string& where) {
  // Real metadata nests a few levels: a field's children past kMaxNesting are refused anyway.
  flatbuffers::Verifier verifier(reinterpret_cast<const std::uint8_t*>(buffer.data()), buffer.size(), kMaxNesting + 8, 1u << 20);
  if (!verifier.VerifyBuffer<Root>(nullptr)) throw UserError(where + "its metadata is damaged (an offset or a size points outside it)");
  return flatbuffers::GetRoot<Root>(buffer.data());
}

// Schema.fbs's Type union members, and the message headers.
enum Type {
  kNull = 1, kInt = 2, kFloatingPoint = 3, kBinary = 4, kUtf8 = 5, kBool = 6, kDecimal = 7, kDate = 8, kTime = 9, kTimestamp = 10, kInterval = 11,
  kList = 12, kStruct = 13, kUnion = 14, kFixedSizeBinary = 15, kFixedSizeList = 16, kMap = 17, kDuration = 18, kLargeBinary = 19,
  kLargeUtf8 = 20, kLargeList = 21, kRunEndEncoded = 22, kBinaryView = 23, kUtf8View = 24, kListView = 25, kLargeListView = 26
};

// A field's shape: enough to read a flat one and to step over the buffers of any other.
struct Shape {
  std::string name;
  int type = 0;
  bool dictionary = false;
  bool dense_union = false;
  int bit_width = 0;   // Int
  bool is_signed = true;
  int precision = -1;  // FloatingPoint: 0 half, 1 single, 2 double
  std::vector<Shape> children;

  bool flat() const {
    if (dictionary) return false;
    switch (type) {
      case kNull:
      case kBool:
      case kUtf8:
      case kLargeUtf8: return true;
      case kInt: return bit_width == 8 || bit_width == 16 || bit_width == 32 || bit_width == 64;
      case kFloatingPoint: return precision == 1 || precision == 2;
      default: return false;
    }
  }
  bool text() const { return type == kUtf8 || type == kLargeUtf8; }
  std::string why_unread() const {
    if (dictionary) return "dictionary-encoded";
    switch (type) {
      case kList:
      case kLargeList:
      case kFixedSizeList:
      case kListView:
      case kLargeListView: return "nested: a list";
      case kStruct: return "nested: a struct";
      case kMap: return "nested: a map";
      case kUnion: return "nested: a union";
      case kFloatingPoint: return "half-precision floats";
      case kBinary:
      case kLargeBinary:
      case kBinaryView:
      case kFixedSizeBinary: return "binary";
      case kDecimal: return "decimal";
      case kDate: return "date";
      case kTime: return "time of day";
      case kTimestamp: return "timestamp";
      case kInterval: return "interval";
      case kDuration: return "duration";
      case kUtf8View: return "string view";
      case kRunEndEncoded: return "run-end encoded";
      default: return "Arrow type " + std::to_string(type);
    }
  }
};

// `budget`: what the schema may still make, from its metadata's size: fields that point at one
// table many times cannot make exponentially many shapes.
Shape read_shape(const fbs::Field* field, int depth, const std::string& where, std::uint64_t& budget) {
  if (depth > kMaxNesting) throw UserError(where + "its schema is nested too deeply");
  if (field == nullptr) throw UserError(where + "its schema holds an empty field");
  Shape s;
  s.name = field->name() ? field->name()->str() : "";
  const std::uint64_t cost = 16 + s.name.size();
  if (cost > budget) throw UserError(where + "its schema describes more fields than its metadata holds; it is damaged");
  budget -= cost;
  s.type = static_cast<int>(field->type_type());
  s.dictionary = field->dictionary() != nullptr;
  if (const auto* integer = field->type_as_Int()) {
    s.bit_width = integer->bit_width();
    s.is_signed = integer->is_signed();
  } else if (const auto* floating = field->type_as_FloatingPoint()) {
    s.precision = static_cast<int>(floating->precision());
  } else if (const auto* either = field->type_as_Union()) {
    s.dense_union = either->mode() == fbs::UnionMode::Dense;
  }
  if (const auto* children = field->children())
    for (const auto* child : *children) s.children.push_back(read_shape(child, depth + 1, where, budget));
  return s;
}

struct Range {
  std::uint64_t offset = 0, length = 0;
};

class ArrowRows : public TableRows {
 public:
  explicit ArrowRows(const std::filesystem::path& path) : file_(path, "data file"), where_(file_.name() + ": ") {
    describe(file_.name(), file_.size());
    end_ = file_.size();
    if (file_.size() >= 8 && file_.read(0, 6, "the header") == "ARROW1") {
      // The file form: messages, then a footer (the schema and where each record batch lies) whose
      // size precedes the closing magic. Writers need not repeat the schema as a message.
      if (file_.size() < 18) throw UserError(where_ + "is too short for an Arrow file");
      const std::string tail = file_.read(file_.size() - 10, 10, "the footer");
      if (tail.substr(4) != "ARROW1") throw UserError(where_ + "starts as an Arrow file but does not end as one (truncated?)");
      std::int32_t size;
      std::memcpy(&size, tail.data(), 4);
      if (size < 0 || static_cast<std::uint64_t>(size) > file_.size() - 18 || static_cast<std::uint32_t>(size) > kMaxMetadataBytes)
        throw UserError(where_ + "its footer size is damaged");
      const std::string footer = file_.read(file_.size() - 10 - static_cast<std::uint64_t>(size), static_cast<std::uint64_t>(size), "the footer");
      const auto* root = verified<fbs::Footer>(footer, where_);
      read_schema(root->schema(), footer.size());
      const auto* blocks = root->record_batches();
      for (std::size_t i = 0; blocks != nullptr && i < blocks->size(); ++i) {
        const std::int64_t offset = blocks->Get(static_cast<flatbuffers::uoffset_t>(i))->offset();
        if (offset < 8 || static_cast<std::uint64_t>(offset) >= file_.size() || (!blocks_.empty() && static_cast<std::uint64_t>(offset) <= blocks_.back()))
          throw UserError(where_ + "its footer places a record batch outside the file or out of order");
        blocks_.push_back(static_cast<std::uint64_t>(offset));
      }
      file_form_ = true;
      return;
    }
    std::string metadata;
    std::uint64_t body = 0;
    if (!read_message(metadata, body)) throw UserError(where_ + "holds no Arrow schema (is it an Arrow IPC stream or file?)");
    const auto* message = verified<fbs::Message>(metadata, where_);
    if (message->header_type() != fbs::MessageHeader::Schema) throw UserError(where_ + "does not start with an Arrow schema");
    read_schema(message->header_as_Schema(), metadata.size());
    pos_ += body;
  }

  bool read(nlohmann::ordered_json& row) override {
    while (row_ == batch_rows_)
      if (!next_batch()) return false;
    row = nlohmann::ordered_json::object();
    for (const auto& c : columns_) row[fields_[c.field].name] = value(c, row_);
    ++row_;
    return true;
  }

 private:
  void read_schema(const fbs::Schema* schema, std::uint64_t metadata_bytes) {
    if (schema == nullptr) throw UserError(where_ + "holds no schema");
    if (schema->endianness() != fbs::Endianness::Little) throw UserError(where_ + "is big-endian, which loom does not read");
    std::uint64_t budget = 2 * metadata_bytes + 1024;  // a field takes more bytes than it costs
    for (std::size_t i = 0; schema->fields() != nullptr && i < schema->fields()->size(); ++i) {
      Shape s = read_shape(schema->fields()->Get(static_cast<flatbuffers::uoffset_t>(i)), 1, where_, budget);
      if (!s.flat()) unread_.push_back(s.name + " (" + s.why_unread() + ")");
      fields_.push_back(std::move(s));
    }
    std::vector<std::string> names;
    for (const auto& f : fields_) names.push_back(f.name);
    check_unique_columns(names, file_.name());
  }

  struct ColumnBuffers {
    std::size_t field = 0;
    std::int64_t nulls = 0;
    Range validity, offsets, values;
  };

  // The next message's metadata and body size; false at the end of the stream.
  bool read_message(std::string& metadata, std::uint64_t& body) {
    if (pos_ >= end_) return false;  // a stream may end without its end marker
    std::uint32_t size = read_u32();
    if (size == 0xFFFFFFFFu) size = read_u32();  // the continuation marker before the size (format >= 0.15)
    if (size == 0) return false;
    if (size > kMaxMetadataBytes) throw UserError(where_ + "a message claims " + std::to_string(size) + " bytes of metadata; the file is damaged");
    metadata = read(size, "a message's metadata");
    const std::int64_t length = verified<fbs::Message>(metadata, where_)->body_length();
    if (length < 0 || static_cast<std::uint64_t>(length) > end_ - pos_) throw UserError(where_ + "a message's body runs past the end of the file");
    body = static_cast<std::uint64_t>(length);
    return true;
  }
  std::uint32_t read_u32() {
    const std::string b = read(4, "a message's size");
    std::uint32_t v;
    std::memcpy(&v, b.data(), 4);
    return v;
  }
  std::string read(std::uint64_t n, const std::string& what) {
    if (n > end_ - pos_) throw UserError(where_ + what + " runs past the end of the file (truncated?)");
    std::string b = file_.read(pos_, n, what);
    pos_ += n;
    return b;
  }

  bool next_batch() {
    for (;;) {
      std::string metadata;
      std::uint64_t body_size = 0;
      if (file_form_) {
        if (next_block_ == blocks_.size()) return false;
        pos_ = blocks_[next_block_++];
      }
      if (!read_message(metadata, body_size)) return false;
      const auto* message = flatbuffers::GetRoot<fbs::Message>(metadata.data());  // verified by read_message
      if (message->header_type() != fbs::MessageHeader::RecordBatch) {
        if (message->header_type() == fbs::MessageHeader::Schema) throw UserError(where_ + "holds a second schema");
        pos_ += body_size;  // dictionaries serve only the columns left out
        continue;
      }
      const auto* batch = message->header_as_RecordBatch();
      if (batch->compression() != nullptr)
        throw UserError(where_ + "its record batches are compressed (LZ4 or ZSTD), which loom does not read; write it uncompressed");
      body_ = read(body_size, "a record batch");
      const std::int64_t length = batch->length();
      if (length < 0) throw UserError(where_ + "a record batch of negative length");
      claim_rows(static_cast<std::uint64_t>(length));
      lay_out(batch, static_cast<std::uint64_t>(length));
      batch_rows_ = static_cast<std::uint64_t>(length);
      row_ = 0;
      ++batch_index_;
      if (batch_rows_ > 0) return true;
    }
  }

  // Walks every field's nodes and buffers in the batch's depth-first order, keeping the flat ones'.
  void lay_out(const fbs::RecordBatch* batch, std::uint64_t length) {
    const auto* node_list = batch->nodes();
    const auto* buffer_list = batch->buffers();
    const auto* count_list = batch->variadic_buffer_counts();
    const std::size_t nodes = node_list ? node_list->size() : 0, buffers = buffer_list ? buffer_list->size() : 0;
    const std::size_t counts = count_list ? count_list->size() : 0;
    std::size_t node = 0, buffer = 0, variadic = 0;
    const auto take_buffer = [&]() {
      if (buffer >= buffers) throw UserError(batch_where() + "has fewer buffers than its schema needs");
      const auto* b = buffer_list->Get(static_cast<flatbuffers::uoffset_t>(buffer));
      const std::int64_t offset = b->offset(), size = b->length();
      ++buffer;
      if (offset < 0 || size < 0 || static_cast<std::uint64_t>(offset) > body_.size() || static_cast<std::uint64_t>(size) > body_.size() - static_cast<std::uint64_t>(offset))
        throw UserError(batch_where() + "a buffer lies outside its body");
      return Range{static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(size)};
    };
    const std::function<void(const Shape&)> skip = [&](const Shape& s) {
      if (node++ >= nodes) throw UserError(batch_where() + "has fewer nodes than its schema needs");
      int own = 0;
      if (s.dictionary) own = 2;
      else switch (s.type) {
        case kNull:
        case kRunEndEncoded: own = 0; break;
        case kBinary:
        case kUtf8:
        case kLargeBinary:
        case kLargeUtf8:
        case kListView:
        case kLargeListView: own = 3; break;
        case kList:
        case kLargeList:
        case kMap: own = 2; break;
        case kStruct:
        case kFixedSizeList: own = 1; break;
        case kUnion: own = s.dense_union ? 2 : 1; break;
        case kBinaryView:
        case kUtf8View:
          if (variadic >= counts) throw UserError(batch_where() + "lacks a view column's buffer count");
          own = 2;
          for (std::int64_t k = count_list->Get(static_cast<flatbuffers::uoffset_t>(variadic++)); k > 0; --k) take_buffer();
          break;
        default: own = 2;
      }
      for (int i = 0; i < own; ++i) take_buffer();
      if (!s.dictionary)
        for (const auto& child : s.children) skip(child);
    };
    columns_.clear();
    for (std::size_t f = 0; f < fields_.size(); ++f) {
      const Shape& s = fields_[f];
      if (!s.flat()) {
        skip(s);
        continue;
      }
      if (node >= nodes) throw UserError(batch_where() + "has fewer nodes than its schema needs");
      ColumnBuffers c;
      c.field = f;
      const auto* field_node = node_list->Get(static_cast<flatbuffers::uoffset_t>(node));
      const std::int64_t node_length = field_node->length();
      c.nulls = field_node->null_count();
      ++node;
      if (node_length != static_cast<std::int64_t>(length)) throw UserError(batch_where() + "column '" + s.name + "' has a length other than its batch's");
      if (s.type != kNull) {
        c.validity = take_buffer();
        const std::uint64_t n = length;
        if (c.nulls != 0 && c.validity.length * 8 < n) throw UserError(batch_where() + "column '" + s.name + "' has nulls but too short a validity bitmap");
        if (s.text()) {
          c.offsets = take_buffer();
          c.values = take_buffer();
          const std::uint64_t width = s.type == kLargeUtf8 ? 8 : 4;
          if (c.offsets.length / width < n + 1) throw UserError(batch_where() + "column '" + s.name + "' has too few offsets");
        } else {
          c.values = take_buffer();
          const std::uint64_t bits = s.type == kBool ? 1 : s.type == kInt ? static_cast<std::uint64_t>(s.bit_width) : s.precision == 1 ? 32 : 64;
          if (c.values.length * 8 / bits < n) throw UserError(batch_where() + "column '" + s.name + "' has too few values");
        }
      }
      columns_.push_back(c);
    }
  }

  std::string batch_where() const { return where_ + "record batch " + std::to_string(batch_index_ + 1) + " "; }
  const std::uint8_t* at(std::uint64_t offset) const { return reinterpret_cast<const std::uint8_t*>(body_.data()) + offset; }

  nlohmann::ordered_json value(const ColumnBuffers& c, std::uint64_t row) const {
    const Shape& s = fields_[c.field];
    if (s.type == kNull) return nullptr;
    if (c.nulls != 0 && c.validity.length > 0 && !((at(c.validity.offset)[row / 8] >> (row % 8)) & 1)) return nullptr;
    switch (s.type) {
      case kBool: return ((at(c.values.offset)[row / 8] >> (row % 8)) & 1) != 0;
      case kInt: {
        const std::size_t width = static_cast<std::size_t>(s.bit_width) / 8;
        std::uint64_t bits = 0;
        std::memcpy(&bits, at(c.values.offset + row * width), width);
        if (!s.is_signed) return bits;
        const int unused = 64 - s.bit_width;
        return static_cast<std::int64_t>(bits << unused) >> unused;  // sign-extends
      }
      case kFloatingPoint: {
        if (s.precision == 1) {
          float v;
          std::memcpy(&v, at(c.values.offset + row * 4), 4);
          return float_value(v);
        }
        double v;
        std::memcpy(&v, at(c.values.offset + row * 8), 8);
        return v;
      }
      default: {
        const bool large = s.type == kLargeUtf8;
        std::int64_t from = 0, to = 0;
        if (large) {
          std::memcpy(&from, at(c.offsets.offset + row * 8), 8);
          std::memcpy(&to, at(c.offsets.offset + row * 8 + 8), 8);
        } else {
          std::int32_t a, b;
          std::memcpy(&a, at(c.offsets.offset + row * 4), 4);
          std::memcpy(&b, at(c.offsets.offset + row * 4 + 4), 4);
          from = a;
          to = b;
        }
        if (from < 0 || to < from || static_cast<std::uint64_t>(to) > c.values.length)
          throw UserError(batch_where() + "column '" + s.name + "' row " + std::to_string(row + 1) + ": its offsets point outside its data");
        return std::string(reinterpret_cast<const char*>(at(c.values.offset + static_cast<std::uint64_t>(from))), static_cast<std::size_t>(to - from));
      }
    }
  }

  FileBytes file_;
  std::string where_;
  std::uint64_t pos_ = 0, end_ = 0;
  bool file_form_ = false;
  std::vector<std::uint64_t> blocks_;  // the file form's record batches
  std::size_t next_block_ = 0;
  std::vector<Shape> fields_;
  std::vector<ColumnBuffers> columns_;
  std::string body_;
  std::uint64_t batch_rows_ = 0, row_ = 0;
  std::size_t batch_index_ = 0;
};

// state.json's files (each a plain name in the folder), read one after another.
class DatasetsFolderRows : public TableRows {
 public:
  explicit DatasetsFolderRows(const std::filesystem::path& folder) {
    namespace fs = std::filesystem;
    const std::string name = folder.string();
    if (!fs::exists(folder / "state.json")) {
      if (fs::exists(folder / "dataset_dict.json")) {
        std::string splits;
        try {
          const auto dict = read_json_file(folder / "dataset_dict.json", 1 << 20, "datasets' dataset_dict.json");
          for (const auto& s : dict.value("splits", nlohmann::json::array()))
            if (s.is_string()) splits += (splits.empty() ? "" : ", ") + s.get<std::string>();
        } catch (const UserError&) {
        }
        throw UserError(name + ": is a DatasetDict folder (splits: " + (splits.empty() ? "none listed" : splits) + "); name one split's folder, e.g. " +
                        (folder / (splits.empty() ? "train" : splits.substr(0, splits.find(',')))).string());
      }
      throw UserError(name + ": is a folder, not a data file nor a folder written by datasets' save_to_disk (it has no state.json)");
    }
    const auto state = read_json_file(folder / "state.json", 16 << 20, "datasets' state.json");
    const auto files = state.find("_data_files");
    if (files == state.end() || !files->is_array() || files->empty()) throw UserError(name + "/state.json: lists no _data_files");
    for (const auto& f : *files) {
      const auto file = f.is_object() ? f.find("filename") : f.end();
      if (file == f.end() || !file->is_string()) throw UserError(name + "/state.json: an entry of _data_files has no filename");
      const std::string plain = file->get<std::string>();
      if (plain.empty() || plain.find('/') != std::string::npos || plain == "." || plain == "..")
        throw UserError(name + "/state.json: data file '" + plain + "' is not a plain file name in the folder");
      files_.push_back(folder / plain);
    }
    // A file listed twice (or two names of one file: links) would be read twice, its rows counted
    // against its bytes once: refused. The rows are checked here, as one table of all the files'
    // bytes (each file's reader is asked for its rows unchecked); a file that cannot be read is
    // named when it is opened.
    std::uint64_t bytes = 0;
    std::map<std::pair<dev_t, ino_t>, std::string> seen;
    for (const auto& file : files_) {
      struct stat st {};
      if (::stat(file.c_str(), &st) != 0) continue;
      const auto [at, fresh] = seen.emplace(std::make_pair(st.st_dev, st.st_ino), file.filename().string());
      if (!fresh)
        throw UserError(name + "/state.json: lists the data file " + kit::json::quote(file.filename().string(), 120) +
                        (at->second == file.filename().string() ? " twice" : " and " + kit::json::quote(at->second, 120) + ", the same file") +
                        "; each is read once (the folder is damaged: save it again with datasets' save_to_disk)");
      if (S_ISREG(st.st_mode)) bytes += static_cast<std::uint64_t>(st.st_size);
    }
    describe(name, bytes);
    open(0);
  }

  bool read(nlohmann::ordered_json& row) override {
    while (!current_->read(row)) {
      if (index_ + 1 == files_.size()) return false;
      open(index_ + 1);
    }
    return true;
  }

 private:
  void open(std::size_t i) {
    index_ = i;
    current_ = std::make_unique<ArrowRows>(files_[i]);
    if (i == 0) unread_ = current_->unread_columns();
  }
  std::vector<std::filesystem::path> files_;
  std::size_t index_ = 0;
  std::unique_ptr<ArrowRows> current_;
};

}  // namespace

std::unique_ptr<TableRows> open_arrow(const std::filesystem::path& file) { return std::make_unique<ArrowRows>(file); }
std::unique_ptr<TableRows> open_datasets_folder(const std::filesystem::path& folder) { return std::make_unique<DatasetsFolderRows>(folder); }

}  // namespace loom::formats
