#pragma once
// Columnar data files read a row at a time, each row a JSON object of the file's flat columns
// (strings, integers, floating point, booleans; null where a value is null), so [data] format and
// the chat formats treat them as they treat JSON lines. Memory stays at a row group (Parquet) or a
// record batch (Arrow) whatever the file's size; every size and offset the file declares is checked
// against the file before it is used.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace loom::formats {

// The most bytes one record (a line, a row's value) may hold: real records are far smaller, and
// a hostile file's claims stop here.
inline constexpr std::size_t kMaxRecordBytes = std::size_t{64} << 20;

class TableRows {
 public:
  virtual ~TableRows() = default;
  // The next row; false after the last. A damaged file is a UserError naming the file and the place,
  // and so is a string that is not UTF-8 or past 64 MiB, or rows holding more text than
  // 64 bytes per byte of the file (at least 256 MiB): a few bytes of run-length codes or repeated
  // offsets cannot make gigabytes of samples.
  bool next(nlohmann::ordered_json& row);
  // Columns left out of the rows, each as "name (why)": nested ones (lists, structs, maps) and
  // types loom does not read.
  const std::vector<std::string>& unread_columns() const { return unread_; }

 protected:
  // The format's next row, unchecked.
  virtual bool read(nlohmann::ordered_json& row) = 0;
  // Sets what messages name, and the row and text budgets from the file's (or files') size.
  void describe(const std::string& name, std::uint64_t file_bytes);
  // Counts rows the file says it holds before they are read: more than 64 a byte of the file
  // (run-length codes can claim billions in a few bytes) is a UserError, the file damaged.
  void claim_rows(std::uint64_t rows);
  std::vector<std::string> unread_;

 private:
  std::string name_;
  std::uint64_t file_bytes_ = 0, claimed_rows_ = 0;
  std::uint64_t text_budget_ = 0, text_ = 0, rows_ = 0;
};

// Throws UserError "WHERE: column 'NAME' appears twice (columns I and J); ..." when two of `names`
// are the same: a row keeps one value a name, so the other column would be lost without a word.
void check_unique_columns(const std::vector<std::string>& names, const std::string& where);

// A float's value as its shortest decimal reads back (0.1f as 0.1, not 0.10000000149011612), the
// way Python and JavaScript print a float32 column's values.
double float_value(float v);

// Parquet (format 2.x): PLAIN, dictionary, RLE and DELTA_* and BYTE_STREAM_SPLIT encodings, data
// pages v1 and v2, uncompressed, snappy, gzip and zstd pages. Nested columns are left out.
std::unique_ptr<TableRows> open_parquet(const std::filesystem::path& file);
// Arrow IPC, the streaming format (`datasets`' .arrow files) or the file format (ARROW1),
// uncompressed bodies. Dictionary-encoded and nested columns are left out.
std::unique_ptr<TableRows> open_arrow(const std::filesystem::path& file);
// A folder written by `datasets`' save_to_disk: its state.json's Arrow files, in order.
std::unique_ptr<TableRows> open_datasets_folder(const std::filesystem::path& folder);

// Whether `file` is read as Parquet (.parquet, or "PAR1" first) or Arrow (.arrow, .feather).
bool is_parquet_file(const std::filesystem::path& file);
bool is_arrow_file(const std::filesystem::path& file);

}  // namespace loom::formats
