// The lexer: the template's text and tags, with Jinja's whitespace control applied here.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <limits>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "jinja/internal.hpp"
#include "loom/error.hpp"
#include "loom/kit/utf8.hpp"

namespace loom::formats::jinja {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string rstrip_ws(const std::string& s) {
  std::size_t k = s.size();
  while (k > 0 && is_space(s[k - 1])) --k;
  return s.substr(0, k);
}

class Lexer {
 public:
  Lexer(std::string source, const Settings& settings) : src_(std::move(source)), settings_(settings) {
    // Jinja reads the source by lines: \r\n and \r become \n, and one trailing newline goes.
    std::string normal;
    normal.reserve(src_.size());
    for (std::size_t k = 0; k < src_.size(); ++k) {
      if (src_[k] == '\r') {
        normal += '\n';
        if (k + 1 < src_.size() && src_[k + 1] == '\n') ++k;
      } else
        normal += src_[k];
    }
    if (!normal.empty() && normal.back() == '\n') normal.pop_back();
    src_ = std::move(normal);
  }

  std::vector<Token> run() {
    while (true) {
      const std::size_t open = next_tag(pos_);
      std::string text = src_.substr(pos_, open == std::string::npos ? std::string::npos : open - pos_);
      const int text_line = line_;
      count_lines(pos_, open == std::string::npos ? src_.size() : open);
      if (open == std::string::npos) {
        emit_text(text, text_line);
        break;
      }
      const char kind = src_[open + 1];
      const char mod = open + 2 < src_.size() ? src_[open + 2] : '\0';
      if (mod == '-')
        text = rstrip_ws(text);
      else if (kind != '{' && settings_.lstrip_blocks && mod != '+') {
        std::size_t line_start = text.rfind('\n');
        line_start = line_start == std::string::npos ? 0 : line_start + 1;
        if ((line_start > 0 || line_starting_) && text.find_first_not_of(" \t", line_start) == std::string::npos) text.erase(line_start);
      }
      emit_text(text, text_line);
      pos_ = open + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      if (kind == '#')
        comment(open);
      else
        tag(kind == '{');
    }
    tokens_.push_back({Token::kEnd, "", 0, 0, line_});
    return std::move(tokens_);
  }

 private:
  std::size_t next_tag(std::size_t from) const {
    std::size_t at = from;
    while ((at = src_.find('{', at)) != std::string::npos) {
      if (at + 1 < src_.size() && (src_[at + 1] == '{' || src_[at + 1] == '%' || src_[at + 1] == '#')) return at;
      ++at;
    }
    return std::string::npos;
  }

  void count_lines(std::size_t from, std::size_t to) { line_ += static_cast<int>(std::count(src_.begin() + static_cast<long>(from), src_.begin() + static_cast<long>(to), '\n')); }

  void emit_text(const std::string& text, int at) {
    if (!text.empty()) tokens_.push_back({Token::kText, text, 0, 0, at});
  }

  // After a tag's closing delimiter: `-` eats the whitespace that follows; a block's own
  // newline goes with trim_blocks unless the tag ends in `+`.
  void after_close(bool minus, bool plus, bool block) {
    if (minus) {
      std::size_t end = pos_;
      while (end < src_.size() && is_space(src_[end])) ++end;
      count_lines(pos_, end);
      line_starting_ = end > pos_ && src_[end - 1] == '\n';
      pos_ = end;
    } else if (block && settings_.trim_blocks && !plus && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
      ++line_;
      line_starting_ = true;
    } else
      line_starting_ = false;
  }

  void comment(std::size_t open) {
    const std::size_t close = src_.find("#}", pos_);
    if (close == std::string::npos) throw SyntaxError(line_, "a comment opened here is never closed with #}");
    const bool minus = close > pos_ && src_[close - 1] == '-';
    const bool plus = close > pos_ && src_[close - 1] == '+';
    count_lines(open, close + 2);
    pos_ = close + 2;
    after_close(minus, plus, true);
  }

  // Whether the tag at pos_ (after `{%`) is `raw`; then its text up to {% endraw %} is data.
  bool raw_block() {
    std::size_t k = pos_;
    while (k < src_.size() && is_space(src_[k])) ++k;
    if (src_.compare(k, 3, "raw") != 0) return false;
    k += 3;
    while (k < src_.size() && is_space(src_[k])) ++k;
    const bool minus = src_.compare(k, 3, "-%}") == 0;
    if (!minus && src_.compare(k, 2, "%}") != 0) return false;
    const int start_line = line_;
    count_lines(pos_, k);
    pos_ = k + (minus ? 3 : 2);
    after_close(minus, false, true);
    std::size_t search = pos_;
    while (true) {
      const std::size_t open = src_.find("{%", search);
      if (open == std::string::npos) throw SyntaxError(start_line, "{% raw %} is never closed with {% endraw %}");
      std::size_t m = open + 2;
      const char mod = m < src_.size() ? src_[m] : '\0';
      if (mod == '-' || mod == '+') ++m;
      while (m < src_.size() && is_space(src_[m])) ++m;
      if (src_.compare(m, 6, "endraw") != 0) {
        search = open + 2;
        continue;
      }
      m += 6;
      while (m < src_.size() && is_space(src_[m])) ++m;
      const bool close_minus = src_.compare(m, 3, "-%}") == 0, close_plus = src_.compare(m, 3, "+%}") == 0;
      if (!close_minus && !close_plus && src_.compare(m, 2, "%}") != 0) throw SyntaxError(line_, "{% endraw %} is not closed with %}");
      std::string text = src_.substr(pos_, open - pos_);
      if (mod == '-') text = rstrip_ws(text);
      emit_text(text, line_);
      count_lines(pos_, m);
      pos_ = m + (close_minus || close_plus ? 3 : 2);
      after_close(close_minus, close_plus, true);
      return true;
    }
  }

  void tag(bool variable) {
    if (!variable && raw_block()) return;
    tokens_.push_back({variable ? Token::kVarBegin : Token::kBlockBegin, "", 0, 0, line_});
    brackets_ = 0;
    while (true) {
      while (pos_ < src_.size() && is_space(src_[pos_])) {
        if (src_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= src_.size()) throw SyntaxError(line_, std::string("a tag is never closed with ") + (variable ? "}}" : "%}"));
      const char* close = variable ? "}}" : "%}";
      // As Jinja: inside open brackets `}}` is two braces, not the end of the tag.
      for (const char lead : {'-', '+', '\0'}) {
        if (brackets_ > 0) break;
        const std::size_t width = lead ? 3 : 2;
        if ((lead && src_[pos_] != lead) || src_.compare(pos_ + (lead ? 1 : 0), 2, close) != 0) continue;
        if (lead == '+' && variable) continue;
        tokens_.push_back({variable ? Token::kVarEnd : Token::kBlockEnd, "", 0, 0, line_});
        pos_ += width;
        after_close(lead == '-', lead == '+', !variable);
        return;
      }
      expression_token();
    }
  }

  void expression_token() {
    const char c = src_[pos_];
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t end = pos_;
      while (end < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) ++end;
      tokens_.push_back({Token::kName, src_.substr(pos_, end - pos_), 0, 0, line_});
      pos_ = end;
      return;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      number();
      return;
    }
    if (c == '\'' || c == '"') {
      string_literal(c);
      return;
    }
    static const char* const two[] = {"**", "//", "==", "!=", "<=", ">="};
    for (const char* op : two)
      if (src_.compare(pos_, 2, op) == 0) {
        tokens_.push_back({Token::kOp, op, 0, 0, line_});
        pos_ += 2;
        return;
      }
    if (std::string("+-*/%~<>=()[]{},.:|").find(c) != std::string::npos) {
      if (c == '(' || c == '[' || c == '{') ++brackets_;
      if ((c == ')' || c == ']' || c == '}') && brackets_ > 0) --brackets_;
      tokens_.push_back({Token::kOp, std::string(1, c), 0, 0, line_});
      ++pos_;
      return;
    }
    throw SyntaxError(line_, std::string("unexpected character '") + c + "' in a tag");
  }

  void number() {
    std::size_t end = pos_;
    std::string digits;
    const auto take_digits = [&] {
      while (end < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) {
        if (src_[end] != '_') digits += src_[end];
        ++end;
      }
    };
    take_digits();
    bool real = false;
    if (end + 1 < src_.size() && src_[end] == '.' && std::isdigit(static_cast<unsigned char>(src_[end + 1]))) {
      real = true;
      digits += '.';
      ++end;
      take_digits();
    }
    if (end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      std::size_t e = end + 1;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) {
        real = true;
        digits += src_.substr(end, e - end);
        end = e;
        take_digits();
      }
    }
    Token t{real ? Token::kFloat : Token::kInt, digits, 0, 0, line_};
    if (real)
      t.f = std::strtod(digits.c_str(), nullptr);
    else {
      errno = 0;
      t.i = std::strtoll(digits.c_str(), nullptr, 10);
      if (errno == ERANGE || digits.size() > 19) throw SyntaxError(line_, "the integer " + digits + " is too large (64-bit integers only)");
    }
    tokens_.push_back(t);
    pos_ = end;
  }

  // Python's string escapes (Jinja decodes literals with unicode-escape); an unknown escape keeps
  // its backslash.
  void string_literal(char quote) {
    std::string value;
    std::size_t k = pos_ + 1;
    const int start_line = line_;
    const auto hex = [&](std::size_t at, int digits) -> std::optional<std::uint32_t> {
      if (at + static_cast<std::size_t>(digits) > src_.size()) return std::nullopt;
      std::uint32_t v = 0;
      for (int d = 0; d < digits; ++d) {
        const char h = src_[at + static_cast<std::size_t>(d)];
        if (!std::isxdigit(static_cast<unsigned char>(h))) return std::nullopt;
        v = v * 16 + static_cast<std::uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      return v;
    };
    while (true) {
      if (k >= src_.size()) throw SyntaxError(start_line, "a string literal is never closed");
      const char c = src_[k];
      if (c == quote) break;
      if (c == '\n') ++line_;
      if (c != '\\' || k + 1 >= src_.size()) {
        value += c;
        ++k;
        continue;
      }
      const char e = src_[k + 1];
      k += 2;
      switch (e) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case 'a': value += '\a'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case '\n': ++line_; break;  // a backslash before a newline continues the line
        case 'x':
        case 'u':
        case 'U': {
          const int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          const auto cp = hex(k, digits);
          if (!cp || *cp > 0x10FFFF) throw SyntaxError(line_, std::string("a bad \\") + e + " escape in a string literal");
          append_utf8(value, *cp);
          k += static_cast<std::size_t>(digits);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            std::uint32_t cp = static_cast<std::uint32_t>(e - '0');
            for (int d = 0; d < 2 && k < src_.size() && src_[k] >= '0' && src_[k] <= '7'; ++d, ++k) cp = cp * 8 + static_cast<std::uint32_t>(src_[k] - '0');
            append_utf8(value, cp);
          } else {
            value += '\\';
            value += e;
          }
      }
    }
    tokens_.push_back({Token::kString, value, 0, 0, start_line});
    pos_ = k + 1;
  }

  std::string src_;
  const Settings& settings_;
  std::vector<Token> tokens_;
  std::size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  int brackets_ = 0;  // brackets open in the current tag
};

}  // namespace

std::vector<Token> tokenize(const std::string& source, const Settings& settings) { return Lexer(source, settings).run(); }

}  // namespace loom::formats::jinja
