#include "config/table_rows.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "config/file_bytes.hpp"
#include "loom/error.hpp"
#include "loom/kit/utf8.hpp"

namespace loom::core {
namespace {

constexpr std::uint64_t kTextPerFileByte = 64;
constexpr std::uint64_t kMinTextBudget = std::uint64_t{256} << 20;
constexpr std::size_t kMaxValueBytes = std::size_t{64} << 20;  // as a JSON line's bound

std::string lower_extension(const std::filesystem::path& file) {
  std::string ext = file.extension().string();
  for (auto& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return ext;
}

}  // namespace

void TableRows::describe(const std::string& name, std::uint64_t file_bytes) {
  name_ = name;
  text_budget_ = std::max(kMinTextBudget, file_bytes > (~std::uint64_t{0}) / kTextPerFileByte ? ~std::uint64_t{0} : file_bytes * kTextPerFileByte);
}

bool TableRows::next(nlohmann::ordered_json& row) {
  if (!read(row)) return false;
  ++rows_;
  const auto where = [&](const std::string& column) { return name_ + ": record " + std::to_string(rows_) + ": column '" + column + "' "; };
  for (const auto& [column, value] : row.items()) {
    if (kit::invalid_utf8_at(column) != std::string::npos) throw UserError(name_ + ": a column's name is not UTF-8 text");
    if (!value.is_string()) continue;
    const auto& text = value.get_ref<const std::string&>();
    if (text.size() > kMaxValueBytes) throw UserError(where(column) + "holds a value over 64 MiB");
    if (kit::invalid_utf8_at(text) != std::string::npos) throw UserError(where(column) + "holds bytes that are not UTF-8 text (binary data?)");
    text_ += text.size();
  }
  if (text_ > text_budget_)
    throw UserError(name_ + ": its rows hold more than " + std::to_string(text_budget_ >> 20) + " MiB of text, over 64 bytes per byte of the file; "
                    "it is damaged (or split it into smaller files)");
  return true;
}

double float_value(float v) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text - 1, v).ptr;
  *end = '\0';
  return std::strtod(text, nullptr);
}

bool is_arrow_file(const std::filesystem::path& file) {
  const std::string ext = lower_extension(file);
  return ext == ".arrow" || ext == ".feather";
}

bool is_parquet_file(const std::filesystem::path& file) {
  if (lower_extension(file) == ".parquet") return true;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) return false;
  FileBytes bytes(file, "data file");
  return bytes.size() >= 12 && bytes.read(0, 4, "the header") == "PAR1";
}

}  // namespace loom::core
