#include "config/data.hpp"

#include <fstream>

#include <unistd.h>
#include <algorithm>
#include <numeric>

#include <nlohmann/json.hpp>

#include "chat/chat_data.hpp"
#include "loom/error.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"

namespace loom::core {
namespace {

constexpr std::size_t kMaxLineBytes = 64u << 20;

struct Piece {
  bool field;
  std::string text;  // literal text, or the field name
};

std::vector<Piece> parse_format(const std::string& format) {
  std::vector<Piece> pieces;
  std::string literal;
  for (std::size_t i = 0; i < format.size(); ++i) {
    const char c = format[i];
    if ((c == '{' || c == '}') && i + 1 < format.size() && format[i + 1] == c) {
      literal += c;
      ++i;
    } else if (c == '{') {
      const auto close = format.find('}', i);
      if (close == std::string::npos) throw UserError("[data] format: '{' at position " + std::to_string(i) + " is never closed");
      const std::string name = format.substr(i + 1, close - i - 1);
      if (name.empty() || name.find('{') != std::string::npos) throw UserError("[data] format: bad field name \"{" + name + "}\"");
      if (!literal.empty()) pieces.push_back({false, std::move(literal)});
      literal.clear();
      pieces.push_back({true, name});
      i = close;
    } else if (c == '}') {
      throw UserError("[data] format: '}' at position " + std::to_string(i) + " has no '{' (write }} for a literal brace)");
    } else {
      literal += c;
    }
  }
  if (!literal.empty()) pieces.push_back({false, literal});
  if (std::none_of(pieces.begin(), pieces.end(), [](const Piece& p) { return p.field; }))
    throw UserError("[data] format " + kit::json::quote(format) +
                    " names no field (such as {text}): every sample would be the same text; the chat formats are \"messages\", \"sharegpt\" and \"alpaca\"");
  return pieces;
}

}  // namespace

bool read_line(std::istream& in, std::string& line, bool& too_long) {
  line.clear();
  too_long = false;
  char buffer[65536];
  while (true) {
    in.getline(buffer, sizeof buffer);
    const auto got = static_cast<std::size_t>(in.gcount());
    if (in.bad() || (in.fail() && !in.eof() && got == 0)) throw UserError("cannot read the input (is it a regular file?)");
    if (in.fail() && !in.eof() && got == sizeof buffer - 1) {  // the buffer filled before a newline
      in.clear();
      if (line.size() + got > kMaxLineBytes) too_long = true;
      else line.append(buffer, got);
      continue;
    }
    if (got == 0 && in.eof() && line.empty()) return false;
    const std::size_t tail = got > 0 && !in.eof() ? got - 1 : got;  // without the newline
    if (line.size() + tail > kMaxLineBytes) too_long = true;
    if (!too_long) line.append(buffer, tail);
    if (in.eof()) in.clear(std::ios::eofbit);
    return true;
  }
}

void check_format(const std::string& format) {
  if (!is_chat_format(format)) parse_format(format);
}

Dataset load_jsonl(const std::filesystem::path& file, const std::string& format, bool skip_bad_lines, std::size_t max_records) {
  const bool chat = is_chat_format(format);
  const auto pieces = chat ? std::vector<Piece>{} : parse_format(format);
  ::close(kit::open_regular_file(file, "data file"));
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UserError(file.string() + ": cannot read");
  Dataset data;
  std::string line;
  bool too_long = false;
  std::size_t number = 0;
  while (data.samples.size() < max_records && read_line(in, line, too_long)) {
    ++number;
    const std::string where = file.string() + ":" + std::to_string(number) + ": ";
    if (!too_long && line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are not records
    try {
      if (too_long) throw UserError(where + "line is longer than 64 MiB");
      if (chat) {
        const auto record = kit::json::parse<nlohmann::ordered_json>(line, file.string(), kit::json::kMaxDepth, number);
        if (!record.is_object()) throw UserError(where + "expected a JSON object, found " + kit::json::describe(nlohmann::json(record)));
        try {
          data.samples.push_back(conversation_to_sample(conversation_from_record(record, format)));
        } catch (const UserError& e) {
          throw UserError(where + e.what());
        }
        data.lines.push_back(number);
        continue;
      }
      const nlohmann::json record = kit::json::parse(line, file.string(), kit::json::kMaxDepth, number);
      if (!record.is_object()) throw UserError(where + "expected a JSON object, found " + kit::json::describe(record));
      std::string text;
      for (const auto& p : pieces) {
        if (!p.field) {
          text += p.text;
          continue;
        }
        const auto it = record.find(p.text);
        if (it == record.end()) {
          std::string fields;
          for (const auto& [k, v] : record.items()) fields += (fields.empty() ? "" : ", ") + kit::json::quote(k, 40);
          if (fields.size() > 300) fields = fields.substr(0, 300) + "...";
          throw UserError(where + "record has no field '" + p.text + "' used by [data] format (" + (fields.empty() ? "it has none" : "its fields: " + fields) + ")");
        }
        text += it->is_string() ? it->get<std::string>() : it->dump();
      }
      data.samples.push_back(std::move(text));
      data.lines.push_back(number);
    } catch (const UserError&) {
      if (!skip_bad_lines) throw;
      ++data.skipped_lines;
    }
  }
  if (data.samples.empty())
    throw UserError(file.string() + (number == 0 ? ": holds no records (a JSON object per line is expected)" : ": no usable records (every line was bad and skipped)"));
  return data;
}

std::vector<std::size_t> epoch_order(std::size_t n, std::uint64_t seed, std::uint64_t epoch, bool shuffle) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (!shuffle) return order;
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + epoch + 1;
  const auto next = [&] {  // SplitMix64: the same sequence on every platform and compiler
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (std::size_t i = n; i > 1; --i) std::swap(order[i - 1], order[next() % i]);
  return order;
}

}  // namespace loom::core
