#pragma once
// JSON a user supplies (config.json, tokenizer.json, safetensors headers, adapter configs, data
// lines, checkpoints), read one way everywhere: nesting bounded before the library sees the text
// (its recursive parts cannot exhaust the stack), and every error in loom's words naming the
// source, the line:col or the key, and what was expected, never the library's own text.
// Header-only: include it where nlohmann/json is available (every plugin that reads JSON).
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/utf8.hpp"

namespace loom::kit::json {

// Real files nest fewer than 10 levels deep.
inline constexpr std::size_t kMaxDepth = 64;

// `s` quoted as JSON, cut to about `max_bytes` (at a character boundary), for messages.
inline std::string quote(std::string_view s, std::size_t max_bytes = 60) {
  std::size_t end = s.size();
  if (end > max_bytes) {
    end = max_bytes;
    while (end > 0 && (static_cast<unsigned char>(s[end]) & 0xC0) == 0x80) --end;
  }
  std::string shown = nlohmann::json(std::string(s.substr(0, end))).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return end < s.size() ? shown + "..." : shown;
}

// What a value is, in a few words and without recursion: `the string "x"`, `the integer 5`,
// `an array of 3 elements`, `an object`, `null`.
inline std::string describe(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return v.get<bool>() ? "true" : "false";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return "the integer " + v.dump();
    case nlohmann::json::value_t::number_float: return "the number " + v.dump();
    case nlohmann::json::value_t::string: return "the string " + quote(v.get_ref<const std::string&>());
    case nlohmann::json::value_t::array: return "an array of " + std::to_string(v.size()) + (v.size() == 1 ? " element" : " elements");
    case nlohmann::json::value_t::object: return "an object";
    default: return "a value of another kind";
  }
}

// "SOURCE:LINE:COL" of byte `at` of `text`, whose first line is line `first_line` of the source.
inline std::string position(std::string_view text, std::size_t at, const std::string& source, std::size_t first_line = 1) {
  std::size_t line = first_line, col = 1;
  for (std::size_t i = 0; i < at && i < text.size(); ++i) {
    if (text[i] == '\n') ++line, col = 1;
    else if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) ++col;
  }
  return source + ":" + std::to_string(line) + ":" + std::to_string(col);
}

// Parses JSON text (starting at line `first_line` of SOURCE: one line of a JSONL file). Errors:
// "SOURCE:LINE:COL: not valid JSON: ..." and "SOURCE:LINE:COL: JSON nested more than 64 levels deep".
// Json = nlohmann::ordered_json keeps objects' keys in the text's order (what a chat template's
// tojson prints).
template <class Json = nlohmann::json>
inline Json parse(std::string_view text, const std::string& source, std::size_t max_depth = kMaxDepth, std::size_t first_line = 1) {
  // A scan for the nesting depth first: cheap next to parsing, and it keeps the library's
  // recursive code (copies, comparisons, dumps) away from hostile depths.
  std::size_t depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        throw UserError(position(text, i, source, first_line) + ": JSON nested more than " + std::to_string(max_depth) + " levels deep; no real file nests so");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    const std::size_t at = e.byte > 0 ? e.byte - 1 : 0;
    std::string why;
    if (at >= text.size()) {
      why = text.find_first_not_of(" \t\r\n") == std::string_view::npos ? "the text is empty" : "the text ends early";
    } else {
      const std::string what = e.what();
      if (what.find("UTF-8") != std::string::npos) why = "a string holds bytes that are not UTF-8";
      else if (what.find("control character") != std::string::npos) why = "a string holds a raw control character (write it escaped)";
      else why = "at " + quote(text.substr(at, 16), 16);
    }
    throw UserError(position(text, at, source, first_line) + ": not valid JSON: " + why);
  } catch (const nlohmann::json::exception& e) {
    // A number past what a double holds (out_of_range.406): the library names the literal, and
    // only that is used, to point at it.
    const std::string what = e.what();
    const auto open = what.find('\''), close = what.rfind('\'');
    const std::string literal = open != std::string::npos && close > open ? what.substr(open + 1, close - open - 1) : "";
    const auto at = literal.empty() ? std::string_view::npos : text.find(literal);
    throw UserError((at == std::string_view::npos ? source : position(text, at, source, first_line)) + ": not valid JSON: " +
                    (literal.empty() ? std::string("a value is out of range") : "the number " + quote(literal, 24) + " is out of range"));
  }
}

// Reads and parses a JSON file: a regular file of at most `max_bytes` (input_file.hpp).
inline nlohmann::json read_file(const std::filesystem::path& file, std::uintmax_t max_bytes, const std::string& what,
                                std::size_t max_depth = kMaxDepth) {
  return parse(without_bom(read_regular_file(file, max_bytes, what)), file.string(), max_depth);
}

// A value inside a parsed document with the way to it ("config.json: rope_scaling.factor"), read
// with typed getters whose errors say where, what was expected and what was found. A missing key
// reads as absent: the getters say it is missing, the opt_ getters give nullopt (as for null).
class Value {
 public:
  Value(const nlohmann::json& j, std::string source) : j_(&j), where_(std::move(source)), root_(true) {}
  // A value already inside a document, known by its path ("pre_tokenizer.pretokenizers[1]"): its
  // members are named "PATH.KEY".
  static Value inside(const nlohmann::json& j, std::string path) { return Value(&j, std::move(path)); }

  const std::string& where() const { return where_; }
  bool present() const { return j_ != nullptr && !j_->is_null(); }
  const nlohmann::json& raw() const {
    if (!j_) missing("a value");
    return *j_;
  }
  bool is_object() const { return j_ && j_->is_object(); }
  bool is_array() const { return j_ && j_->is_array(); }
  bool is_string() const { return j_ && j_->is_string(); }

  // Member `key` of this object (absent when there is none). Reading a member of something that is
  // present but not an object is an error.
  Value operator[](const std::string& key) const {
    if (present() && !j_->is_object()) expected("an object");
    const nlohmann::json* child = nullptr;
    if (present())
      if (const auto it = j_->find(key); it != j_->end()) child = &*it;
    return Value(child, root_ ? where_ + ": " + key : where_.empty() ? key : where_ + "." + key);
  }
  bool has(const std::string& key) const { return (*this)[key].present(); }
  // Element `i` of this array.
  Value operator[](std::size_t i) const {
    if (!is_array()) expected("an array");
    if (i >= j_->size()) throw UserError(where_ + ": has " + std::to_string(j_->size()) + " elements, not " + std::to_string(i + 1));
    return Value(&(*j_)[i], where_ + "[" + std::to_string(i) + "]");
  }
  // Elements of an array, members of an object.
  std::size_t size() const {
    if (!is_array() && !is_object()) expected("an array or an object");
    return j_->size();
  }
  const nlohmann::json& array() const {
    if (!is_array()) expected("an array");
    return *j_;
  }
  const nlohmann::json& object() const {
    if (!is_object()) expected("an object");
    return *j_;
  }

  std::string string() const {
    if (!is_string()) expected("a string");
    return j_->get<std::string>();
  }
  std::int64_t integer(std::int64_t lo = std::numeric_limits<std::int64_t>::min(), std::int64_t hi = std::numeric_limits<std::int64_t>::max()) const {
    const bool in_range = j_ && ((j_->is_number_integer() && !j_->is_number_unsigned()) || (j_->is_number_unsigned() && j_->get<std::uint64_t>() <= static_cast<std::uint64_t>(hi)));
    if (!in_range || j_->get<std::int64_t>() < lo || j_->get<std::int64_t>() > hi) {
      const bool no_lo = lo == std::numeric_limits<std::int64_t>::min(), no_hi = hi == std::numeric_limits<std::int64_t>::max();
      expected(no_lo && no_hi ? std::string("an integer")
               : no_hi        ? "an integer of at least " + std::to_string(lo)
               : no_lo        ? "an integer of at most " + std::to_string(hi)
                              : "an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
    }
    return j_->get<std::int64_t>();
  }
  double number() const {
    if (!j_ || !j_->is_number()) expected("a number");
    return j_->get<double>();
  }
  bool boolean() const {
    if (!j_ || !j_->is_boolean()) expected("true or false");
    return j_->get<bool>();
  }
  std::optional<std::string> opt_string() const { return present() ? std::optional(string()) : std::nullopt; }
  std::optional<std::int64_t> opt_integer(std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                                          std::int64_t hi = std::numeric_limits<std::int64_t>::max()) const {
    return present() ? std::optional(integer(lo, hi)) : std::nullopt;
  }
  std::optional<double> opt_number() const { return present() ? std::optional(number()) : std::nullopt; }
  std::optional<bool> opt_boolean() const { return present() ? std::optional(boolean()) : std::nullopt; }
  std::string string_or(const std::string& absent) const { return present() ? string() : absent; }
  std::int64_t integer_or(std::int64_t absent) const { return present() ? integer() : absent; }
  double number_or(double absent) const { return present() ? number() : absent; }
  bool boolean_or(bool absent) const { return present() ? boolean() : absent; }

  // "WHERE: expected WHAT, found DESCRIPTION" (or "WHERE is missing (WHAT expected)").
  [[noreturn]] void expected(const std::string& what) const {
    if (!j_) missing(what);
    throw UserError(where_ + ": expected " + what + ", found " + describe(*j_));
  }
  // "WHERE: MESSAGE".
  [[noreturn]] void fail(const std::string& message) const { throw UserError(where_ + ": " + message); }

 private:
  Value(const nlohmann::json* j, std::string where) : j_(j), where_(std::move(where)), root_(false) {}
  [[noreturn]] void missing(const std::string& what) const { throw UserError(where_ + " is missing (" + what + " expected)"); }

  const nlohmann::json* j_;
  std::string where_;
  bool root_;
};

}  // namespace loom::kit::json
