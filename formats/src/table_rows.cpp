#include "loom/formats/table_rows.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <map>

#include <nlohmann/json.hpp>

#include "loom/formats/file_bytes.hpp"
#include "loom/error.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/utf8.hpp"

namespace loom::formats {
namespace {

constexpr std::uint64_t kRowsPerFileByte = 64;
constexpr std::uint64_t kTextPerFileByte = 64;
constexpr std::uint64_t kMinTextBudget = std::uint64_t{256} << 20;

}  // namespace

void TableRows::describe(const std::string& name, std::uint64_t file_bytes) {
  name_ = name;
  file_bytes_ = file_bytes;
  text_budget_ = std::max(kMinTextBudget, file_bytes > (~std::uint64_t{0}) / kTextPerFileByte ? ~std::uint64_t{0} : file_bytes * kTextPerFileByte);
}

void TableRows::claim_rows(std::uint64_t rows) {
  claimed_rows_ += rows;
  if (rows > kRowsPerFileByte * file_bytes_ || claimed_rows_ > kRowsPerFileByte * file_bytes_)
    throw UserError(name_ + ": claims more than " + std::to_string(kRowsPerFileByte) + " rows per byte of the file; it is damaged");
}

bool TableRows::next(nlohmann::ordered_json& row) {
  if (!read(row)) return false;
  ++rows_;
  const auto where = [&](const std::string& column) { return name_ + ": record " + std::to_string(rows_) + ": column '" + column + "' "; };
  for (const auto& [column, value] : row.items()) {
    if (kit::invalid_utf8_at(column) != std::string::npos) throw UserError(name_ + ": a column's name is not UTF-8 text");
    if (!value.is_string()) continue;
    const auto& text = value.get_ref<const std::string&>();
    if (text.size() > kMaxRecordBytes) throw UserError(where(column) + "holds a value over 64 MiB");
    if (kit::invalid_utf8_at(text) != std::string::npos) throw UserError(where(column) + "holds bytes that are not UTF-8 text (binary data?)");
    text_ += text.size();
  }
  if (text_ > text_budget_)
    throw UserError(name_ + ": its rows hold more than " + std::to_string(text_budget_ >> 20) + " MiB of text, over 64 bytes per byte of the file; "
                    "it is damaged (or split it into smaller files)");
  return true;
}

void check_unique_columns(const std::vector<std::string>& names, const std::string& where) {
  std::map<std::string, std::size_t> seen;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto [at, fresh] = seen.emplace(names[i], i);
    if (!fresh)
      throw UserError(where + ": column " + kit::json::quote(names[i], 80) + " appears twice (columns " + std::to_string(at->second + 1) + " and " +
                      std::to_string(i + 1) + "); a record keeps one value a name, so rename one of them");
  }
}

double float_value(float v) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text - 1, v).ptr;
  *end = '\0';
  return std::strtod(text, nullptr);
}

bool is_arrow_file(const std::filesystem::path& file) {
  const std::string ext = lowercase_extension(file);
  return ext == ".arrow" || ext == ".feather";
}

bool is_parquet_file(const std::filesystem::path& file) {
  if (lowercase_extension(file) == ".parquet") return true;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) return false;
  FileBytes bytes(file, "data file");
  return bytes.size() >= 12 && bytes.read(0, 4, "the header") == "PAR1";
}

}  // namespace loom::formats
