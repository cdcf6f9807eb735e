#include "chat/jinja.hpp"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <ctime>
#include <optional>
#include <set>
#include <unordered_map>

#include "chat/jinja_value.hpp"
#include "loom/error.hpp"

namespace loom::core::jinja {

namespace {

// ---------------------------------------------------------------------------------------------
// Lexing: the template's text and tags, with Jinja's whitespace control applied here.

struct Token {
  enum Type { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEnd } type;
  std::string text;
  std::int64_t i = 0;
  double f = 0;
  int line = 0;
};

struct SyntaxError : std::runtime_error {
  SyntaxError(int at, const std::string& what) : std::runtime_error(what), line(at) {}
  int line;
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string lstrip_ws(const std::string& s) {
  std::size_t k = 0;
  while (k < s.size() && is_space(s[k])) ++k;
  return s.substr(k);
}

std::string rstrip_ws(const std::string& s) {
  std::size_t k = s.size();
  while (k > 0 && is_space(s[k - 1])) --k;
  return s.substr(0, k);
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80)
    out += static_cast<char>(cp);
  else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
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
      if (errno == ERANGE || digits.size() > 18) throw SyntaxError(line_, "the integer " + digits + " is too large (64-bit integers only)");
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

// ---------------------------------------------------------------------------------------------
// The syntax tree and its evaluation.

struct Expr {
  int line = 0;
  virtual ~Expr() = default;
  virtual Value eval(Interp& in) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Stmt {
  int line = 0;
  virtual ~Stmt() = default;
  virtual void exec(Interp& in) const = 0;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct FilterCall {
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  int line = 0;
};

}  // namespace

using Scope = std::unordered_map<std::string, Value>;

struct Interp {
  const Settings& settings;
  const std::string& name;
  std::vector<Scope*> scopes;  // innermost last
  std::string* out = nullptr;
  std::string* main_out = nullptr;
  std::vector<std::pair<std::size_t, std::size_t>> spans;
  std::uint64_t steps = 0;
  int line = 0;
  int depth = 0;
  enum class Flow { kNormal, kBreak, kContinue } flow = Flow::kNormal;

  Value lookup(const std::string& key) const {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it)
      if (auto found = (*it)->find(key); found != (*it)->end()) return found->second;
    return Value::undefined("'" + key + "' is undefined");
  }
  void step() {
    if (++steps > settings.max_steps) throw Failure("the template ran more than " + std::to_string(settings.max_steps) + " steps");
  }
  void write(const std::string& text) {
    if (out->size() + text.size() > settings.max_output_bytes)
      throw Failure("the template printed more than " + std::to_string(settings.max_output_bytes) + " bytes");
    *out += text;
  }
  void exec(const Body& body) {
    for (const auto& s : body) {
      line = s->line;
      step();
      s->exec(*this);
      if (flow != Flow::kNormal) return;
    }
  }
  // Runs `body` with its output captured and returned.
  std::string capture(const Body& body) {
    std::string buffer;
    std::string* saved = out;
    out = &buffer;
    try {
      exec(body);
    } catch (...) {
      out = saved;
      throw;
    }
    out = saved;
    return buffer;
  }
};

namespace {

// No value a template builds may pass what it may print (a string doubled 60 times would).
constexpr std::size_t kMaxValueBytes = std::size_t{64} << 20;

Value bounded(Value v) {
  if ((v.is_string() && v.s.size() > kMaxValueBytes) || (v.is_sequence() && v.list->size() > kMaxValueBytes / 8))
    throw Failure("a value of more than 64 MiB");
  return v;
}

[[noreturn]] void fail_undefined(const Value& v) { throw Failure(v.s.empty() ? "a value is undefined" : v.s); }

std::string need_string(const Value& v, const char* what) {
  if (v.kind == Value::Kind::kUndefined) fail_undefined(v);
  if (!v.is_string()) throw Failure(std::string(what) + " needs a string, not " + type_name(v));
  return v.s;
}

std::int64_t need_int(const Value& v, const char* what) {
  if (v.kind == Value::Kind::kUndefined) fail_undefined(v);
  if (!v.is_integral()) throw Failure(std::string(what) + " needs an integer, not " + type_name(v));
  return v.as_int();
}

// The items a for loop or a filter walks: a list's, a dict's keys, a string's characters.
List iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return {};
    case Value::Kind::kList:
    case Value::Kind::kTuple: return *v.list;
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, unused] : v.dict->items) keys.push_back(Value::string(k));
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (auto& c : code_points(v.s)) chars.push_back(Value::string(std::move(c)));
      return chars;
    }
    default: throw Failure("'" + type_name(v) + "' object is not iterable");
  }
}

std::int64_t length_of(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return 0;
    case Value::Kind::kString: return static_cast<std::int64_t>(code_point_count(v.s));
    case Value::Kind::kList:
    case Value::Kind::kTuple: return static_cast<std::int64_t>(v.list->size());
    case Value::Kind::kDict: return static_cast<std::int64_t>(v.dict->items.size());
    default: throw Failure("object of type '" + type_name(v) + "' has no len()");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Value::Kind::kUndefined: return false;
    case Value::Kind::kString:
      if (!item.is_string()) throw Failure("'in <string>' requires string as left operand, not " + type_name(item));
      return container.s.find(item.s) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return std::any_of(container.list->begin(), container.list->end(), [&](const Value& x) { return equals(x, item); });
    case Value::Kind::kDict: return item.is_string() && container.dict->find(item.s) != nullptr;
    default: throw Failure("argument of type '" + type_name(container) + "' is not iterable");
  }
}

// ---- string helpers with Python's str semantics -------------------------------------------

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<std::string> cps = code_points(s);
  std::set<std::string> set;
  const bool whitespace = !chars.defined() || chars.kind == Value::Kind::kNone;
  if (!whitespace)
    for (auto& c : code_points(need_string(chars, "strip"))) set.insert(c);
  const auto strippable = [&](const std::string& c) {
    if (!whitespace) return set.count(c) != 0;
    std::size_t at = 0;
    return is_py_space(decode_at(c, at));
  };
  std::size_t begin = 0, end = cps.size();
  if (left)
    while (begin < end && strippable(cps[begin])) ++begin;
  if (right)
    while (end > begin && strippable(cps[end - 1])) --end;
  std::string out;
  for (std::size_t k = begin; k < end; ++k) out += cps[k];
  return out;
}

List split_string(const std::string& s, const Value& sep, std::int64_t max_split) {
  List out;
  if (!sep.defined() || sep.kind == Value::Kind::kNone) {
    // Runs of whitespace separate; none at either end.
    std::size_t pos = 0;
    const auto skip_space = [&] {
      while (pos < s.size()) {
        std::size_t next = pos;
        if (!is_py_space(decode_at(s, next))) break;
        pos = next;
      }
    };
    skip_space();
    while (pos < s.size()) {
      if (max_split >= 0 && static_cast<std::int64_t>(out.size()) == max_split) {
        std::string rest = s.substr(pos);
        out.push_back(Value::string(strip_chars(rest, Value::none(), false, true)));
        return out;
      }
      const std::size_t start = pos;
      while (pos < s.size()) {
        std::size_t next = pos;
        if (is_py_space(decode_at(s, next))) break;
        pos = next;
      }
      out.push_back(Value::string(s.substr(start, pos - start)));
      skip_space();
    }
    return out;
  }
  const std::string separator = need_string(sep, "split");
  if (separator.empty()) throw Failure("empty separator");
  std::size_t pos = 0;
  while (true) {
    const std::size_t at = s.find(separator, pos);
    if (at == std::string::npos || (max_split >= 0 && static_cast<std::int64_t>(out.size()) == max_split)) {
      out.push_back(Value::string(s.substr(pos)));
      return out;
    }
    out.push_back(Value::string(s.substr(pos, at - pos)));
    pos = at + separator.size();
  }
}

std::string ascii_map(std::string s, int (*f)(int)) {
  for (auto& c : s)
    if (static_cast<unsigned char>(c) < 0x80) c = static_cast<char>(f(c));
  return s;
}

// str.title(): a letter after a non-letter is upper-cased, the others lower-cased.
std::string title_case(const std::string& s) {
  std::string out = s;
  bool previous_letter = false;
  for (auto& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x80) {
      previous_letter = (u & 0xC0) == 0x80 ? previous_letter : true;
      continue;
    }
    const bool letter = std::isalpha(u) != 0;
    c = static_cast<char>(letter ? (previous_letter ? std::tolower(u) : std::toupper(u)) : u);
    previous_letter = letter;
  }
  return out;
}

std::string capitalize(const std::string& s) {
  std::string out = ascii_map(s, [](int c) { return std::tolower(c); });
  if (!out.empty() && static_cast<unsigned char>(out[0]) < 0x80) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, std::int64_t count) {
  if (from.empty()) throw Failure("replace with an empty old string is not supported");
  std::string out;
  std::size_t pos = 0;
  std::int64_t done = 0;
  while (count < 0 || done < count) {
    const std::size_t at = s.find(from, pos);
    if (at == std::string::npos) break;
    out += s.substr(pos, at - pos) + to;
    if (out.size() > kMaxValueBytes) throw Failure("a value of more than 64 MiB");
    pos = at + from.size();
    ++done;
  }
  return out + s.substr(pos);
}

const Value* named_arg(const CallArgs& args, const char* key) {
  for (const auto& [k, v] : args.named)
    if (k == key) return &v;
  return nullptr;
}

// The argument at `index` or named `key`, else `fallback`.
Value arg(const CallArgs& args, std::size_t index, const char* key, Value fallback = Value::undefined("")) {
  if (index < args.positional.size()) return args.positional[index];
  if (const Value* v = named_arg(args, key)) return *v;
  return fallback;
}

bool affix_match(const std::string& s, const Value& affix, bool prefix) {
  const auto one = [&](const std::string& a) {
    return a.size() <= s.size() && (prefix ? s.compare(0, a.size(), a) == 0 : s.compare(s.size() - a.size(), a.size(), a) == 0);
  };
  if (affix.is_sequence()) return std::any_of(affix.list->begin(), affix.list->end(), [&](const Value& a) { return one(need_string(a, "startswith")); });
  return one(need_string(affix, prefix ? "startswith" : "endswith"));
}

Value string_method(const std::string& s, const std::string& method, CallArgs& a) {
  if (method == "strip" || method == "lstrip" || method == "rstrip")
    return Value::string(strip_chars(s, arg(a, 0, "chars"), method != "rstrip", method != "lstrip"));
  if (method == "split") {
    const Value max = arg(a, 1, "maxsplit", Value::integer(-1));
    return Value::make_list(split_string(s, arg(a, 0, "sep"), need_int(max, "split")));
  }
  if (method == "startswith" || method == "endswith") return Value::boolean(affix_match(s, arg(a, 0, "prefix"), method == "startswith"));
  if (method == "upper") return Value::string(ascii_map(s, [](int c) { return std::toupper(c); }));
  if (method == "lower") return Value::string(ascii_map(s, [](int c) { return std::tolower(c); }));
  if (method == "title") return Value::string(title_case(s));
  if (method == "capitalize") return Value::string(capitalize(s));
  if (method == "replace") {
    const Value count = arg(a, 2, "count", Value::integer(-1));
    return Value::string(replace_all(s, need_string(arg(a, 0, "old"), "replace"), need_string(arg(a, 1, "new"), "replace"), need_int(count, "replace")));
  }
  if (method == "find" || method == "count") {
    const std::string sub = need_string(arg(a, 0, "sub"), method.c_str());
    if (method == "find") {
      const auto at = s.find(sub);
      return Value::integer(at == std::string::npos ? -1 : static_cast<std::int64_t>(code_point_count(s.substr(0, at))));
    }
    if (sub.empty()) return Value::integer(static_cast<std::int64_t>(code_point_count(s)) + 1);
    std::int64_t n = 0;
    for (std::size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
    return Value::integer(n);
  }
  if (method == "join") {
    std::string out;
    const List items = iterate(arg(a, 0, "iterable"));
    for (std::size_t k = 0; k < items.size(); ++k) out += (k ? s : "") + need_string(items[k], "join");
    return Value::string(out);
  }
  if (method == "splitlines") {
    List lines;
    std::size_t pos = 0;
    while (pos < s.size()) {
      const std::size_t at = s.find('\n', pos);
      lines.push_back(Value::string(s.substr(pos, at == std::string::npos ? std::string::npos : at - pos)));
      if (at == std::string::npos) break;
      pos = at + 1;
    }
    return Value::make_list(std::move(lines));
  }
  if (method == "isdigit" || method == "isspace" || method == "isalpha" || method == "isalnum" || method == "isupper" || method == "islower") {
    if (s.empty()) return Value::boolean(false);
    bool all = true, cased = false;
    for (std::size_t pos = 0; pos < s.size();) {
      const auto cp = decode_at(s, pos);
      const int c = cp < 0x80 ? static_cast<int>(cp) : -1;
      if (method == "isspace") all = all && is_py_space(cp);
      else if (method == "isdigit") all = all && c >= 0 && std::isdigit(c);
      else if (method == "isalpha") all = all && c >= 0 && std::isalpha(c);
      else if (method == "isalnum") all = all && c >= 0 && std::isalnum(c);
      else if (c >= 0 && std::isalpha(c)) {
        cased = true;
        all = all && (method == "isupper" ? std::isupper(c) : std::islower(c));
      }
    }
    return Value::boolean(all && (method == "isspace" || method == "isdigit" || method == "isalpha" || method == "isalnum" || cased));
  }
  throw Failure("'str object' has no attribute '" + method + "'" + (method == "format" ? " (str.format is not supported; use ~ or the format filter-free forms)" : ""));
}

bool is_string_method(const std::string& m) {
  static const std::set<std::string> names{"strip", "lstrip", "rstrip", "split", "startswith", "endswith", "upper",   "lower",   "title",   "capitalize",
                                           "replace", "find", "count", "join", "splitlines", "isdigit", "isspace", "isalpha", "isalnum", "isupper", "islower"};
  return names.count(m) != 0;
}

Value dict_method(const std::shared_ptr<Dict>& d, const std::string& method, CallArgs& a) {
  if (method == "items") {
    List out;
    for (const auto& [k, v] : d->items) out.push_back(Value::make_list({Value::string(k), v}, true));
    return Value::make_list(std::move(out));
  }
  if (method == "keys" || method == "values") {
    List out;
    for (const auto& [k, v] : d->items) out.push_back(method == "keys" ? Value::string(k) : v);
    return Value::make_list(std::move(out));
  }
  if (method == "get") {
    const Value key = arg(a, 0, "key");
    if (key.is_string())
      if (const Value* v = d->find(key.s)) return *v;
    return arg(a, 1, "default", Value::none());
  }
  throw Failure("'dict object' has no attribute '" + method + "'");
}

bool is_dict_method(const std::string& m) { return m == "items" || m == "keys" || m == "values" || m == "get"; }

// obj.attr as Jinja's sandbox resolves it: a method of the value first, then its item.
Value get_attribute(const Value& obj, const std::string& attr) {
  switch (obj.kind) {
    case Value::Kind::kUndefined: fail_undefined(obj);
    case Value::Kind::kDict:
      if (is_dict_method(attr)) {
        auto d = obj.dict;
        return Value::function(attr, [d, attr](CallArgs& a, Interp&) { return dict_method(d, attr, a); });
      }
      [[fallthrough]];
    case Value::Kind::kNamespace:
      if (const Value* v = obj.dict->find(attr)) return *v;
      return Value::undefined("'" + std::string(obj.kind == Value::Kind::kDict ? "dict object" : "Namespace") + "' has no attribute '" + attr + "'");
    case Value::Kind::kString:
      if (is_string_method(attr)) {
        std::string s = obj.s;
        return Value::function(attr, [s, attr](CallArgs& a, Interp&) { return string_method(s, attr, a); });
      }
      [[fallthrough]];
    default: return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + attr + "'");
  }
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.kind == Value::Kind::kUndefined) fail_undefined(obj);
  if (obj.kind == Value::Kind::kDict || obj.kind == Value::Kind::kNamespace) {
    if (key.is_string()) {
      if (const Value* v = obj.dict->find(key.s)) return *v;
      return get_attribute(obj, key.s);
    }
    return Value::undefined("'dict object' has no attribute '" + to_str(key) + "'");
  }
  if (obj.is_sequence() || obj.is_string()) {
    if (!key.is_integral()) {
      if (key.is_string()) return get_attribute(obj, key.s);
      return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + to_str(key) + "'");
    }
    const std::int64_t n = length_of(obj);
    std::int64_t k = key.as_int();
    if (k < 0) k += n;
    if (k < 0 || k >= n) return Value::undefined("'" + type_name(obj) + " object' has no element " + std::to_string(key.as_int()));
    if (obj.is_string()) return Value::string(code_points(obj.s)[static_cast<std::size_t>(k)]);
    return (*obj.list)[static_cast<std::size_t>(k)];
  }
  return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + to_str(key) + "'");
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  if (obj.kind == Value::Kind::kUndefined) fail_undefined(obj);
  if (!obj.is_sequence() && !obj.is_string()) throw Failure("'" + type_name(obj) + "' object is not subscriptable");
  const auto given = [](const Value& v) { return v.defined() && v.kind != Value::Kind::kNone; };
  const std::int64_t n = length_of(obj);
  const std::int64_t step = given(step_v) ? need_int(step_v, "a slice step") : 1;
  if (step == 0) throw Failure("slice step cannot be zero");
  const auto clamp = [&](const Value& v, std::int64_t fallback) {
    if (!given(v)) return fallback;
    std::int64_t k = need_int(v, "a slice index");
    if (k < 0) k += n;
    if (step > 0) return std::clamp<std::int64_t>(k, 0, n);
    return std::clamp<std::int64_t>(k, -1, n - 1);
  };
  const std::int64_t start = clamp(start_v, step > 0 ? 0 : n - 1), stop = clamp(stop_v, step > 0 ? n : -1);
  std::vector<std::int64_t> picks;
  for (std::int64_t k = start; step > 0 ? k < stop : k > stop; k += step) picks.push_back(k);
  if (obj.is_string()) {
    const auto cps = code_points(obj.s);
    std::string out;
    for (auto k : picks) out += cps[static_cast<std::size_t>(k)];
    return Value::string(out);
  }
  List out;
  for (auto k : picks) out.push_back((*obj.list)[static_cast<std::size_t>(k)]);
  return Value::make_list(std::move(out), obj.kind == Value::Kind::kTuple);
}

// ---- arithmetic ------------------------------------------------------------------------------

Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  if (!a.defined()) fail_undefined(a);
  if (!b.defined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    const bool ints = a.is_integral() && b.is_integral();
    const std::int64_t x = a.as_int(), y = b.as_int();
    const double dx = a.as_double(), dy = b.as_double();
    std::int64_t r = 0;
    if (op == "+") return ints ? (__builtin_add_overflow(x, y, &r) ? throw Failure("integer overflow") : Value::integer(r)) : Value::real(dx + dy);
    if (op == "-") return ints ? (__builtin_sub_overflow(x, y, &r) ? throw Failure("integer overflow") : Value::integer(r)) : Value::real(dx - dy);
    if (op == "*") return ints ? (__builtin_mul_overflow(x, y, &r) ? throw Failure("integer overflow") : Value::integer(r)) : Value::real(dx * dy);
    if ((op == "/" || op == "//" || op == "%") && (ints ? y == 0 : dy == 0))
      throw Failure(op == "/" ? "division by zero" : ints ? "integer division or modulo by zero" : "float modulo");
    if (op == "/") return Value::real(dx / dy);
    if (op == "//") {
      if (!ints) return Value::real(std::floor(dx / dy));
      std::int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
      return Value::integer(q);
    }
    if (op == "%") {
      if (!ints) {
        double m = std::fmod(dx, dy);
        if (m != 0 && ((m < 0) != (dy < 0))) m += dy;
        return Value::real(m);
      }
      std::int64_t m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      return Value::integer(m);
    }
    if (op == "**") {
      if (ints && y >= 0) {
        std::int64_t result = 1;
        for (std::int64_t k = 0; k < y; ++k)
          if (__builtin_mul_overflow(result, x, &result)) throw Failure("integer overflow");
        return Value::integer(result);
      }
      return Value::real(std::pow(dx, dy));
    }
  }
  if (op == "+" && a.is_string() && b.is_string()) {
    if (a.s.size() + b.s.size() > kMaxValueBytes) throw Failure("a value of more than 64 MiB");
    return Value::string(a.s + b.s);
  }
  if (op == "+" && a.kind == b.kind && a.is_sequence()) {
    if (a.list->size() + b.list->size() > kMaxValueBytes / 8) throw Failure("a value of more than 64 MiB");
    List out = *a.list;
    out.insert(out.end(), b.list->begin(), b.list->end());
    return Value::make_list(std::move(out), a.kind == Value::Kind::kTuple);
  }
  if (op == "*" && ((a.is_string() || a.is_sequence()) && b.is_integral())) {
    const std::int64_t times = std::max<std::int64_t>(0, b.as_int());
    const std::size_t unit = a.is_string() ? a.s.size() : a.list->size();
    if (unit * static_cast<std::size_t>(times) > (std::size_t{64} << 20)) throw Failure("a repetition of more than 64 Mi items");
    if (a.is_string()) {
      std::string out;
      for (std::int64_t k = 0; k < times; ++k) out += a.s;
      return Value::string(out);
    }
    List out;
    for (std::int64_t k = 0; k < times; ++k) out.insert(out.end(), a.list->begin(), a.list->end());
    return Value::make_list(std::move(out), a.kind == Value::Kind::kTuple);
  }
  if (op == "*" && a.is_integral() && (b.is_string() || b.is_sequence())) return arithmetic(op, b, a);
  if (op == "+" && a.is_string()) throw Failure("can only concatenate str (not \"" + type_name(b) + "\") to str");
  throw Failure("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
}

// ---- expressions -----------------------------------------------------------------------------

struct Literal : Expr {
  Value value;
  Value eval(Interp&) const override { return value; }
};

struct Name : Expr {
  std::string name;
  Value eval(Interp& in) const override { return in.lookup(name); }
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Interp& in) const override {
    List out;
    for (const auto& e : items) out.push_back(e->eval(in));
    return Value::make_list(std::move(out), tuple);
  }
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Interp& in) const override {
    Dict d;
    for (const auto& [k, v] : items) {
      const Value key = k->eval(in);
      if (!key.is_string()) throw Failure("dictionary keys other than strings are not supported (got " + type_name(key) + ")");
      d.set(key.s, v->eval(in));
    }
    return Value::make_dict(std::move(d));
  }
};

struct Attribute : Expr {
  ExprPtr object;
  std::string attr;
  Value eval(Interp& in) const override {
    const Value obj = object->eval(in);
    in.line = line;
    return get_attribute(obj, attr);
  }
};

struct Item : Expr {
  ExprPtr object, key;
  Value eval(Interp& in) const override {
    const Value obj = object->eval(in);
    const Value k = key->eval(in);
    in.line = line;
    return get_item(obj, k);
  }
};

struct Slice : Expr {
  ExprPtr object, start, stop, step;
  Value eval(Interp& in) const override {
    const Value obj = object->eval(in);
    const auto opt = [&](const ExprPtr& e) { return e ? e->eval(in) : Value::none(); };
    const Value a = opt(start), b = opt(stop), c = opt(step);
    in.line = line;
    return slice(obj, a, b, c);
  }
};

struct Args {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> named;
  CallArgs eval(Interp& in) const {
    CallArgs a;
    for (const auto& e : positional) a.positional.push_back(e->eval(in));
    for (const auto& [k, e] : named) a.named.emplace_back(k, e->eval(in));
    return a;
  }
};

struct Call : Expr {
  ExprPtr callee;
  Args args;
  Value eval(Interp& in) const override {
    const Value f = callee->eval(in);
    CallArgs a = args.eval(in);
    in.line = line;
    if (f.kind == Value::Kind::kUndefined) fail_undefined(f);
    if (f.kind != Value::Kind::kCallable) throw Failure("'" + type_name(f) + "' object is not callable");
    in.step();
    return bounded(f.fn->fn(a, in));
  }
};

Value apply_filter(const std::string& name, const Value& input, CallArgs& args, Interp& in);
bool run_test(const std::string& name, const Value& v, const std::vector<Value>& args, Interp& in);

struct FilterExpr : Expr {
  ExprPtr input;
  FilterCall filter;
  Value eval(Interp& in) const override {
    const Value v = input->eval(in);
    CallArgs a;
    for (const auto& e : filter.args) a.positional.push_back(e->eval(in));
    for (const auto& [k, e] : filter.kwargs) a.named.emplace_back(k, e->eval(in));
    in.line = line;
    return bounded(apply_filter(filter.name, v, a, in));
  }
};

struct TestExpr : Expr {
  ExprPtr input;
  std::string test;
  std::vector<ExprPtr> args;
  bool negated = false;
  Value eval(Interp& in) const override {
    const Value v = input->eval(in);
    std::vector<Value> a;
    for (const auto& e : args) a.push_back(e->eval(in));
    in.line = line;
    return Value::boolean(run_test(test, v, a, in) != negated);
  }
};

struct Unary : Expr {
  std::string op;
  ExprPtr operand;
  Value eval(Interp& in) const override {
    const Value v = operand->eval(in);
    if (op == "not") return Value::boolean(!truthy(v));
    in.line = line;
    if (!v.defined()) fail_undefined(v);
    if (!v.is_number()) throw Failure("bad operand type for unary " + op + ": '" + type_name(v) + "'");
    if (op == "+") return v.kind == Value::Kind::kFloat ? v : Value::integer(v.as_int());
    return v.kind == Value::Kind::kFloat ? Value::real(-v.f) : Value::integer(-v.as_int());
  }
};

struct Binary : Expr {
  std::string op;
  ExprPtr left, right;
  Value eval(Interp& in) const override {
    if (op == "and") {
      Value a = left->eval(in);
      return truthy(a) ? right->eval(in) : a;
    }
    if (op == "or") {
      Value a = left->eval(in);
      return truthy(a) ? a : right->eval(in);
    }
    const Value a = left->eval(in), b = right->eval(in);
    in.line = line;
    if (op == "~") return bounded(Value::string(to_str(a) + to_str(b)));
    return arithmetic(op, a, b);
  }
};

struct Compare : Expr {
  ExprPtr first;
  std::vector<std::pair<std::string, ExprPtr>> rest;  // a < b <= c, Python's chain
  Value eval(Interp& in) const override {
    Value a = first->eval(in);
    for (const auto& [op, e] : rest) {
      const Value b = e->eval(in);
      in.line = line;
      bool ok = false;
      if (op == "==") ok = equals(a, b);
      else if (op == "!=") ok = !equals(a, b);
      else if (op == "in") ok = contains(b, a);
      else if (op == "notin") ok = !contains(b, a);
      else {
        if (!a.defined()) fail_undefined(a);
        if (!b.defined()) fail_undefined(b);
        const int c = compare(a, b, op.c_str());
        ok = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
      }
      if (!ok) return Value::boolean(false);
      a = b;
    }
    return Value::boolean(true);
  }
};

struct Conditional : Expr {
  ExprPtr test, then, otherwise;
  Value eval(Interp& in) const override {
    if (truthy(test->eval(in))) return then->eval(in);
    return otherwise ? otherwise->eval(in) : Value::undefined("the conditional expression has no else");
  }
};

// ---- statements ------------------------------------------------------------------------------

struct Output : Stmt {
  std::string text;
  void exec(Interp& in) const override { in.write(text); }
};

struct Print : Stmt {
  ExprPtr value;
  void exec(Interp& in) const override { in.write(to_str(value->eval(in))); }
};

struct If : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body otherwise;
  void exec(Interp& in) const override {
    for (const auto& [test, body] : branches)
      if (truthy(test->eval(in))) {
        in.exec(body);
        return;
      }
    in.exec(otherwise);
  }
};

// Assignment targets: a name, a namespace's attribute, or names to unpack a sequence into.
struct Target {
  std::vector<std::string> names;  // several: unpack
  std::string attribute;           // set ns.attr
  bool tuple = false;
};

void assign(Interp& in, const Target& target, const Value& v) {
  if (!target.attribute.empty()) {
    const Value ns = in.lookup(target.names[0]);
    if (ns.kind != Value::Kind::kNamespace) throw Failure("can only set attributes of a namespace, and '" + target.names[0] + "' is not one");
    ns.dict->set(target.attribute, v);
    return;
  }
  if (!target.tuple) {
    (*in.scopes.back())[target.names[0]] = v;
    return;
  }
  const List items = iterate(v);
  if (items.size() != target.names.size())
    throw Failure("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(target.names.size()) + " names");
  for (std::size_t k = 0; k < items.size(); ++k) (*in.scopes.back())[target.names[k]] = items[k];
}

struct For : Stmt {
  Target target;
  ExprPtr iterable, condition;
  Body body, otherwise;
  void exec(Interp& in) const override {
    const Value source = iterable->eval(in);
    in.line = line;
    List items = iterate(source);
    Scope scope;
    in.scopes.push_back(&scope);
    struct Pop {
      Interp& in;
      ~Pop() { in.scopes.pop_back(); }
    } pop{in};
    if (condition) {
      List kept;
      for (const auto& item : items) {
        scope.clear();
        assign(in, target, item);
        if (truthy(condition->eval(in))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const auto n = static_cast<std::int64_t>(items.size());
    // One `loop` object, its values updated in place each iteration.
    auto at = std::make_shared<std::int64_t>(0);
    Value loop = Value::make_dict(Dict{});
    for (const char* key : {"index", "index0", "revindex", "revindex0", "first", "last", "length", "depth", "depth0", "previtem", "nextitem"})
      loop.dict->items.emplace_back(key, Value());
    loop.dict->items.emplace_back("cycle", Value::function("cycle", [at](CallArgs& a, Interp&) {
      if (a.positional.empty()) throw Failure("no items for cycling given");
      return a.positional[static_cast<std::size_t>(*at) % a.positional.size()];
    }));
    auto& v = loop.dict->items;
    for (std::int64_t k = 0; k < n; ++k) {
      in.step();
      scope.clear();
      *at = k;
      v[0].second = Value::integer(k + 1);
      v[1].second = Value::integer(k);
      v[2].second = Value::integer(n - k);
      v[3].second = Value::integer(n - k - 1);
      v[4].second = Value::boolean(k == 0);
      v[5].second = Value::boolean(k == n - 1);
      v[6].second = Value::integer(n);
      v[7].second = Value::integer(1);
      v[8].second = Value::integer(0);
      v[9].second = k > 0 ? items[static_cast<std::size_t>(k - 1)] : Value::undefined("there is no previous item");
      v[10].second = k + 1 < n ? items[static_cast<std::size_t>(k + 1)] : Value::undefined("there is no next item");
      scope["loop"] = loop;
      assign(in, target, items[static_cast<std::size_t>(k)]);
      in.exec(body);
      if (in.flow == Interp::Flow::kBreak) {
        in.flow = Interp::Flow::kNormal;
        break;
      }
      in.flow = Interp::Flow::kNormal;
    }
    if (n == 0) {
      scope.clear();
      in.exec(otherwise);
    }
  }
};

struct LoopControl : Stmt {
  bool is_break = false;
  void exec(Interp& in) const override { in.flow = is_break ? Interp::Flow::kBreak : Interp::Flow::kContinue; }
};

Value apply_filters(const std::vector<FilterCall>& filters, Value v, Interp& in) {
  for (const auto& f : filters) {
    CallArgs a;
    for (const auto& e : f.args) a.positional.push_back(e->eval(in));
    for (const auto& [k, e] : f.kwargs) a.named.emplace_back(k, e->eval(in));
    in.line = f.line;
    v = apply_filter(f.name, v, a, in);
  }
  return v;
}

struct Set : Stmt {
  Target target;
  ExprPtr value;
  void exec(Interp& in) const override {
    const Value v = value->eval(in);
    in.line = line;
    assign(in, target, v);
  }
};

struct SetBlock : Stmt {
  Target target;
  Body body;
  std::vector<FilterCall> filters;
  void exec(Interp& in) const override {
    const Value v = apply_filters(filters, Value::string(in.capture(body)), in);
    assign(in, target, v);
  }
};

struct FilterBlock : Stmt {
  std::vector<FilterCall> filters;
  Body body;
  void exec(Interp& in) const override { in.write(to_str(apply_filters(filters, Value::string(in.capture(body)), in))); }
};

struct Generation : Stmt {
  Body body;
  void exec(Interp& in) const override {
    const bool tracked = in.out == in.main_out;
    const std::size_t begin = in.out->size();
    in.exec(body);
    if (tracked && in.out->size() > begin) in.spans.emplace_back(begin, in.out->size());
  }
};

struct Macro : Stmt {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // per param, null where none
  Body body;
  void exec(Interp& in) const override {
    const Macro* self = this;
    (*in.scopes.back())[name] = Value::function(name, [self](CallArgs& a, Interp& in) {
      if (a.positional.size() > self->params.size())
        throw Failure("macro '" + self->name + "' takes not more than " + std::to_string(self->params.size()) + " argument(s)");
      if (++in.depth > 64) throw Failure("macros nested more than 64 deep");
      Scope args;
      std::vector<Scope*> saved = in.scopes;
      in.scopes.resize(2);  // the globals and the template's top level: a macro sees no caller's locals
      in.scopes.push_back(&args);
      try {
        for (std::size_t k = 0; k < self->params.size(); ++k) {
          const std::string& p = self->params[k];
          if (k < a.positional.size())
            args[p] = a.positional[k];
          else if (const Value* v = named_arg(a, p.c_str()))
            args[p] = *v;
          else
            args[p] = self->defaults[k] ? self->defaults[k]->eval(in) : Value::undefined("'" + p + "' is undefined");
        }
        for (const auto& [k, v] : a.named)
          if (std::find(self->params.begin(), self->params.end(), k) == self->params.end())
            throw Failure("macro '" + self->name + "' takes no keyword argument '" + k + "'");
        std::string text = in.capture(self->body);
        in.flow = Interp::Flow::kNormal;
        in.scopes = saved;
        --in.depth;
        return Value::string(std::move(text));
      } catch (...) {
        in.scopes = saved;
        --in.depth;
        throw;
      }
    });
  }
};

// ---------------------------------------------------------------------------------------------
// Parsing.

const std::set<std::string>& filter_names() {
  static const std::set<std::string> names{"abs",   "capitalize", "count",  "d",       "default", "dictsort", "e",      "escape",     "first",
                                           "float", "indent",     "int",    "items",   "join",    "last",     "length", "list",       "lower",
                                           "map",   "max",        "min",    "reject",  "rejectattr", "replace", "reverse", "round",   "safe",
                                           "select", "selectattr", "sort",  "string",  "sum",     "title",    "tojson", "trim",       "unique",
                                           "upper", "wordcount"};
  return names;
}

const std::set<std::string>& test_names() {
  static const std::set<std::string> names{"boolean", "callable", "defined", "divisibleby", "eq",     "equalto", "escaped", "even",     "false",
                                           "float",   "ge",       "gt",      "in",          "integer", "iterable", "le",     "lower",    "lt",
                                           "mapping", "ne",       "none",    "number",      "odd",     "sameas",  "sequence", "string", "true",
                                           "undefined", "upper",  "==",      "!=",          "<",       "<=",      ">",       ">="};
  return names;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Body parse_template() {
    std::string end;
    Body body = parse_body({}, end);
    return body;
  }

  bool saw_generation = false;

 private:
  const Token& peek(std::size_t ahead = 0) const { return t_[std::min(k_ + ahead, t_.size() - 1)]; }
  Token next() { return t_[std::min(k_++, t_.size() - 1)]; }
  bool is_op(const char* op, std::size_t ahead = 0) const { return peek(ahead).type == Token::kOp && peek(ahead).text == op; }
  bool is_name(const char* name, std::size_t ahead = 0) const { return peek(ahead).type == Token::kName && peek(ahead).text == name; }
  bool accept_op(const char* op) {
    if (!is_op(op)) return false;
    ++k_;
    return true;
  }
  bool accept_name(const char* name) {
    if (!is_name(name)) return false;
    ++k_;
    return true;
  }
  [[noreturn]] void fail(const std::string& what) const { throw SyntaxError(peek().line, what); }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Token::kEnd: return "the end of the template";
      case Token::kBlockEnd: return "the end of the tag (%})";
      case Token::kVarEnd: return "the end of the print tag (}})";
      case Token::kString: return "a string";
      case Token::kInt:
      case Token::kFloat: return "the number " + t.text;
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(std::string("expected '") + op + "', found " + describe(peek()));
  }
  std::string expect_name() {
    if (peek().type != Token::kName) fail("expected a name, found " + describe(peek()));
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Token::kBlockEnd) fail("expected the end of the tag (%}), found " + describe(peek()));
    ++k_;
  }

  template <class T>
  std::unique_ptr<T> node(int line) {
    auto n = std::make_unique<T>();
    n->line = line;
    return n;
  }

  Body parse_body(const std::vector<std::string>& ends, std::string& found) {
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.type == Token::kEnd) {
        if (!ends.empty()) fail("the template ends before {% " + ends.back() + " %}");
        return body;
      }
      if (t.type == Token::kText) {
        auto out = node<Output>(t.line);
        out->text = next().text;
        body.push_back(std::move(out));
        continue;
      }
      if (t.type == Token::kVarBegin) {
        ++k_;
        auto print = node<Print>(t.line);
        print->value = parse_tuple(true);
        if (peek().type != Token::kVarEnd) fail("expected the end of the print tag (}}), found " + describe(peek()));
        ++k_;
        body.push_back(std::move(print));
        continue;
      }
      if (t.type != Token::kBlockBegin) fail("unexpected " + describe(t));
      ++k_;
      const int line = peek().line;
      const std::string keyword = expect_name();
      if (std::find(ends.begin(), ends.end(), keyword) != ends.end()) {
        found = keyword;
        return body;
      }
      body.push_back(parse_statement(keyword, line));
    }
  }

  StmtPtr parse_statement(const std::string& keyword, int line) {
    if (keyword == "if") return parse_if(line);
    if (keyword == "for") return parse_for(line);
    if (keyword == "set") return parse_set(line);
    if (keyword == "macro") return parse_macro(line);
    if (keyword == "filter") {
      auto f = node<FilterBlock>(line);
      f->filters = parse_filter_chain(false);
      expect_block_end();
      std::string end;
      f->body = parse_body({"endfilter"}, end);
      expect_block_end();
      return f;
    }
    if (keyword == "break" || keyword == "continue") {
      if (loops_ == 0) throw SyntaxError(line, "{% " + keyword + " %} outside a for loop");
      auto c = node<LoopControl>(line);
      c->is_break = keyword == "break";
      expect_block_end();
      return c;
    }
    if (keyword == "generation") {
      saw_generation = true;
      auto g = node<Generation>(line);
      expect_block_end();
      std::string end;
      g->body = parse_body({"endgeneration"}, end);
      expect_block_end();
      return g;
    }
    static const std::set<std::string> unsupported{"include", "import", "from", "extends", "block", "call", "with", "autoescape", "do", "trans"};
    if (unsupported.count(keyword)) throw SyntaxError(line, "{% " + keyword + " %} is not supported in chat templates");
    throw SyntaxError(line, "unknown tag '" + keyword + "'" +
                                (keyword.rfind("end", 0) == 0 || keyword == "else" || keyword == "elif" ? " here (no open block it could close)" : ""));
  }

  StmtPtr parse_if(int line) {
    auto s = node<If>(line);
    ExprPtr test = parse_expression(true);
    expect_block_end();
    while (true) {
      std::string end;
      Body body = parse_body({"elif", "else", "endif"}, end);
      s->branches.emplace_back(std::move(test), std::move(body));
      if (end == "elif") {
        test = parse_expression(true);
        expect_block_end();
        continue;
      }
      expect_block_end();
      if (end == "else") {
        s->otherwise = parse_body({"endif"}, end);
        expect_block_end();
      }
      return s;
    }
  }

  Target parse_target(bool allow_attribute) {
    Target target;
    const bool parens = accept_op("(");
    target.names.push_back(expect_name());
    if (allow_attribute && !parens && accept_op(".")) {
      target.attribute = expect_name();
      return target;
    }
    while (accept_op(",")) {
      target.tuple = true;
      if (peek().type != Token::kName) break;
      target.names.push_back(expect_name());
    }
    if (parens) {
      target.tuple = true;
      expect_op(")");
    }
    return target;
  }

  StmtPtr parse_for(int line) {
    auto s = node<For>(line);
    s->target = parse_target(false);
    if (!accept_name("in")) fail("expected 'in' in the for tag, found " + describe(peek()));
    s->iterable = parse_tuple(false);
    if (accept_name("if")) s->condition = parse_expression(true);
    if (is_name("recursive")) fail("recursive for loops are not supported");
    expect_block_end();
    ++loops_;
    std::string end;
    s->body = parse_body({"else", "endfor"}, end);
    --loops_;
    expect_block_end();
    if (end == "else") {
      s->otherwise = parse_body({"endfor"}, end);
      expect_block_end();
    }
    return s;
  }

  StmtPtr parse_set(int line) {
    Target target = parse_target(true);
    if (accept_op("=")) {
      auto s = node<Set>(line);
      s->target = std::move(target);
      s->value = parse_tuple(true);
      expect_block_end();
      return s;
    }
    auto s = node<SetBlock>(line);
    s->target = std::move(target);
    if (is_op("|")) s->filters = parse_filter_chain(true);
    expect_block_end();
    std::string end;
    s->body = parse_body({"endset"}, end);
    expect_block_end();
    return s;
  }

  StmtPtr parse_macro(int line) {
    auto s = node<Macro>(line);
    s->name = expect_name();
    expect_op("(");
    while (!accept_op(")")) {
      if (!s->params.empty()) expect_op(",");
      if (accept_op(")")) break;
      s->params.push_back(expect_name());
      s->defaults.push_back(accept_op("=") ? parse_expression(true) : nullptr);
    }
    expect_block_end();
    std::string end;
    const int saved_loops = loops_;
    loops_ = 0;
    s->body = parse_body({"endmacro"}, end);
    loops_ = saved_loops;
    if (peek().type == Token::kName) ++k_;  // {% endmacro name %}
    expect_block_end();
    return s;
  }

  // `| f(args) | g` after a set target or a filter tag (leading_bar: the first has its `|`).
  std::vector<FilterCall> parse_filter_chain(bool leading_bar) {
    std::vector<FilterCall> chain;
    bool first = true;
    while ((first && !leading_bar) || accept_op("|")) {
      first = false;
      chain.push_back(parse_filter_call());
    }
    return chain;
  }

  FilterCall parse_filter_call() {
    FilterCall f;
    f.line = peek().line;
    f.name = expect_name();
    if (!filter_names().count(f.name)) throw SyntaxError(f.line, "no filter named '" + f.name + "' (not supported in chat templates)");
    if (accept_op("(")) {
      Args a = parse_call_args();
      f.args = std::move(a.positional);
      f.kwargs = std::move(a.named);
    }
    return f;
  }

  // ---- expressions ----

  struct DepthGuard {
    int& depth;
    explicit DepthGuard(int& d, int line) : depth(d) {
      if (++depth > 200) throw SyntaxError(line, "expressions nested more than 200 deep");
    }
    ~DepthGuard() { --depth; }
  };

  ExprPtr parse_tuple(bool with_condexpr) {
    const int line = peek().line;
    ExprPtr first = parse_expression(with_condexpr);
    if (!is_op(",")) return first;
    auto t = node<ListExpr>(line);
    t->tuple = true;
    t->items.push_back(std::move(first));
    while (accept_op(",")) {
      if (peek().type == Token::kBlockEnd || peek().type == Token::kVarEnd || is_op(")")) break;
      t->items.push_back(parse_expression(with_condexpr));
    }
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(depth_, peek().line);
    if (!with_condexpr) return parse_or();
    ExprPtr e = parse_or();
    while (is_name("if")) {
      const int line = next().line;
      auto c = node<Conditional>(line);
      c->then = std::move(e);
      c->test = parse_or();
      if (accept_name("else")) c->otherwise = parse_expression(true);
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(const std::string& op, ExprPtr left, ExprPtr right, int line) {
    auto b = node<Binary>(line);
    b->op = op;
    b->left = std::move(left);
    b->right = std::move(right);
    return b;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      const int line = next().line;
      e = binary("or", std::move(e), parse_and(), line);
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      const int line = next().line;
      e = binary("and", std::move(e), parse_not(), line);
    }
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(depth_, peek().line);
      auto u = node<Unary>(next().line);
      u->op = "not";
      u->operand = parse_not();
      return u;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = peek().line;
    ExprPtr e = parse_math1();
    std::unique_ptr<Compare> c;
    while (true) {
      std::string op;
      if (peek().type == Token::kOp && (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == "<=" || peek().text == ">" ||
                                        peek().text == ">="))
        op = next().text;
      else if (accept_name("in"))
        op = "in";
      else if (is_name("not") && is_name("in", 1)) {
        k_ += 2;
        op = "notin";
      } else
        break;
      if (!c) {
        c = node<Compare>(line);
        c->first = std::move(e);
      }
      c->rest.emplace_back(op, parse_math1());
    }
    if (c) return c;
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token op = next();
      e = binary(op.text, std::move(e), parse_concat(), op.line);
    }
    return e;
  }

  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      const int line = next().line;
      e = binary("~", std::move(e), parse_math2(), line);
    }
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token op = next();
      e = binary(op.text, std::move(e), parse_pow(), op.line);
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      const int line = next().line;
      e = binary("**", std::move(e), parse_unary(true), line);
    }
    return e;
  }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      DepthGuard guard(depth_, peek().line);
      auto u = node<Unary>(peek().line);
      u->op = next().text;
      u->operand = parse_unary(false);
      e = std::move(u);
    } else
      e = parse_primary();
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token t = peek();
    switch (t.type) {
      case Token::kName: {
        ++k_;
        auto lit = node<Literal>(t.line);
        if (t.text == "true" || t.text == "True") lit->value = Value::boolean(true);
        else if (t.text == "false" || t.text == "False") lit->value = Value::boolean(false);
        else if (t.text == "none" || t.text == "None") lit->value = Value::none();
        else {
          auto n = node<Name>(t.line);
          n->name = t.text;
          return n;
        }
        return lit;
      }
      case Token::kString: {
        std::string text;
        while (peek().type == Token::kString) text += next().text;  // adjacent literals join
        auto lit = node<Literal>(t.line);
        lit->value = Value::string(std::move(text));
        return lit;
      }
      case Token::kInt:
      case Token::kFloat: {
        ++k_;
        auto lit = node<Literal>(t.line);
        lit->value = t.type == Token::kInt ? Value::integer(t.i) : Value::real(t.f);
        return lit;
      }
      case Token::kOp:
        if (t.text == "(") {
          ++k_;
          DepthGuard guard(depth_, t.line);
          if (accept_op(")")) {
            auto empty = node<ListExpr>(t.line);
            empty->tuple = true;
            return empty;
          }
          ExprPtr first = parse_expression(true);
          if (accept_op(")")) return first;
          auto tuple = node<ListExpr>(t.line);
          tuple->tuple = true;
          tuple->items.push_back(std::move(first));
          while (accept_op(",")) {
            if (is_op(")")) break;
            tuple->items.push_back(parse_expression(true));
          }
          expect_op(")");
          return tuple;
        }
        if (t.text == "[") {
          ++k_;
          DepthGuard guard(depth_, t.line);
          auto list = node<ListExpr>(t.line);
          while (!accept_op("]")) {
            if (!list->items.empty()) expect_op(",");
            if (accept_op("]")) break;
            list->items.push_back(parse_expression(true));
          }
          return list;
        }
        if (t.text == "{") {
          ++k_;
          DepthGuard guard(depth_, t.line);
          auto dict = node<DictExpr>(t.line);
          while (!accept_op("}")) {
            if (!dict->items.empty()) expect_op(",");
            if (accept_op("}")) break;
            ExprPtr key = parse_expression(true);
            expect_op(":");
            dict->items.emplace_back(std::move(key), parse_expression(true));
          }
          return dict;
        }
        break;
      default: break;
    }
    fail("unexpected " + describe(t));
  }

  Args parse_call_args() {  // after '('
    Args a;
    while (!accept_op(")")) {
      if (!a.positional.empty() || !a.named.empty()) expect_op(",");
      if (accept_op(")")) break;
      if (is_op("*") || is_op("**")) fail("*args and **kwargs in calls are not supported");
      if (peek().type == Token::kName && is_op("=", 1)) {
        std::string key = next().text;
        ++k_;
        a.named.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!a.named.empty()) fail("a positional argument after a keyword argument");
        a.positional.push_back(parse_expression(true));
      }
    }
    return a;
  }

  ExprPtr parse_subscript(ExprPtr e) {
    const Token t = next();
    if (t.text == ".") {
      const Token attr = next();
      if (attr.type == Token::kInt) {
        auto item = node<Item>(attr.line);
        item->object = std::move(e);
        auto lit = node<Literal>(attr.line);
        lit->value = Value::integer(attr.i);
        item->key = std::move(lit);
        return item;
      }
      if (attr.type != Token::kName) throw SyntaxError(attr.line, "expected a name after '.', found " + describe(attr));
      auto a = node<Attribute>(attr.line);
      a->object = std::move(e);
      a->attr = attr.text;
      return a;
    }
    // '[': an index or a slice
    DepthGuard guard(depth_, t.line);
    ExprPtr parts[3];
    int part = 0;
    bool is_slice = false;
    while (!is_op("]")) {
      if (accept_op(":")) {
        is_slice = true;
        if (++part > 2) fail("a slice has at most three parts");
        continue;
      }
      if (parts[part]) fail("expected ':' or ']' in a subscript, found " + describe(peek()));
      parts[part] = parse_expression(true);
    }
    expect_op("]");
    if (!is_slice) {
      if (!parts[0]) throw SyntaxError(t.line, "an empty subscript []");
      auto item = node<Item>(t.line);
      item->object = std::move(e);
      item->key = std::move(parts[0]);
      return item;
    }
    auto s = node<Slice>(t.line);
    s->object = std::move(e);
    s->start = std::move(parts[0]);
    s->stop = std::move(parts[1]);
    s->step = std::move(parts[2]);
    return s;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".") || is_op("["))
        e = parse_subscript(std::move(e));
      else if (is_op("(")) {
        auto c = node<Call>(next().line);
        c->callee = std::move(e);
        c->args = parse_call_args();
        e = std::move(c);
      } else
        return e;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        const int line = next().line;
        auto f = node<FilterExpr>(line);
        f->input = std::move(e);
        f->filter = parse_filter_call();
        e = std::move(f);
      } else if (is_name("is")) {
        const int line = next().line;
        auto t = node<TestExpr>(line);
        t->input = std::move(e);
        t->negated = accept_name("not");
        const Token name = next();
        if (name.type == Token::kName || (name.type == Token::kOp && test_names().count(name.text)))
          t->test = name.text;
        else
          throw SyntaxError(name.line, "expected a test name after 'is', found " + describe(name));
        if (!test_names().count(t->test)) throw SyntaxError(name.line, "no test named '" + t->test + "' (not supported in chat templates)");
        if (is_op("(")) {
          ++k_;
          Args a = parse_call_args();
          if (!a.named.empty()) fail("tests take no keyword arguments here");
          t->args = std::move(a.positional);
        } else if ((peek().type == Token::kName || peek().type == Token::kString || peek().type == Token::kInt || peek().type == Token::kFloat ||
                    is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") && !is_name("is")) {
          t->args.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op(".") || is_op("[") || is_op("(")) {
        e = parse_postfix(std::move(e));
      } else
        return e;
    }
  }

  std::vector<Token> t_;
  std::size_t k_ = 0;
  int loops_ = 0;
  int depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Filters and tests.

// Looks up "a.b.0" in a value, as Jinja's attribute= arguments do.
Value attribute_path(const Value& v, const std::string& path) {
  Value cur = v;
  std::size_t pos = 0;
  while (pos <= path.size()) {
    const std::size_t dot = path.find('.', pos);
    const std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (!part.empty() && part.find_first_not_of("0123456789") == std::string::npos && cur.is_sequence())
      cur = get_item(cur, Value::integer(std::stoll(part)));
    else
      cur = get_item(cur, Value::string(part));
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

Value select_items(const Value& input, CallArgs& a, Interp& in, bool by_attribute, bool keep) {
  List out;
  std::size_t first_test_arg = by_attribute ? 1 : 0;
  const std::string attr = by_attribute ? need_string(arg(a, 0, "attribute"), "selectattr") : "";
  const bool has_test = a.positional.size() > first_test_arg;
  const std::string test = has_test ? need_string(a.positional[first_test_arg], "the test name") : "";
  if (has_test && !test_names().count(test)) throw Failure("no test named '" + test + "'");
  std::vector<Value> test_args(a.positional.begin() + static_cast<long>(std::min(a.positional.size(), first_test_arg + 1)), a.positional.end());
  for (const auto& item : iterate(input)) {
    const Value subject = by_attribute ? attribute_path(item, attr) : item;
    const bool pass = has_test ? run_test(test, subject, test_args, in) : truthy(subject);
    if (pass == keep) out.push_back(item);
  }
  return Value::make_list(std::move(out));
}

Value sort_items(const Value& input, CallArgs& a) {
  List items = iterate(input);
  const bool reverse = truthy(arg(a, 0, "reverse", Value::boolean(false)));
  const bool case_sensitive = truthy(arg(a, 1, "case_sensitive", Value::boolean(false)));
  const Value attribute = arg(a, 2, "attribute");
  const auto key = [&](const Value& v) {
    Value k = attribute.defined() && attribute.kind != Value::Kind::kNone ? attribute_path(v, to_str(attribute)) : v;
    if (!case_sensitive && k.is_string()) k = Value::string(ascii_map(k.s, [](int c) { return std::tolower(c); }));
    return k;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    const int c = compare(key(x), key(y), "<");
    return reverse ? c > 0 : c < 0;
  });
  return Value::make_list(std::move(items));
}

Value apply_filter(const std::string& name, const Value& input, CallArgs& a, Interp& in) {
  if (name == "length" || name == "count") return Value::integer(length_of(input));
  if (name == "string") return Value::string(to_str(input));
  if (name == "safe") return input;
  if (name == "trim") return Value::string(strip_chars(to_str(input), arg(a, 0, "chars"), true, true));
  if (name == "upper") return Value::string(ascii_map(to_str(input), [](int c) { return std::toupper(c); }));
  if (name == "lower") return Value::string(ascii_map(to_str(input), [](int c) { return std::tolower(c); }));
  if (name == "title") return Value::string(title_case(to_str(input)));
  if (name == "capitalize") return Value::string(capitalize(to_str(input)));
  if (name == "e" || name == "escape") return Value::string(html_escape(to_str(input)));
  if (name == "replace") {
    const Value count = arg(a, 2, "count", Value::integer(-1));
    const std::int64_t n = count.kind == Value::Kind::kNone ? -1 : need_int(count, "replace");
    return Value::string(replace_all(to_str(input), to_str(arg(a, 0, "old")), to_str(arg(a, 1, "new")), n));
  }
  if (name == "default" || name == "d") {
    const bool boolean = truthy(arg(a, 1, "boolean", Value::boolean(false)));
    if (!input.defined() || (boolean && !truthy(input))) return arg(a, 0, "default_value", Value::string(""));
    return input;
  }
  if (name == "tojson") {
    const Value indent = arg(a, 0, "indent", Value::none());
    const bool sort_keys = truthy(arg(a, 3, "sort_keys", Value::boolean(false)));
    const int width = indent.kind == Value::Kind::kNone ? -1 : static_cast<int>(need_int(indent, "tojson's indent"));
    std::string item_sep = width >= 0 ? "," : ", ", key_sep = ": ";
    const Value separators = arg(a, 2, "separators", Value::none());
    if (separators.is_sequence() && separators.list->size() == 2) {
      item_sep = need_string((*separators.list)[0], "tojson's separators");
      key_sep = need_string((*separators.list)[1], "tojson's separators");
    }
    if (!input.defined()) throw Failure("Object of type Undefined is not JSON serializable");
    return Value::string(to_json(input, width, sort_keys, item_sep, key_sep));
  }
  if (name == "list") return Value::make_list(iterate(input));
  if (name == "first" || name == "last") {
    const List items = iterate(input);
    if (items.empty()) return Value::undefined("No " + name + " item, sequence was empty.");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    if (input.is_string()) {
      auto cps = code_points(input.s);
      std::string out;
      for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
      return Value::string(out);
    }
    List items = iterate(input);
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  if (name == "join") {
    const std::string sep = to_str(arg(a, 0, "d", Value::string("")));
    const Value attribute = arg(a, 1, "attribute");
    std::string out;
    const List items = iterate(input);
    for (std::size_t k = 0; k < items.size(); ++k) out += (k ? sep : "") + to_str(attribute.defined() ? attribute_path(items[k], to_str(attribute)) : items[k]);
    return Value::string(out);
  }
  if (name == "selectattr" || name == "rejectattr") return select_items(input, a, in, true, name == "selectattr");
  if (name == "select" || name == "reject") return select_items(input, a, in, false, name == "select");
  if (name == "map") {
    List out;
    if (const Value* attribute = named_arg(a, "attribute")) {
      const Value* fallback = named_arg(a, "default");
      for (const auto& item : iterate(input)) {
        Value v = attribute_path(item, to_str(*attribute));
        out.push_back(!v.defined() && fallback ? *fallback : v);
      }
      return Value::make_list(std::move(out));
    }
    if (a.positional.empty()) throw Failure("map needs a filter name or attribute=");
    const std::string filter = need_string(a.positional[0], "map");
    if (!filter_names().count(filter)) throw Failure("no filter named '" + filter + "'");
    CallArgs rest;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    rest.named = a.named;
    for (const auto& item : iterate(input)) out.push_back(apply_filter(filter, item, rest, in));
    return Value::make_list(std::move(out));
  }
  if (name == "items") {
    if (!input.defined()) return Value::make_list({});
    if (input.kind != Value::Kind::kDict) throw Failure("items needs a mapping, not " + type_name(input));
    CallArgs none;
    return dict_method(input.dict, "items", none);
  }
  if (name == "dictsort") {
    if (input.kind != Value::Kind::kDict) throw Failure("dictsort needs a mapping, not " + type_name(input));
    CallArgs none;
    Value items = dict_method(input.dict, "items", none);
    CallArgs sort;
    return sort_items(items, sort);
  }
  if (name == "sort") return sort_items(input, a);
  if (name == "unique") {
    List out;
    for (const auto& item : iterate(input))
      if (std::none_of(out.begin(), out.end(), [&](const Value& x) { return equals(x, item); })) out.push_back(item);
    return Value::make_list(std::move(out));
  }
  if (name == "sum") {
    Value total = arg(a, 1, "start", Value::integer(0));
    const Value attribute = arg(a, 0, "attribute");
    for (const auto& item : iterate(input)) total = arithmetic("+", total, attribute.defined() ? attribute_path(item, to_str(attribute)) : item);
    return total;
  }
  if (name == "min" || name == "max") {
    const List items = iterate(input);
    if (items.empty()) return Value::undefined("No " + name + " item, sequence was empty.");
    Value best = items.front();
    for (const auto& item : items) {
      const int c = compare(item, best, "<");
      if (name == "min" ? c < 0 : c > 0) best = item;
    }
    return best;
  }
  if (name == "abs") {
    if (input.kind == Value::Kind::kFloat) return Value::real(std::fabs(input.f));
    return Value::integer(std::llabs(need_int(input, "abs")));
  }
  if (name == "int") {
    const Value fallback = arg(a, 0, "default", Value::integer(0));
    if (input.kind == Value::Kind::kFloat) return std::isfinite(input.f) ? Value::integer(static_cast<std::int64_t>(input.f)) : fallback;
    if (input.is_integral()) return Value::integer(input.as_int());
    if (input.is_string()) {
      const std::string s = strip_chars(input.s, Value::none(), true, true);
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(s.c_str(), &end, 10);
      if (!s.empty() && end && *end == '\0' && errno == 0) return Value::integer(v);
      const double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end && *end == '\0' && std::isfinite(d)) return Value::integer(static_cast<std::int64_t>(d));
    }
    return fallback;
  }
  if (name == "float") {
    const Value fallback = arg(a, 0, "default", Value::real(0.0));
    if (input.is_number()) return Value::real(input.as_double());
    if (input.is_string()) {
      char* end = nullptr;
      const std::string s = strip_chars(input.s, Value::none(), true, true);
      const double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end && *end == '\0') return Value::real(d);
    }
    return fallback;
  }
  if (name == "round") {
    const std::int64_t precision = need_int(arg(a, 0, "precision", Value::integer(0)), "round");
    const std::string method = to_str(arg(a, 1, "method", Value::string("common")));
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = input.as_double() * scale;
    const double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::round(x);
    return Value::real(r / scale);
  }
  if (name == "indent") {
    const Value width_v = arg(a, 0, "width", Value::integer(4));
    const std::string pad = width_v.is_string() ? width_v.s : std::string(static_cast<std::size_t>(std::max<std::int64_t>(0, need_int(width_v, "indent"))), ' ');
    const bool first = truthy(arg(a, 1, "first", Value::boolean(false)));
    const bool blank = truthy(arg(a, 2, "blank", Value::boolean(false)));
    const std::string s = to_str(input);
    std::string out;
    std::size_t pos = 0;
    bool first_line = true;
    while (true) {
      const std::size_t nl = s.find('\n', pos);
      const std::string line = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      if ((!first_line || first) && (blank || !line.empty()) && !(nl == std::string::npos && line.empty() && !first_line)) out += pad;
      out += line;
      if (nl == std::string::npos) break;
      out += '\n';
      pos = nl + 1;
      first_line = false;
    }
    return Value::string(out);
  }
  if (name == "wordcount") return Value::integer(static_cast<std::int64_t>(split_string(to_str(input), Value::none(), -1).size()));
  throw Failure("no filter named '" + name + "'");
}

bool run_test(const std::string& name, const Value& v, const std::vector<Value>& args, Interp&) {
  const auto other = [&]() -> const Value& {
    if (args.empty()) throw Failure("the test '" + name + "' needs an argument");
    return args[0];
  };
  using K = Value::Kind;
  if (name == "defined") return v.defined();
  if (name == "undefined") return !v.defined();
  if (name == "none") return v.kind == K::kNone;
  if (name == "boolean") return v.kind == K::kBool;
  if (name == "true") return v.kind == K::kBool && v.b;
  if (name == "false") return v.kind == K::kBool && !v.b;
  if (name == "integer") return v.kind == K::kInt;
  if (name == "float") return v.kind == K::kFloat;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.kind == K::kDict;
  if (name == "iterable") return v.kind == K::kUndefined || v.is_string() || v.is_sequence() || v.kind == K::kDict;
  if (name == "sequence") return v.kind == K::kUndefined || v.is_string() || v.is_sequence() || v.kind == K::kDict;
  if (name == "callable") return v.kind == K::kCallable;
  if (name == "escaped") return false;
  if (name == "sameas") {
    const Value& o = other();
    if (v.kind != o.kind) return false;
    if (v.kind == K::kNone || v.kind == K::kUndefined) return true;
    if (v.kind == K::kBool) return v.b == o.b;
    if (v.kind == K::kInt) return v.i == o.i;  // CPython shares small ints
    return (v.list && v.list == o.list) || (v.dict && v.dict == o.dict) || (v.fn && v.fn == o.fn);
  }
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, other());
  if (name == "ne" || name == "!=") return !equals(v, other());
  if (name == "lt" || name == "<") return compare(v, other(), "<") < 0;
  if (name == "le" || name == "<=") return compare(v, other(), "<=") <= 0;
  if (name == "gt" || name == ">") return compare(v, other(), ">") > 0;
  if (name == "ge" || name == ">=") return compare(v, other(), ">=") >= 0;
  if (name == "in") return contains(other(), v);
  if (name == "odd") return need_int(v, "odd") % 2 != 0;
  if (name == "even") return need_int(v, "even") % 2 == 0;
  if (name == "divisibleby") {
    const std::int64_t d = need_int(other(), "divisibleby");
    if (d == 0) throw Failure("integer division or modulo by zero");
    return need_int(v, "divisibleby") % d == 0;
  }
  if (name == "lower" || name == "upper") {
    const std::string s = to_str(v);
    return s == ascii_map(s, name == "lower" ? [](int c) { return std::tolower(c); } : [](int c) { return std::toupper(c); });
  }
  throw Failure("no test named '" + name + "'");
}

// ---------------------------------------------------------------------------------------------
// Globals: what HF's environment gives a template.

Scope make_globals() {
  Scope g;
  g["range"] = Value::function("range", [](CallArgs& a, Interp&) {
    if (a.positional.empty() || a.positional.size() > 3) throw Failure("range expects 1 to 3 integer arguments");
    std::int64_t start = 0, stop = 0, step = 1;
    if (a.positional.size() == 1)
      stop = need_int(a.positional[0], "range");
    else {
      start = need_int(a.positional[0], "range");
      stop = need_int(a.positional[1], "range");
      if (a.positional.size() == 3) step = need_int(a.positional[2], "range");
    }
    if (step == 0) throw Failure("range() arg 3 must not be zero");
    List out;
    for (std::int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      if (out.size() >= 100000) throw Failure("range of more than 100000 items (the sandbox's limit)");
      out.push_back(Value::integer(k));
    }
    return Value::make_list(std::move(out));
  });
  const auto make_mapping = [](bool ns) {
    return [ns](CallArgs& a, Interp&) {
      Dict d;
      for (const auto& p : a.positional) {
        if (p.kind != Value::Kind::kDict) throw Failure(std::string(ns ? "namespace" : "dict") + "() takes mappings or keyword arguments");
        for (const auto& [k, v] : p.dict->items) d.set(k, v);
      }
      for (const auto& [k, v] : a.named) d.set(k, v);
      return Value::make_dict(std::move(d), ns);
    };
  };
  g["namespace"] = Value::function("namespace", make_mapping(true));
  g["dict"] = Value::function("dict", make_mapping(false));
  g["raise_exception"] = Value::function("raise_exception", [](CallArgs& a, Interp&) -> Value {
    throw Failure("the template raised an error: " + (a.positional.empty() ? std::string("(no message)") : to_str(a.positional[0])));
  });
  g["strftime_now"] = Value::function("strftime_now", [](CallArgs& a, Interp&) {
    const std::string format = need_string(arg(a, 0, "format"), "strftime_now");
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[256];
    const std::size_t n = std::strftime(buf, sizeof buf, format.c_str(), &local);
    return Value::string(std::string(buf, n));
  });
  return g;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Template::Impl {
  std::string name;
  Settings settings;
  Body body;
  bool generation = false;
};

Template::Template(const std::string& source, std::string name, Settings settings) {
  auto impl = std::make_shared<Impl>();
  impl->name = std::move(name);
  impl->settings = settings;
  try {
    Parser parser(Lexer(source, impl->settings).run());
    impl->body = parser.parse_template();
    impl->generation = parser.saw_generation;
  } catch (const SyntaxError& e) {
    throw UserError("chat template '" + impl->name + "', line " + std::to_string(e.line) + ": " + e.what());
  }
  impl_ = std::move(impl);
}

Template::~Template() = default;

bool Template::has_generation_blocks() const { return impl_->generation; }
const std::string& Template::name() const { return impl_->name; }

Rendered Template::render(const nlohmann::ordered_json& context) const {
  static const Scope globals = make_globals();
  Scope global_scope = globals;
  Scope top;
  if (!context.is_object()) throw UserError("chat template '" + impl_->name + "': the context must be a JSON object");
  for (const auto& [k, v] : context.items()) top[k] = from_json(v);
  Rendered result;
  Interp in{impl_->settings, impl_->name, {&global_scope, &top}, &result.text, &result.text, {}, 0, 0, 0, Interp::Flow::kNormal};
  try {
    in.exec(impl_->body);
  } catch (const Failure& e) {
    throw UserError("chat template '" + impl_->name + "', line " + std::to_string(in.line) + ": " + e.what());
  }
  result.generation_spans = std::move(in.spans);
  return result;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace loom::core::jinja
