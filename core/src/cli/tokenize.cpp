#include "cli/tokenize.hpp"

#include <chrono>
#include <climits>
#include <cstdio>
#include <iostream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "config/data.hpp"
#include "loom/error.hpp"
#include "loom/kit/json.hpp"

namespace loom::core {

void tokenize_stream(const Tokenizer& tokenizer, std::istream& in, std::ostream& out, const TokenizeSettings& settings, const std::string& source,
                     bool one_input) {
  using Clock = std::chrono::steady_clock;
  Clock::duration busy{};
  std::size_t lines = 0, bytes = 0, tokens = 0;
  std::string line, buffer;
  bool too_long = false;
  // One input: the whole stream, newlines and all, even when empty.
  const auto next = [&] {
    if (!one_input) return read_line(in, line, too_long);
    if (lines > 0) return false;
    line.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    return true;
  };
  while (next()) {
    ++lines;
    const std::string where = one_input ? source : source + ":" + std::to_string(lines);
    if (too_long) throw UserError(where + ": line is longer than 64 MiB");
    // JSON errors name source:line:col themselves.
    const nlohmann::json parsed = settings.decode || settings.json_lines ? kit::json::parse(line, source, kit::json::kMaxDepth, lines) : nlohmann::json();
    try {
      if (settings.decode) {
        if (!parsed.is_array()) throw UserError("expected a JSON array of token ids, found " + kit::json::describe(parsed));
        std::vector<std::int64_t> list;
        for (const auto& id : parsed) {
          if (!id.is_number_integer() || (id.is_number_unsigned() && id.get<std::uint64_t>() > INT64_MAX))
            throw UserError("token ids are integers; found " + kit::json::describe(id));
          list.push_back(id.get<std::int64_t>());
        }
        const auto start = Clock::now();
        const std::string text = tokenizer.decode(list, !settings.specials);
        busy += Clock::now() - start;
        tokens += list.size();
        bytes += text.size();
        // Decoded bytes that are not UTF-8 (a token cut inside a character) print as U+FFFD.
        buffer = nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      } else {
        std::string text = line;
        if (settings.json_lines) {
          if (!parsed.is_string()) throw UserError("--json-lines: expected a JSON string, found " + kit::json::describe(parsed));
          text = parsed.get<std::string>();
        }
        bytes += text.size();
        const auto encode = [&](bool specials) {
          const auto start = Clock::now();
          Encoding e = tokenizer.encode(text, specials ? Specials::kPrompt : Specials::kNone);
          busy += Clock::now() - start;
          tokens += e.ids.size();
          return e;
        };
        if (settings.round_trip) {
          // Both encodings and the text each decodes to (special tokens kept), from one load.
          nlohmann::json row = nlohmann::json::object();
          for (const bool specials : {true, false}) {
            const Encoding e = encode(specials);
            const auto start = Clock::now();
            row[specials ? "text" : "text_no_special"] = tokenizer.decode(e.ids, false);
            busy += Clock::now() - start;
            row[specials ? "ids" : "ids_no_special"] = e.ids;
          }
          buffer = row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        } else {
          buffer = nlohmann::json(encode(settings.specials).ids).dump();
        }
      }
    } catch (const UserError& e) {
      throw UserError(where + ": " + e.what());
    }
    out << buffer << '\n';
  }
  out.flush();
  if (settings.stats) {
    const double seconds = std::chrono::duration<double>(busy).count();
    char rate[64];
    std::snprintf(rate, sizeof rate, "%.3f s in the tokenizer, %.2f MB/s", seconds, seconds > 0 ? static_cast<double>(bytes) / seconds / 1e6 : 0.0);
    std::cerr << "loom tokenize: " << lines << " lines, " << bytes << " bytes, " << tokens << " tokens; " << rate << "\n";
  }
}

}  // namespace loom::core
