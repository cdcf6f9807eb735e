#include "chat/jinja.hpp"

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

#include "chat/jinja_value.hpp"
#include "loom/error.hpp"
#include "loom/kit/utf8.hpp"

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

// ---------------------------------------------------------------------------------------------
// The syntax tree and its evaluation.

struct Expr {
  int line = 0;
  virtual ~Expr() = default;
  Value evaluate(Interp& in) const;  // eval() inside the render's nesting bound
  virtual Value eval(Interp& in) const = 0;
};

// One level of the render's runtime nesting, for as long as it lives.
struct Nested {
  Budget& budget;
  explicit Nested(Budget& b) : budget(b) { budget.enter(); }
  ~Nested() { budget.leave(); }
  Nested(const Nested&) = delete;
  Nested& operator=(const Nested&) = delete;
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
  Budget& budget;
  const std::string& name;
  std::vector<Scope*> scopes;  // innermost last
  std::string* out = nullptr;
  std::string* main_out = nullptr;
  std::vector<std::pair<std::size_t, std::size_t>> spans;
  int line = 0;
  int macro_depth = 0;
  enum class Flow { kNormal, kBreak, kContinue } flow = Flow::kNormal;

  Value lookup(const std::string& key) const {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it)
      if (auto found = (*it)->find(key); found != (*it)->end()) return found->second;
    return Value::undefined("'" + key + "' is undefined");
  }
  void step() { budget.step(); }
  void write(const std::string& text) {
    if (text.size() > budget.settings().max_output_bytes - std::min(out->size(), budget.settings().max_output_bytes))
      throw Failure("the template printed more than " + std::to_string(budget.settings().max_output_bytes) + " bytes");
    budget.work(text.size());
    *out += text;
  }
  void exec(const Body& body) {
    const Nested nested(budget);
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

Value Expr::evaluate(Interp& in) const {
  const Nested nested(in.budget);
  in.budget.work(16);  // a node's evaluation: a long comparison chain or argument list is counted
  return eval(in);
}

Budget& budget() { return Budget::current(); }

// A search of `needle` through `haystack` compares at most their sizes' product of bytes (what
// std::string::find may take for a long needle that nearly matches everywhere): that is charged.
void charge_search(const std::string& haystack, const std::string& needle) {
  const std::uint64_t n = haystack.size(), m = std::max<std::uint64_t>(needle.size(), 1);
  std::uint64_t product = 0;
  budget().work(__builtin_mul_overflow(n, m, &product) ? std::numeric_limits<std::uint64_t>::max() : product);
}

// A user's string in a message: its start, so a message never copies a 64 MiB key.
std::string shown(const std::string& text) {
  if (text.size() <= 80) return text;
  std::size_t end = 80;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end) + "...";
}

// A string kept in a list costs its Value, the shared string's block and its bytes.
constexpr std::uint64_t kStringOverhead = sizeof(Value) + 48;

// Lists are counted as they grow, so a template cannot build one past the value bound.
class ListBuilder {
 public:
  ListBuilder() : budget_(budget()) {}
  void add(Value v, std::uint64_t held_bytes = 0) {
    const std::uint64_t cost = checked_add(sizeof(Value), held_bytes);
    bytes_ = checked_add(bytes_, cost);
    budget_.check_size(bytes_);
    budget_.work(cost);
    items_.push_back(std::move(v));
  }
  void add_string(std::string s) {
    const std::uint64_t held = kStringOverhead - sizeof(Value) + s.size();
    add(Value::string(std::move(s)), held);
  }
  void reserve(std::size_t n) { items_.reserve(std::min<std::size_t>(n, budget_.max_value_bytes() / sizeof(Value))); }
  std::size_t size() const { return items_.size(); }
  List take() { return std::move(items_); }
  Value value(bool tuple = false) { return Value::make_list(std::move(items_), tuple); }

 private:
  Budget& budget_;
  List items_;
  std::uint64_t bytes_ = 0;
};

// A value a call or filter returns: within the value bound.
Value bounded(Value v) {
  if (v.is_string()) budget().check_size(v.str().size());
  if (v.is_sequence()) budget().check_size(checked_mul(v.list->size(), sizeof(Value)));
  return v;
}

[[noreturn]] void fail_undefined(const Value& v) { throw Failure(v.str().empty() ? "a value is undefined" : v.str()); }

// A string that is Markup where `like` is (markupsafe's methods keep the type they are called on).
Value string_like(const Value& like, std::string text) {
  Value v = Value::string(std::move(text));
  v.markup = like.is_string() && like.markup;
  return v;
}

Value markup(std::string text) {
  Value v = Value::string(std::move(text));
  v.markup = true;
  return v;
}

std::string escape_text(const std::string& s);

std::string need_string(const Value& v, const char* what) {
  if (v.kind == Value::Kind::kUndefined) fail_undefined(v);
  if (!v.is_string()) throw Failure(std::string(what) + " needs a string, not " + type_name(v));
  budget().work(v.str().size());
  return v.str();
}

std::int64_t need_int(const Value& v, const char* what) {
  if (v.kind == Value::Kind::kUndefined) fail_undefined(v);
  if (!v.is_integral()) throw Failure(std::string(what) + " needs an integer, not " + type_name(v));
  return v.as_int();
}

// The byte where code point k (0 <= k <= its count) of `s` starts, found by walking: strings are
// indexed by code point without a table of offsets, which would be eight bytes for each of theirs.
std::size_t byte_of(const std::string& s, std::int64_t k) {
  budget().work(s.size());
  std::size_t pos = 0;
  for (std::int64_t i = 0; i < k && pos < s.size(); ++i) decode_at(s, pos);
  return pos;
}

// The items a for loop or a filter walks: a list's, a dict's keys, a string's characters.
List iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return {};
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      budget().check_size(checked_mul(v.list->size(), sizeof(Value)));
      budget().items(v.list->size());
      return *v.list;
    }
    case Value::Kind::kDict: {
      ListBuilder keys;
      keys.reserve(v.dict->items.size());
      for (const auto& [k, unused] : v.dict->items) keys.add_string(k);
      return keys.take();
    }
    case Value::Kind::kString: {
      const std::string& s = v.str();
      ListBuilder chars;
      for (std::size_t pos = 0; pos < s.size();) {
        const std::size_t start = pos;
        decode_at(s, pos);
        chars.add_string(s.substr(start, pos - start));
      }
      return chars.take();
    }
    default: throw Failure("'" + type_name(v) + "' object is not iterable");
  }
}

std::int64_t length_of(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return 0;
    case Value::Kind::kString: return static_cast<std::int64_t>(code_point_count(v.str()));
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
      charge_search(container.str(), item.str());
      return container.str().find(item.str()) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      budget().items(container.list->size());
      return std::any_of(container.list->begin(), container.list->end(), [&](const Value& x) { return equals(x, item); });
    case Value::Kind::kDict:
      if (item.kind == Value::Kind::kList || item.kind == Value::Kind::kDict) throw Failure("unhashable type: '" + type_name(item) + "'");
      return item.is_string() && container.dict->find(item.str()) != nullptr;
    default: throw Failure("argument of type '" + type_name(container) + "' is not iterable");
  }
}

// ---- string helpers with Python's str semantics -------------------------------------------

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
  budget().work(s.size());
  const bool whitespace = !chars.defined() || chars.kind == Value::Kind::kNone;
  std::set<std::uint32_t> set;
  if (!whitespace) {
    const std::string given = need_string(chars, "strip");
    for (std::size_t pos = 0; pos < given.size();) set.insert(decode_at(given, pos));
  }
  const auto strippable = [&](std::uint32_t cp) { return whitespace ? is_py_space(cp) : set.count(cp) != 0; };
  std::size_t begin = 0, end = s.size();
  if (left)
    while (begin < end) {
      std::size_t next = begin;
      if (!strippable(decode_at(s, next))) break;
      begin = next;
    }
  if (right)
    while (end > begin) {
      const std::size_t start = code_point_before(s, end);
      std::size_t pos = start;
      if (!strippable(decode_at(s, pos))) break;
      end = start;
    }
  return s.substr(begin, end - begin);
}

List split_string(const std::string& s, const Value& sep, std::int64_t max_split) {
  budget().work(s.size());
  ListBuilder out;
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
        out.add_string(s.substr(pos));  // the rest as it is, its trailing whitespace kept (Python's)
        return out.take();
      }
      const std::size_t start = pos;
      while (pos < s.size()) {
        std::size_t next = pos;
        if (is_py_space(decode_at(s, next))) break;
        pos = next;
      }
      out.add_string(s.substr(start, pos - start));
      skip_space();
    }
    return out.take();
  }
  const std::string separator = need_string(sep, "split");
  if (separator.empty()) throw Failure("empty separator");
  charge_search(s, separator);
  std::size_t pos = 0;
  while (true) {
    const std::size_t at = s.find(separator, pos);
    if (at == std::string::npos || (max_split >= 0 && static_cast<std::int64_t>(out.size()) == max_split)) {
      out.add_string(s.substr(pos));
      return out.take();
    }
    out.add_string(s.substr(pos, at - pos));
    pos = at + separator.size();
  }
}

// Lines of `s` as str.splitlines finds them (\n, \r, \r\n, \v, \f, \x1c-\x1e, \x85, \u2028, \u2029 end one): [begin, end of text) and where the next begins.
void for_each_line(const std::string& s, const std::function<void(std::size_t begin, std::size_t end, std::size_t next)>& line) {
  std::size_t start = 0;
  for (std::size_t pos = 0; pos < s.size();) {
    const std::size_t at = pos;
    const std::uint32_t cp = decode_at(s, pos);
    const bool boundary = cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || (cp >= 0x1C && cp <= 0x1E) || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
    if (!boundary) continue;
    if (cp == '\r' && pos < s.size() && s[pos] == '\n') ++pos;
    line(start, at, pos);
    start = pos;
  }
  if (start < s.size()) line(start, s.size(), s.size());
}

List split_lines(const std::string& s, bool keep_ends) {
  budget().work(s.size());
  ListBuilder out;
  for_each_line(s, [&](std::size_t begin, std::size_t end, std::size_t next) { out.add_string(s.substr(begin, (keep_ends ? next : end) - begin)); });
  return out.take();
}

// jinja2's title filter (not str.title): words begin after runs of -, whitespace, (, {, [ and <;
// each piece's first character upper-cased, the rest lower-cased.
std::string title_filter(const std::string& s) {
  budget().work(s.size());
  const auto breaks = [](std::uint32_t cp) { return cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || is_py_space(cp); };
  std::string out;
  std::size_t pos = 0;
  while (pos < s.size()) {
    const std::size_t start = pos;
    std::size_t probe = pos;
    const bool in_break = breaks(decode_at(s, probe));
    while (pos < s.size()) {
      std::size_t next = pos;
      if (breaks(decode_at(s, next)) != in_break) break;
      pos = next;
    }
    std::size_t first_end = start;
    decode_at(s, first_end);
    out += py_upper(s.substr(start, first_end - start)) + py_lower(s.substr(first_end, pos - first_end));
    budget().check_size(out.size());
  }
  return out;
}

// str.replace; an empty `from` inserts `to` before every character and at the end, as Python's does.
std::string replace_all(const std::string& s, const std::string& from, const std::string& to, std::int64_t count) {
  budget().work(s.size());
  charge_search(s, from);
  // Where the i-th replacement goes (npos when there is none), found again as it is built.
  const auto next_match = [&](std::size_t pos, bool first) {
    if (!from.empty()) return s.find(from, pos);
    if (!first && pos >= s.size()) return std::string::npos;
    if (!first) decode_at(s, pos);
    return pos;
  };
  // Sized before it is built: counted in a first pass, the growth checked as it accumulates.
  std::uint64_t size = s.size(), n = 0;
  for (std::size_t at = next_match(0, true); at != std::string::npos && (count < 0 || n < static_cast<std::uint64_t>(count));
       at = next_match(at + from.size(), false), ++n) {
    size = checked_add(size - from.size(), to.size());
    budget().check_size(size);
  }
  budget().work(size);
  std::string out;
  out.reserve(size);
  std::size_t pos = 0;
  std::uint64_t done = 0;
  for (std::size_t at = next_match(0, true); at != std::string::npos && done < n; at = next_match(at + from.size(), false), ++done) {
    out.append(s, pos, at - pos);
    out += to;
    pos = at + from.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
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

// The texts of `items` with `separator` between them, each piece counted and the whole held to
// the value bound as it grows (str.join and the join filter).
std::string join_bounded(const List& items, const std::string& separator, const std::function<std::string(std::size_t, const Value&)>& text_of) {
  std::string out;
  for (std::size_t k = 0; k < items.size(); ++k) {
    const std::string text = text_of(k, items[k]);
    budget().check_size(checked_add(checked_add(out.size(), k ? separator.size() : 0), text.size()));
    budget().work(separator.size() + text.size());
    if (k) out += separator;
    out += text;
  }
  return out;
}

// s[begin, end) starts (ends) with the affix, or one of a tuple of them.
bool affix_match(const std::string& s, std::size_t begin, std::size_t end, const Value& affix, bool prefix) {
  const auto one = [&](const std::string& a) {
    return a.size() <= end - begin && (prefix ? s.compare(begin, a.size(), a) == 0 : s.compare(end - a.size(), a.size(), a) == 0);
  };
  if (affix.kind == Value::Kind::kTuple) return std::any_of(affix.list->begin(), affix.list->end(), [&](const Value& a) { return one(need_string(a, "startswith")); });
  return one(need_string(affix, prefix ? "startswith" : "endswith"));
}

// Python's str methods take their arguments by position (split and splitlines by name too), and
// refuse more or fewer than they take.
void check_arguments(const std::string& method, const CallArgs& a, std::size_t least, std::size_t most, std::initializer_list<const char*> names = {}) {
  const std::size_t given = a.positional.size() + a.named.size();
  for (const auto& named : a.named)
    if (std::none_of(names.begin(), names.end(), [&](const char* n) { return named.first == n; }))
      throw Failure("str." + method + "() takes no keyword argument '" + named.first + "'");
  if (given < least || given > most)
    throw Failure("str." + method + "() takes " + (least == most ? std::to_string(least) : std::to_string(least) + " to " + std::to_string(most)) +
                  " arguments (" + std::to_string(given) + " given)");
}

// s[start:end] of find, count, startswith and endswith's optional arguments: its bytes and the
// code point it starts at, or nothing where start passes the end (Python then finds nothing, not
// even an empty string).
struct Window {
  std::size_t begin = 0, end = 0;
  std::int64_t first = 0;
};
std::optional<Window> window_of(const std::string& s, const CallArgs& a) {
  if (a.positional.size() < 2) return Window{0, s.size(), 0};
  const auto n = static_cast<std::int64_t>(code_point_count(s));
  const auto index = [&](std::size_t k, std::int64_t fallback) {
    if (k >= a.positional.size() || a.positional[k].kind == Value::Kind::kNone) return fallback;
    std::int64_t i = need_int(a.positional[k], "a str method's start or end");
    if (i < 0) i = i < -n ? 0 : i + n;
    return std::min(i, n);
  };
  const std::int64_t first = index(1, 0), last = index(2, n);
  if (a.positional[1].kind != Value::Kind::kNone && need_int(a.positional[1], "start") > n) return std::nullopt;
  if (first > last) return std::nullopt;  // Python finds nothing there, not even an empty string
  return Window{byte_of(s, first), byte_of(s, last), first};
}

Value string_method(const Value& self, const std::string& method, CallArgs& a) {
  const std::string& s = self.str();
  // Markup's methods escape plain text given to them and return Markup
  const auto safe_text = [&](const Value& v, const char* what) { return self.markup && !(v.is_string() && v.markup) ? escape_text(need_string(v, what)) : need_string(v, what); };
  if (method == "strip" || method == "lstrip" || method == "rstrip") {
    check_arguments(method, a, 0, 1);
    return string_like(self, strip_chars(s, arg(a, 0, "chars"), method != "rstrip", method != "lstrip"));
  }
  if (method == "split") {
    check_arguments(method, a, 0, 2, {"sep", "maxsplit"});
    const Value max = arg(a, 1, "maxsplit", Value::integer(-1));
    List parts = split_string(s, arg(a, 0, "sep"), need_int(max, "split"));
    for (auto& part : parts) part.markup = self.markup;
    return Value::make_list(std::move(parts));
  }
  if (method == "startswith" || method == "endswith") {
    check_arguments(method, a, 1, 3);
    const auto w = window_of(s, a);
    return Value::boolean(w && affix_match(s, w->begin, w->end, a.positional[0], method == "startswith"));
  }
  if (method == "upper" || method == "lower" || method == "title" || method == "capitalize") {
    check_arguments(method, a, 0, 0);
    return string_like(self, method == "upper" ? py_upper(s) : method == "lower" ? py_lower(s) : method == "title" ? py_title(s) : py_capitalize(s));
  }
  if (method == "replace") {
    check_arguments(method, a, 2, 3);
    const Value count = arg(a, 2, "count", Value::integer(-1));
    return string_like(self, replace_all(s, safe_text(a.positional[0], "replace"), safe_text(a.positional[1], "replace"), need_int(count, "replace")));
  }
  if (method == "find" || method == "count") {
    check_arguments(method, a, 1, 3);
    const std::string sub = need_string(a.positional[0], method.c_str());
    const auto w = window_of(s, a);
    if (!w) return Value::integer(method == "find" ? -1 : 0);
    const std::string part = s.substr(w->begin, w->end - w->begin);
    budget().work(part.size());
    charge_search(part, sub);
    if (method == "find") {
      const auto at = part.find(sub);
      return Value::integer(at == std::string::npos ? -1 : w->first + static_cast<std::int64_t>(code_point_count(part.substr(0, at))));
    }
    if (sub.empty()) return Value::integer(static_cast<std::int64_t>(code_point_count(part)) + 1);
    std::int64_t n = 0;
    for (std::size_t at = part.find(sub); at != std::string::npos; at = part.find(sub, at + sub.size())) ++n;
    return Value::integer(n);
  }
  if (method == "join") {
    check_arguments(method, a, 1, 1);
    return string_like(self, join_bounded(iterate(a.positional[0]), s, [&](std::size_t k, const Value& item) {
                         if (!item.is_string()) throw Failure("sequence item " + std::to_string(k) + ": expected str instance, " + type_name(item) + " found");
                         return safe_text(item, "join");
                       }));
  }
  if (method == "splitlines") {
    check_arguments(method, a, 0, 1, {"keepends"});
    List lines = split_lines(s, truthy(arg(a, 0, "keepends", Value::boolean(false))));
    for (auto& line : lines) line.markup = self.markup;
    return Value::make_list(std::move(lines));
  }
  if (method == "isdigit" || method == "isspace" || method == "isalpha" || method == "isalnum" || method == "isupper" || method == "islower") {
    check_arguments(method, a, 0, 0);
    return Value::boolean(py_is(s, method.substr(2)));
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
    ListBuilder out;
    out.reserve(d->items.size());
    for (const auto& [k, v] : d->items) out.add(Value::make_list({Value::string(k), v}, true), 2 * sizeof(Value) + kStringOverhead + k.size());
    return out.value();
  }
  if (method == "keys" || method == "values") {
    ListBuilder out;
    out.reserve(d->items.size());
    for (const auto& [k, v] : d->items) {
      if (method == "keys")
        out.add_string(k);
      else
        out.add(v);
    }
    return out.value();
  }
  if (method == "get") {
    const Value key = arg(a, 0, "key");
    if (key.is_string())
      if (const Value* v = d->find(key.str())) return *v;
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
      return Value::undefined("'" + std::string(obj.kind == Value::Kind::kDict ? "dict object" : "Namespace") + "' has no attribute '" + shown(attr) + "'");
    case Value::Kind::kString:
      if (is_string_method(attr)) {
        Value self = obj;  // its string is shared, not copied
        return Value::function(attr, [self, attr](CallArgs& a, Interp&) { return string_method(self, attr, a); });
      }
      [[fallthrough]];
    default: return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + shown(attr) + "'");
  }
}

// The code point at index k (negative from the end) of a string, without splitting the rest.
std::optional<std::string> code_point_at(const std::string& s, std::int64_t k) {
  if (k < 0) k += static_cast<std::int64_t>(code_point_count(s));
  if (k < 0) return std::nullopt;
  budget().work(s.size());
  std::int64_t index = 0;
  for (std::size_t pos = 0; pos < s.size(); ++index) {
    const std::size_t start = pos;
    decode_at(s, pos);
    if (index == k) return s.substr(start, pos - start);
  }
  return std::nullopt;
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.kind == Value::Kind::kUndefined) fail_undefined(obj);
  const auto missing = [&] { return Value::undefined("'" + type_name(obj) + " object' has no element " + shown(to_str(key))); };
  if (obj.kind == Value::Kind::kDict || obj.kind == Value::Kind::kNamespace) {
    if (key.is_string()) {
      if (const Value* v = obj.dict->find(key.str())) return *v;
      return get_attribute(obj, key.str());
    }
    return Value::undefined("'dict object' has no attribute '" + shown(to_str(key)) + "'");
  }
  if (obj.is_sequence() || obj.is_string()) {
    if (!key.is_integral()) {
      if (key.is_string()) return get_attribute(obj, key.str());
      return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + shown(to_str(key)) + "'");
    }
    if (obj.is_string()) {
      auto c = code_point_at(obj.str(), key.as_int());
      return c ? string_like(obj, std::move(*c)) : missing();
    }
    const auto n = static_cast<std::int64_t>(obj.list->size());
    std::int64_t k = key.as_int();
    if (k < 0) k += n;
    if (k < 0 || k >= n) return missing();
    return (*obj.list)[static_cast<std::size_t>(k)];
  }
  return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + shown(to_str(key)) + "'");
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  if (obj.kind == Value::Kind::kUndefined) fail_undefined(obj);
  // jinja2's getitem turns the TypeError into an undefined value
  if (!obj.is_sequence() && !obj.is_string()) return Value::undefined("'" + type_name(obj) + "' object is not subscriptable");
  const auto given = [](const Value& v) { return v.defined() && v.kind != Value::Kind::kNone; };
  const auto n = static_cast<std::int64_t>(obj.is_string() ? code_point_count(obj.str()) : obj.list->size());
  const std::int64_t step = given(step_v) ? need_int(step_v, "a slice step") : 1;
  if (step == 0) throw Failure("slice step cannot be zero");
  const auto clamp = [&](const Value& v, std::int64_t fallback) {
    if (!given(v)) return fallback;
    std::int64_t k = need_int(v, "a slice index");
    if (k < 0) k = k < -n ? -n - 1 : k + n;  // no overflow near INT64_MIN
    if (step > 0) return std::clamp<std::int64_t>(k, 0, n);
    return std::clamp<std::int64_t>(k, -1, n - 1);
  };
  const std::int64_t start = clamp(start_v, step > 0 ? 0 : n - 1), stop = clamp(stop_v, step > 0 ? n : -1);
  // k stays within [-1, n]: past it, the next step would leave the range (and might overflow).
  const auto next = [&](std::int64_t k) { return step > 0 ? (step >= stop - k ? stop : k + step) : (step + (k - stop) <= 0 ? stop : k + step); };
  if (obj.is_string()) {
    // Walked one code point at a time from the first taken: each step of the slice moves the
    // cursor as many code points, never past the stop (a step of 2^63 costs one move).
    const std::string& s = obj.str();
    std::string out;
    std::int64_t index = start;
    std::size_t pos = byte_of(s, std::max<std::int64_t>(start, 0));
    while (step > 0 ? index < stop : index > stop) {  // index is a code point of s, at byte pos
      std::size_t end = pos;
      decode_at(s, end);
      out.append(s, pos, end - pos);
      if (step > 0)
        for (std::int64_t moved = 0; moved < step && index < stop; ++moved, ++index) decode_at(s, pos);
      else
        for (std::int64_t moved = 0; moved > step && index > stop; --moved)
          if (--index >= 0) pos = code_point_before(s, pos);
    }
    budget().work(out.size());
    return string_like(obj, std::move(out));
  }
  ListBuilder out;
  for (std::int64_t k = start; step > 0 ? k < stop : k > stop; k = next(k)) out.add((*obj.list)[static_cast<std::size_t>(k)]);
  return out.value(obj.kind == Value::Kind::kTuple);
}

// a < b (<=, >, >=) as Python answers it: false whenever a NaN is compared.
bool ordered(const Value& a, const Value& b, const std::string& op) {
  if (a.is_number() && b.is_number() && (std::isnan(a.as_double()) || std::isnan(b.as_double()))) return false;
  const int c = compare(a, b, op.c_str());
  return op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
}

// ---- arithmetic ------------------------------------------------------------------------------

// Python's float divmod: the remainder takes the divisor's sign (a zero one too), and the
// quotient is floored from (x - remainder) / y, not from x / y.
std::pair<double, double> float_divmod(double x, double y) {
  double mod = std::fmod(x, y);
  double div = (x - mod) / y;
  if (mod != 0) {
    if ((y < 0) != (mod < 0)) {
      mod += y;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, y);
  }
  double floor_div = 0;
  if (div != 0) {
    floor_div = std::floor(div);
    if (div - floor_div > 0.5) floor_div += 1.0;
  } else {
    floor_div = std::copysign(0.0, x / y);
  }
  return {floor_div, mod};
}

[[noreturn]] void fail_overflow() { throw Failure("integer overflow (loom's integers are 64-bit)"); }

std::int64_t add_int(std::int64_t x, std::int64_t y) {
  std::int64_t r = 0;
  if (__builtin_add_overflow(x, y, &r)) fail_overflow();
  return r;
}
std::int64_t sub_int(std::int64_t x, std::int64_t y) {
  std::int64_t r = 0;
  if (__builtin_sub_overflow(x, y, &r)) fail_overflow();
  return r;
}
std::int64_t mul_int(std::int64_t x, std::int64_t y) {
  std::int64_t r = 0;
  if (__builtin_mul_overflow(x, y, &r)) fail_overflow();
  return r;
}

// x ** y for y >= 0 by squaring: log2(y) products, each checked.
std::int64_t int_power(std::int64_t x, std::int64_t y) {
  std::int64_t result = 1, base = x;
  while (y > 0) {
    if (y & 1) result = mul_int(result, base);
    y >>= 1;
    if (y > 0) base = mul_int(base, base);
  }
  return result;
}

// A sequence or string repeated: its size checked before it is built.
Value repeat(const Value& a, std::int64_t times) {
  times = std::max<std::int64_t>(0, times);
  if (a.is_string()) {
    const std::uint64_t size = checked_mul(a.str().size(), static_cast<std::uint64_t>(times));
    budget().check_size(size);
    budget().work(size);
    std::string out;
    out.reserve(size);
    if (size > 0) {
      out = a.str();
      while (out.size() <= size / 2) out += out;  // doubling: log2(times) appends
      out.append(out, 0, size - out.size());
    }
    return string_like(a, std::move(out));
  }
  const std::uint64_t items = checked_mul(a.list->size(), static_cast<std::uint64_t>(times));
  budget().check_size(checked_mul(items, sizeof(Value)));
  budget().items(items);
  List out;
  out.reserve(items);
  if (!a.list->empty())
    for (std::int64_t k = 0; k < times; ++k) out.insert(out.end(), a.list->begin(), a.list->end());
  return Value::make_list(std::move(out), a.kind == Value::Kind::kTuple);
}

Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  if (!a.defined()) fail_undefined(a);
  if (!b.defined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    const bool ints = a.is_integral() && b.is_integral();
    const std::int64_t x = a.as_int(), y = b.as_int();
    const double dx = a.as_double(), dy = b.as_double();
    if (op == "+") return ints ? Value::integer(add_int(x, y)) : Value::real(dx + dy);
    if (op == "-") return ints ? Value::integer(sub_int(x, y)) : Value::real(dx - dy);
    if (op == "*") return ints ? Value::integer(mul_int(x, y)) : Value::real(dx * dy);
    if ((op == "/" || op == "//" || op == "%") && (ints ? y == 0 : dy == 0))
      throw Failure(op == "/" ? "division by zero" : ints ? "integer division or modulo by zero" : "float modulo");
    if (op == "/") return Value::real(dx / dy);
    if (op == "//") {
      if (!ints) return Value::real(float_divmod(dx, dy).first);
      if (y == -1) return Value::integer(sub_int(0, x));
      std::int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
      return Value::integer(q);
    }
    if (op == "%") {
      if (!ints) return Value::real(float_divmod(dx, dy).second);
      if (y == -1) return Value::integer(0);  // x % -1 traps on INT64_MIN in C++
      std::int64_t m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      return Value::integer(m);
    }
    if (op == "**") {
      if (ints && y >= 0) return Value::integer(int_power(x, y));
      if (dx == 0 && dy < 0) throw Failure("0.0 cannot be raised to a negative power");
      if (dx < 0 && dy != std::floor(dy)) throw Failure("a negative number to a fractional power is complex (not supported)");
      const double p = std::pow(dx, dy);
      if (std::isinf(p) && std::isfinite(dx) && std::isfinite(dy)) throw Failure("(34, 'Numerical result out of range')");
      return Value::real(p);
    }
  }
  if (op == "+" && a.is_string() && b.is_string()) {
    if (a.markup != b.markup)  // Markup + str escapes the str
      return a.markup ? arithmetic(op, a, markup(escape_text(b.str()))) : arithmetic(op, markup(escape_text(a.str())), b);
    const std::uint64_t size = checked_add(a.str().size(), b.str().size());
    budget().check_size(size);
    budget().work(size);
    return string_like(a, a.str() + b.str());
  }
  if (op == "+" && a.kind == b.kind && a.is_sequence()) {
    const std::uint64_t items = checked_add(a.list->size(), b.list->size());
    budget().check_size(checked_mul(items, sizeof(Value)));
    budget().items(items);
    List out = *a.list;
    out.insert(out.end(), b.list->begin(), b.list->end());
    return Value::make_list(std::move(out), a.kind == Value::Kind::kTuple);
  }
  if (op == "*" && ((a.is_string() || a.is_sequence()) && b.is_integral())) return repeat(a, b.as_int());
  if (op == "*" && a.is_integral() && (b.is_string() || b.is_sequence())) return repeat(b, a.as_int());
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
    in.budget.items(items.size());
    List out;
    for (const auto& e : items) out.push_back(e->evaluate(in));
    return Value::make_list(std::move(out), tuple);
  }
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Interp& in) const override {
    Dict d;
    for (const auto& [k, v] : items) {
      const Value key = k->evaluate(in);
      if (!key.is_string()) throw Failure("dictionary keys other than strings are not supported (got " + type_name(key) + ")");
      in.budget.work(key.str().size());  // the key is copied into the dict
      d.set(key.str(), v->evaluate(in));
    }
    return Value::make_dict(std::move(d));
  }
};

struct Attribute : Expr {
  ExprPtr object;
  std::string attr;
  Value eval(Interp& in) const override {
    const Value obj = object->evaluate(in);
    in.line = line;
    return get_attribute(obj, attr);
  }
};

struct Item : Expr {
  ExprPtr object, key;
  Value eval(Interp& in) const override {
    const Value obj = object->evaluate(in);
    const Value k = key->evaluate(in);
    in.line = line;
    return get_item(obj, k);
  }
};

struct Slice : Expr {
  ExprPtr object, start, stop, step;
  Value eval(Interp& in) const override {
    const Value obj = object->evaluate(in);
    const auto opt = [&](const ExprPtr& e) { return e ? e->evaluate(in) : Value::none(); };
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
    for (const auto& e : positional) a.positional.push_back(e->evaluate(in));
    for (const auto& [k, e] : named) a.named.emplace_back(k, e->evaluate(in));
    return a;
  }
};

struct Call : Expr {
  ExprPtr callee;
  Args args;
  Value eval(Interp& in) const override {
    const Value f = callee->evaluate(in);
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
    const Value v = input->evaluate(in);
    CallArgs a;
    for (const auto& e : filter.args) a.positional.push_back(e->evaluate(in));
    for (const auto& [k, e] : filter.kwargs) a.named.emplace_back(k, e->evaluate(in));
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
    const Value v = input->evaluate(in);
    std::vector<Value> a;
    for (const auto& e : args) a.push_back(e->evaluate(in));
    in.line = line;
    return Value::boolean(run_test(test, v, a, in) != negated);
  }
};

struct Unary : Expr {
  std::string op;
  ExprPtr operand;
  Value eval(Interp& in) const override {
    const Value v = operand->evaluate(in);
    if (op == "not") return Value::boolean(!truthy(v));
    in.line = line;
    if (!v.defined()) fail_undefined(v);
    if (!v.is_number()) throw Failure("bad operand type for unary " + op + ": '" + type_name(v) + "'");
    if (op == "+") return v.kind == Value::Kind::kFloat ? v : Value::integer(v.as_int());
    if (v.kind == Value::Kind::kFloat) return Value::real(-v.f);
    return Value::integer(sub_int(0, v.as_int()));
  }
};

struct Binary : Expr {
  std::string op;
  ExprPtr left, right;
  Value eval(Interp& in) const override {
    if (op == "and") {
      Value a = left->evaluate(in);
      return truthy(a) ? right->evaluate(in) : a;
    }
    if (op == "or") {
      Value a = left->evaluate(in);
      return truthy(a) ? a : right->evaluate(in);
    }
    const Value a = left->evaluate(in), b = right->evaluate(in);
    in.line = line;
    if (op == "~") return arithmetic("+", Value::string(to_str(a)), Value::string(to_str(b)));
    return arithmetic(op, a, b);
  }
};

struct Compare : Expr {
  ExprPtr first;
  std::vector<std::pair<std::string, ExprPtr>> rest;  // a < b <= c, Python's chain
  Value eval(Interp& in) const override {
    Value a = first->evaluate(in);
    for (const auto& [op, e] : rest) {
      const Value b = e->evaluate(in);
      in.line = line;
      bool ok = false;
      if (op == "==") ok = equals(a, b);
      else if (op == "!=") ok = !equals(a, b);
      else if (op == "in") ok = contains(b, a);
      else if (op == "notin") ok = !contains(b, a);
      else {
        if (!a.defined()) fail_undefined(a);
        if (!b.defined()) fail_undefined(b);
        ok = ordered(a, b, op);
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
    if (truthy(test->evaluate(in))) return then->evaluate(in);
    return otherwise ? otherwise->evaluate(in) : Value::undefined("the conditional expression has no else");
  }
};

// ---- statements ------------------------------------------------------------------------------

struct Output : Stmt {
  std::string text;
  void exec(Interp& in) const override { in.write(text); }
};

struct Print : Stmt {
  ExprPtr value;
  void exec(Interp& in) const override { in.write(to_str(value->evaluate(in))); }
};

struct If : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body otherwise;
  void exec(Interp& in) const override {
    for (const auto& [test, body] : branches)
      if (truthy(test->evaluate(in))) {
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
    const Value source = iterable->evaluate(in);
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
        in.step();  // a condition that keeps nothing still costs its evaluations
        scope.clear();
        assign(in, target, item);
        if (truthy(condition->evaluate(in))) kept.push_back(item);
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
    for (const auto& e : f.args) a.positional.push_back(e->evaluate(in));
    for (const auto& [k, e] : f.kwargs) a.named.emplace_back(k, e->evaluate(in));
    in.line = f.line;
    v = apply_filter(f.name, v, a, in);
  }
  return v;
}

struct Set : Stmt {
  Target target;
  ExprPtr value;
  void exec(Interp& in) const override {
    const Value v = value->evaluate(in);
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
      if (++in.macro_depth > 64) throw Failure("macros nested more than 64 deep");
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
            args[p] = self->defaults[k] ? self->defaults[k]->evaluate(in) : Value::undefined("'" + p + "' is undefined");
        }
        for (const auto& [k, v] : a.named)
          if (std::find(self->params.begin(), self->params.end(), k) == self->params.end())
            throw Failure("macro '" + self->name + "' takes no keyword argument '" + k + "'");
        std::string text = in.capture(self->body);
        in.flow = Interp::Flow::kNormal;
        in.scopes = saved;
        --in.macro_depth;
        return Value::string(std::move(text));
      } catch (...) {
        in.scopes = saved;
        --in.macro_depth;
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
                                           "undefined", "upper",  "==",      "!=",          "<",       "<=",      ">",       ">=",
                                           "greaterthan", "lessthan"};
  return names;
}

// jinja2's filters and tests loom does not implement: a template naming one renders until it
// runs, as in transformers (where it would work), and then fails naming it.
const std::set<std::string>& jinja2_filter_names() {
  static const std::set<std::string> names{"attr", "batch", "center", "filesizeformat", "forceescape", "format", "groupby", "pprint", "random",
                                           "slice", "striptags", "truncate", "urlencode", "urlize", "wordwrap", "xmlattr"};
  return names;
}
const std::set<std::string>& jinja2_test_names() {
  static const std::set<std::string> names{"filter", "test"};
  return names;
}

[[noreturn]] void fail_no_filter(const std::string& name) {
  throw Failure(jinja2_filter_names().count(name) ? "the filter '" + name + "' is not supported in chat templates (docs/chat.md lists those that are)"
                                                  : "no filter named '" + name + "'");
}
[[noreturn]] void fail_no_test(const std::string& name) {
  throw Failure(jinja2_test_names().count(name) ? "the test '" + name + "' is not supported in chat templates" : "no test named '" + name + "'");
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Body parse_template() {
    std::string end;
    Body body = parse_body({}, end);
    if (!unknown_.empty()) throw SyntaxError(unknown_.front().first, unknown_.front().second);
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
    // Each block's body is one level deeper: bounded, so neither parsing nor running nor freeing a
    // template recurses without end.
    const bool nested = !ends.empty();
    if (nested && ++blocks_ > kMaxNesting) throw SyntaxError(peek().line, "blocks nested more than " + std::to_string(kMaxNesting) + " deep");
    struct Leave {
      int& depth;
      bool nested;
      ~Leave() { depth -= nested ? 1 : 0; }
    } leave{blocks_, nested};
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
      const Frame inner(*this, false);
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

  // As jinja2 compiles: inside an if block or a conditional expression (its "soft" frames) a
  // filter or test jinja2 does not know fails only if it runs; elsewhere the template is refused.
  // A for loop's or macro's body, a filter block and a set block are frames of their own.
  struct Frame {
    Parser& p;
    bool saved;
    Frame(Parser& parser, bool soft) : p(parser), saved(parser.soft_) { p.soft_ = soft; }
    ~Frame() { p.soft_ = saved; }
  };

  void unknown(int line, const std::string& what) {
    if (!soft_) unknown_.emplace_back(line, what);
  }

  StmtPtr parse_if(int line) {
    const Frame soft(*this, true);
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
    if (accept_name("if")) {
      const Frame inner(*this, false);
      s->condition = parse_expression(true);
    }
    if (is_name("recursive")) fail("recursive for loops are not supported");
    expect_block_end();
    const Frame inner(*this, false);
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
    const Frame inner(*this, false);
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
    const Frame inner(*this, false);
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
    while (accept_op(".")) f.name += "." + expect_name();  // jinja2 reads dotted filter names (and knows none)
    if (!filter_names().count(f.name) && !jinja2_filter_names().count(f.name)) unknown(f.line, "no filter named '" + f.name + "'");
    if (accept_op("(")) {
      Args a = parse_call_args();
      f.args = std::move(a.positional);
      f.kwargs = std::move(a.named);
    }
    return f;
  }

  // ---- expressions ----

  [[noreturn]] void fail_nesting(int line) const { throw SyntaxError(line, "expressions nested more than " + std::to_string(kMaxNesting) + " deep"); }

  struct DepthGuard {
    int& depth;
    DepthGuard(Parser& p, int line) : depth(p.depth_) {
      if (++depth > kMaxNesting) p.fail_nesting(line);
    }
    ~DepthGuard() { --depth; }
  };

  // A chain (a + b + c, x|f|g, x.a.b) nests each link inside the next: each link counts as one
  // level for the rest of the expression, so chains and brackets together stay bounded.
  struct ChainGuard {
    Parser& p;
    int links = 0;
    explicit ChainGuard(Parser& parser) : p(parser) {}
    void link(int line) {
      ++links;
      if (++p.depth_ > kMaxNesting) p.fail_nesting(line);
    }
    ~ChainGuard() { p.depth_ -= links; }
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
    DepthGuard guard(*this, peek().line);
    if (!with_condexpr) return parse_or();
    const std::size_t hard_before = unknown_.size();
    ExprPtr e = parse_or();
    ChainGuard chain(*this);
    while (is_name("if")) {
      const int line = next().line;
      chain.link(line);
      unknown_.resize(std::min(unknown_.size(), hard_before));  // the branch just parsed is soft
      const Frame soft(*this, true);
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
    ChainGuard chain(*this);
    while (is_name("or")) {
      const int line = next().line;
      chain.link(line);
      e = binary("or", std::move(e), parse_and(), line);
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    ChainGuard chain(*this);
    while (is_name("and")) {
      const int line = next().line;
      chain.link(line);
      e = binary("and", std::move(e), parse_not(), line);
    }
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this, peek().line);
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
    ChainGuard chain(*this);
    while (is_op("+") || is_op("-")) {
      const Token op = next();
      chain.link(op.line);
      e = binary(op.text, std::move(e), parse_concat(), op.line);
    }
    return e;
  }

  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    ChainGuard chain(*this);
    while (is_op("~")) {
      const int line = next().line;
      chain.link(line);
      e = binary("~", std::move(e), parse_math2(), line);
    }
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    ChainGuard chain(*this);
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token op = next();
      chain.link(op.line);
      e = binary(op.text, std::move(e), parse_pow(), op.line);
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    ChainGuard chain(*this);
    while (is_op("**")) {
      const int line = next().line;
      chain.link(line);
      e = binary("**", std::move(e), parse_unary(true), line);
    }
    return e;
  }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      DepthGuard guard(*this, peek().line);
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
          DepthGuard guard(*this, t.line);
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
          DepthGuard guard(*this, t.line);
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
          DepthGuard guard(*this, t.line);
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
    DepthGuard guard(*this, t.line);
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
    ChainGuard chain(*this);
    while (true) {
      if (is_op(".") || is_op("[") || is_op("(")) chain.link(peek().line);
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
    ChainGuard chain(*this);
    while (true) {
      if (is_op("|") || is_name("is") || is_op("(")) chain.link(peek().line);
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
        if (name.type == Token::kName || (name.type == Token::kOp && test_names().count(name.text))) {
          t->test = name.text;
          while (name.type == Token::kName && accept_op(".")) t->test += "." + expect_name();
        } else
          throw SyntaxError(name.line, "expected a test name after 'is', found " + describe(name));
        if (!test_names().count(t->test) && !jinja2_test_names().count(t->test)) unknown(name.line, "no test named '" + t->test + "'");
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
      } else if (is_op("(")) {
        // As jinja2: a filter's or test's result may be called, not subscripted (x|f[0] is an error).
        auto c = node<Call>(next().line);
        c->callee = std::move(e);
        c->args = parse_call_args();
        e = std::move(c);
      } else
        return e;
    }
  }

  std::vector<Token> t_;
  std::size_t k_ = 0;
  int loops_ = 0;
  int depth_ = 0;
  int blocks_ = 0;
  bool soft_ = false;
  std::vector<std::pair<int, std::string>> unknown_;  // filters and tests jinja2 would refuse to compile: line, message
};

// ---------------------------------------------------------------------------------------------
// Filters and tests.

// An attribute= path ("a.b.0") as jinja2 splits it: parts of digits are integer keys.
std::vector<Value> attribute_parts(const std::string& path) {
  std::vector<Value> parts;
  std::size_t pos = 0;
  while (true) {
    budget().items(2);  // a part's value and its string: a path of a million dots is counted
    budget().check_size(checked_mul(parts.size() + 1, kStringOverhead));
    const std::size_t dot = path.find('.', pos);
    const std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (!part.empty() && part.size() <= 18 && part.find_first_not_of("0123456789") == std::string::npos)
      parts.push_back(Value::integer(std::stoll(part)));
    else
      parts.push_back(Value::string(part));
    if (dot == std::string::npos) return parts;
    pos = dot + 1;
  }
}

Value attribute_path(const Value& v, const std::vector<Value>& parts) {
  Value cur = v;
  for (const auto& part : parts) {
    if (part.is_integral() && !cur.is_sequence() && !cur.is_string()) return Value::undefined("'" + type_name(cur) + " object' has no element " + to_str(part));
    cur = get_item(cur, part);
  }
  return cur;
}

// jinja2's make_attrgetter: the item itself, or its attribute (several, comma-separated, for
// sort), strings lower-cased unless case_sensitive.
class KeyOf {
 public:
  KeyOf(const Value& attribute, bool case_sensitive, bool several = false) : case_sensitive_(case_sensitive), several_(several) {
    if (!attribute.defined() || attribute.kind == Value::Kind::kNone) return;
    const std::string path = attribute.is_integral() ? std::to_string(attribute.as_int()) : to_str(attribute);
    if (!several) {
      paths_.push_back(attribute_parts(path));
      return;
    }
    for (const auto& one : split_string(path, Value::string(","), -1)) paths_.push_back(attribute_parts(one.str()));
  }

  Value operator()(const Value& item) const {
    if (paths_.empty()) return fold(item);
    if (!several_) return fold(attribute_path(item, paths_[0]));
    List keys;
    for (const auto& path : paths_) keys.push_back(fold(attribute_path(item, path)));
    return Value::make_list(std::move(keys));
  }

 private:
  Value fold(Value v) const { return !case_sensitive_ && v.is_string() ? Value::string(py_lower(v.str())) : v; }

  bool case_sensitive_, several_;
  std::vector<std::vector<Value>> paths_;
};

Value select_items(const Value& input, CallArgs& a, Interp& in, bool by_attribute, bool keep) {
  ListBuilder out;
  std::size_t first_test_arg = by_attribute ? 1 : 0;
  const std::string attr = by_attribute ? need_string(arg(a, 0, "attribute"), "selectattr") : "";
  const bool has_test = a.positional.size() > first_test_arg;
  const std::string test = has_test ? need_string(a.positional[first_test_arg], "the test name") : "";
  if (has_test && !test_names().count(test)) fail_no_test(test);
  std::vector<Value> test_args(a.positional.begin() + static_cast<long>(std::min(a.positional.size(), first_test_arg + 1)), a.positional.end());
  const auto parts = attribute_parts(attr);
  for (const auto& item : iterate(input)) {
    const Value subject = by_attribute ? attribute_path(item, parts) : item;
    const bool pass = has_test ? run_test(test, subject, test_args, in) : truthy(subject);
    if (pass == keep) out.add(item);
  }
  return out.value();
}

// Python's sorted(items, key=, reverse=): stable, and reverse keeps equal items in their order.
List sorted_by(List items, const std::function<Value(const Value&)>& key, bool reverse) {
  std::vector<std::pair<Value, std::size_t>> keyed;
  keyed.reserve(items.size());
  for (std::size_t k = 0; k < items.size(); ++k) keyed.emplace_back(key(items[k]), k);
  // n log n comparisons, each charged by compare itself.
  budget().items(items.size());
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    const int c = compare(x.first, y.first, "<");
    return reverse ? c > 0 : c < 0;
  });
  List out;
  out.reserve(items.size());
  for (const auto& [unused, k] : keyed) out.push_back(std::move(items[k]));
  return out;
}

// jinja2's int filter: int(value, base), else int(float(value)), else the default.
std::optional<std::int64_t> python_int(const std::string& text, std::int64_t base);
std::optional<double> python_float(const std::string& text);

// int(x) of a finite float, or a Failure where Python's bigints would be needed.
std::int64_t truncate_to_int(double d) {
  if (!(d > -9.2233720368547758e18 && d < 9.2233720368547758e18)) fail_overflow();
  return static_cast<std::int64_t>(d);
}

Value to_int(const Value& input, const Value& fallback, std::int64_t base) {
  if (!input.defined()) fail_undefined(input);  // jinja2's Undefined refuses int()
  if (input.is_integral()) return Value::integer(input.as_int());
  if (input.kind == Value::Kind::kFloat) return std::isfinite(input.f) ? Value::integer(truncate_to_int(input.f)) : fallback;
  if (input.is_string()) {
    if (const auto v = python_int(input.str(), base)) return Value::integer(*v);
    if (const auto d = python_float(input.str()); d && std::isfinite(*d)) return Value::integer(truncate_to_int(*d));
  }
  return fallback;
}

// 10^k as a double for Python's `10**k` (an int for k >= 0, exact up to 10^22).
double power_of_ten(std::int64_t k) { return std::pow(10.0, static_cast<double>(k)); }

// Python's round(x, n) of a float: the nearest multiple of 10^-n to x's exact value, ties to even
// (C's printf rounds the exact binary value that way).
double round_float(double x, std::int64_t n) {
  if (!std::isfinite(x) || x == 0 || n > 323) return x;
  if (n < -308) return 0.0 * x;
  char buf[704];  // "%.323f" of the largest double: 309 digits, the point and 323 more
  if (n >= 0) {
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(n), x);
    return std::strtod(buf, nullptr);
  }
  std::snprintf(buf, sizeof buf, "%.60e", x);
  const int exponent = std::atoi(std::strchr(buf, 'e') + 1);
  const std::int64_t digits = exponent + 1 + n;  // significant digits kept
  if (digits >= 1) {
    std::snprintf(buf, sizeof buf, "%.*e", static_cast<int>(digits - 1), x);
    return std::strtod(buf, nullptr);
  }
  if (digits < 0) return 0.0 * x;
  // |x| < 10^-n: 0 or 10^-n, by whether it passes half of 10^-n (exactly half goes to the even 0).
  const char* mantissa = buf + (buf[0] == '-' ? 1 : 0);
  const bool above_half = mantissa[0] > '5' || (mantissa[0] == '5' && std::strspn(mantissa + 2, "0") < std::strcspn(mantissa + 2, "e"));
  return above_half ? std::copysign(power_of_ten(-n), x) : 0.0 * x;
}

// Python's round(x, n) of an int: unchanged for n >= 0, else to a multiple of 10^-n, ties to even.
std::int64_t round_int(std::int64_t x, std::int64_t n) {
  if (n >= 0) return x;
  if (n < -18) return 0;
  std::int64_t unit = 1;
  for (std::int64_t k = 0; k < -n; ++k) unit *= 10;
  std::int64_t q = x / unit, r = x % unit;
  if (r < 0) {
    r += unit;
    --q;
  }
  if (2 * r > unit || (2 * r == unit && q % 2 != 0)) ++q;
  std::int64_t out = 0;
  if (__builtin_mul_overflow(q, unit, &out)) fail_overflow();
  return out;
}

Value round_filter(const Value& input, CallArgs& a) {
  const std::int64_t precision = need_int(arg(a, 0, "precision", Value::integer(0)), "round");
  const std::string method = to_str(arg(a, 1, "method", Value::string("common")));
  if (method != "common" && method != "ceil" && method != "floor") throw Failure("method must be common, ceil or floor");
  if (!input.defined()) fail_undefined(input);
  if (!input.is_number()) throw Failure("type " + type_name(input) + " doesn't define __round__ method");
  if (method == "common") return input.is_integral() ? Value::integer(round_int(input.as_int(), precision)) : Value::real(round_float(input.f, precision));
  // math.ceil / math.floor of value * 10**precision, over 10**precision
  const double scale = power_of_ten(precision), scaled = input.as_double() * scale;
  if (std::isnan(scaled)) throw Failure("cannot convert float NaN to integer");
  if (std::isinf(scaled)) throw Failure("cannot convert float infinity to integer");
  const double whole = method == "ceil" ? std::ceil(scaled) : std::floor(scaled);
  return Value::real((whole == 0 ? 0.0 : whole) / scale);  // math.ceil gives an int: no -0.0
}


// A pad given as a string, or as a count of spaces (a negative count none, as Python's ' ' * n):
// indent's width and tojson's indent.
std::string pad_of(const Value& width, const char* what) {
  if (width.is_string()) return width.str();
  const std::int64_t n = std::max<std::int64_t>(0, need_int(width, what));
  budget().check_size(static_cast<std::uint64_t>(n));
  return std::string(static_cast<std::size_t>(n), ' ');
}

// jinja2's indent: the text's lines (a newline added first, as jinja2 does) joined again, each
// after the first (and the first too with `first`) behind the pad, blank ones only with `blank`.
std::string indent_filter(const std::string& text, const Value& width, bool first, bool blank) {
  const std::string pad = pad_of(width, "indent");
  const std::string s = text + "\n";
  budget().work(s.size());
  // Sized before it is built (a first pass counts the lines): every line may take the pad and a newline.
  std::uint64_t lines = 0;
  for_each_line(s, [&](std::size_t, std::size_t, std::size_t) { ++lines; });
  budget().check_size(checked_add(s.size(), checked_mul(lines + 1, pad.size() + 1)));
  std::string out;
  if (first) out += pad;
  bool first_line = true;
  for_each_line(s, [&](std::size_t b, std::size_t e, std::size_t) {
    if (!first_line) {
      out += '\n';
      if (blank || e > b) out += pad;
    }
    first_line = false;
    out.append(s, b, e - b);
  });
  budget().work(out.size());
  return out;
}

// HF's tojson: json.dumps(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
Value tojson_filter(const Value& input, CallArgs& a) {
  const bool ascii = truthy(arg(a, 0, "ensure_ascii", Value::boolean(false)));
  const Value indent = arg(a, 1, "indent", Value::none());
  const Value separators = arg(a, 2, "separators", Value::none());
  const bool sort_keys = truthy(arg(a, 3, "sort_keys", Value::boolean(false)));
  std::optional<std::string> indent_text;
  if (indent.defined() && indent.kind != Value::Kind::kNone) indent_text = pad_of(indent, "tojson's indent");
  std::string item_sep = indent_text ? "," : ", ", key_sep = ": ";
  if (separators.defined() && separators.kind != Value::Kind::kNone) {
    if (!separators.is_sequence() || separators.list->size() != 2) throw Failure("tojson's separators must be an (item, key) pair");
    item_sep = need_string((*separators.list)[0], "tojson's separators");
    key_sep = need_string((*separators.list)[1], "tojson's separators");
  }
  if (!input.defined()) throw Failure("Object of type Undefined is not JSON serializable");
  std::string json = to_json(input, indent_text ? &*indent_text : nullptr, sort_keys, item_sep, key_sep);
  if (!ascii) return Value::string(std::move(json));
  // ensure_ascii: every code point past ASCII as \uXXXX (a surrogate pair past the BMP).
  std::string out;
  for (std::size_t pos = 0; pos < json.size();) {
    const std::uint32_t cp = decode_at(json, pos);
    char buf[16];
    if (cp < 0x80)
      out += static_cast<char>(cp);
    else if (cp < 0x10000) {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      out += buf;
    } else {
      const std::uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      out += buf;
    }
    budget().check_size(out.size());
  }
  return Value::string(std::move(out));
}

std::string join_filter(const Value& input, const std::string& separator, const Value& attribute) {
  const KeyOf key(attribute, true);  // the item itself where no attribute is given
  return join_bounded(iterate(input), separator, [&](std::size_t, const Value& item) { return to_str(key(item)); });
}

std::string escape_text(const std::string& s) {
  std::uint64_t size = 0;
  for (const char c : s) size += c == '&' ? 5 : c == '<' || c == '>' ? 4 : c == '"' || c == '\'' ? 5 : 1;
  budget().check_size(size);
  budget().work(s.size() + size);
  return html_escape(s);
}

Value first_or_last(const Value& input, bool first) {
  const std::string what = first ? "first" : "last";
  const auto empty = [&] { return Value::undefined("No " + what + " item, sequence was empty."); };
  switch (input.kind) {
    case Value::Kind::kUndefined: return empty();
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      if (input.list->empty()) return empty();
      return first ? input.list->front() : input.list->back();
    case Value::Kind::kDict:
      if (input.dict->items.empty()) return empty();
      budget().work((first ? input.dict->items.front() : input.dict->items.back()).first.size());
      return Value::string(first ? input.dict->items.front().first : input.dict->items.back().first);
    case Value::Kind::kString: {
      const std::string& s = input.str();
      if (s.empty()) return empty();
      const std::size_t start = first ? 0 : code_point_before(s, s.size());
      std::size_t end = start;
      decode_at(s, end);
      return Value::string(s.substr(start, end - start));
    }
    default: throw Failure("'" + type_name(input) + "' object is not iterable");
  }
}

Value apply_filter(const std::string& name, const Value& input, CallArgs& a, Interp& in) {
  if (name == "length" || name == "count") return Value::integer(length_of(input));
  // Filters that call a str method on their input keep it Markup where it was (jinja2's soft_str)
  if (name == "string") return string_like(input, to_str(input));
  if (name == "safe") return input.is_string() && input.markup ? input : markup(to_str(input));
  if (name == "trim") return string_like(input, strip_chars(to_str(input), arg(a, 0, "chars"), true, true));
  if (name == "upper") return string_like(input, py_upper(to_str(input)));
  if (name == "lower") return string_like(input, py_lower(to_str(input)));
  if (name == "title") return Value::string(title_filter(to_str(input)));
  if (name == "capitalize") return string_like(input, py_capitalize(to_str(input)));
  if (name == "e" || name == "escape") return input.is_string() && input.markup ? input : markup(escape_text(to_str(input)));
  if (name == "replace") {
    const Value count = arg(a, 2, "count", Value::none());
    const std::int64_t n = count.kind == Value::Kind::kNone ? -1 : need_int(count, "replace");
    return Value::string(replace_all(to_str(input), to_str(arg(a, 0, "old")), to_str(arg(a, 1, "new")), n));
  }
  if (name == "default" || name == "d") {
    const bool boolean = truthy(arg(a, 1, "boolean", Value::boolean(false)));
    if (!input.defined() || (boolean && !truthy(input))) return arg(a, 0, "default_value", Value::string(""));
    return input;
  }
  if (name == "tojson") return tojson_filter(input, a);
  if (name == "list") return Value::make_list(iterate(input));
  if (name == "first" || name == "last") return first_or_last(input, name == "first");
  if (name == "reverse") {
    if (input.is_string()) {
      const std::string& text = input.str();
      budget().work(text.size());
      std::string out;
      out.reserve(text.size());
      for (std::size_t end = text.size(); end > 0;) {
        const std::size_t begin = code_point_before(text, end);
        out.append(text, begin, end - begin);
        end = begin;
      }
      return string_like(input, std::move(out));
    }
    List items = iterate(input);
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  if (name == "join") return Value::string(join_filter(input, to_str(arg(a, 0, "d", Value::string(""))), arg(a, 1, "attribute", Value::none())));
  if (name == "selectattr" || name == "rejectattr") return select_items(input, a, in, true, name == "selectattr");
  if (name == "select" || name == "reject") return select_items(input, a, in, false, name == "select");
  if (name == "map") {
    ListBuilder out;
    if (const Value* attribute = named_arg(a, "attribute")) {
      const Value* fallback = named_arg(a, "default");
      const KeyOf key(*attribute, true);
      for (const auto& item : iterate(input)) {
        Value v = key(item);
        out.add(!v.defined() && fallback ? *fallback : v);
      }
      return out.value();
    }
    if (a.positional.empty()) throw Failure("map needs a filter name or attribute=");
    const std::string filter = need_string(a.positional[0], "map");
    if (!filter_names().count(filter)) fail_no_filter(filter);
    CallArgs rest;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    rest.named = a.named;
    in.budget.items(rest.positional.size() + rest.named.size());
    for (const auto& item : iterate(input)) {
      in.step();
      const Nested nested(in.budget);  // map('map', 'map', ...) recurses through here
      out.add(bounded(apply_filter(filter, item, rest, in)));
    }
    return out.value();
  }
  if (name == "items") {
    if (!input.defined()) return Value::make_list({});
    if (input.kind != Value::Kind::kDict) throw Failure("Can only get item pairs from a mapping.");
    CallArgs none;
    return dict_method(input.dict, "items", none);
  }
  if (name == "dictsort") {
    if (input.kind != Value::Kind::kDict) throw Failure("dictsort needs a mapping, not " + type_name(input));
    const bool case_sensitive = truthy(arg(a, 0, "case_sensitive", Value::boolean(false)));
    const std::string by = to_str(arg(a, 1, "by", Value::string("key")));
    const bool reverse = truthy(arg(a, 2, "reverse", Value::boolean(false)));
    if (by != "key" && by != "value") throw Failure("You can only sort by either \"key\" or \"value\"");
    CallArgs none;
    const Value items = dict_method(input.dict, "items", none);
    const KeyOf fold(Value::none(), case_sensitive);
    const std::size_t pick = by == "key" ? 0 : 1;
    return Value::make_list(sorted_by(*items.list, [&](const Value& pair) { return fold((*pair.list)[pick]); }, reverse));
  }
  if (name == "sort") {
    const bool reverse = truthy(arg(a, 0, "reverse", Value::boolean(false)));
    const KeyOf key(arg(a, 2, "attribute"), truthy(arg(a, 1, "case_sensitive", Value::boolean(false))), true);
    return Value::make_list(sorted_by(iterate(input), key, reverse));
  }
  if (name == "unique") {
    const KeyOf key(arg(a, 1, "attribute"), truthy(arg(a, 0, "case_sensitive", Value::boolean(false))));
    ListBuilder out;
    std::unordered_set<std::string> seen;
    for (const auto& item : iterate(input))
      if (seen.insert(hash_key(key(item))).second) out.add(item);
    return out.value();
  }
  if (name == "sum") {
    Value total = arg(a, 1, "start", Value::integer(0));
    const Value attribute = arg(a, 0, "attribute", Value::none());
    const KeyOf key(attribute, true);
    for (const auto& item : iterate(input)) total = arithmetic("+", total, key(item));
    return total;
  }
  if (name == "min" || name == "max") {
    const List items = iterate(input);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    const KeyOf key(arg(a, 1, "attribute"), truthy(arg(a, 0, "case_sensitive", Value::boolean(false))));
    std::size_t best = 0;
    Value best_key = key(items[0]);
    for (std::size_t k = 1; k < items.size(); ++k) {
      Value candidate = key(items[k]);
      const int c = compare(candidate, best_key, name == "min" ? "<" : ">");
      if (name == "min" ? c < 0 : c > 0) {
        best = k;
        best_key = std::move(candidate);
      }
    }
    return items[best];
  }
  if (name == "abs") {
    if (input.kind == Value::Kind::kFloat) return Value::real(std::fabs(input.f));
    const std::int64_t v = need_int(input, "abs");
    if (v == std::numeric_limits<std::int64_t>::min()) fail_overflow();
    return Value::integer(v < 0 ? -v : v);
  }
  if (name == "int") return to_int(input, arg(a, 0, "default", Value::integer(0)), need_int(arg(a, 1, "base", Value::integer(10)), "int's base"));
  if (name == "float") {
    const Value fallback = arg(a, 0, "default", Value::real(0.0));
    if (!input.defined()) fail_undefined(input);  // and float()
    if (input.is_number()) return Value::real(input.as_double());
    if (input.is_string())
      if (const auto d = python_float(input.str())) return Value::real(*d);
    return fallback;
  }
  if (name == "round") return round_filter(input, a);
  if (name == "indent" && !input.defined()) fail_undefined(input);  // jinja2 adds a newline to it, so it takes text only
  if (name == "indent" && !input.is_string()) throw Failure("indent takes a string, not " + type_name(input));
  if (name == "indent")
    return string_like(input, indent_filter(to_str(input), arg(a, 0, "width", Value::integer(4)), truthy(arg(a, 1, "first", Value::boolean(false))),
                                       truthy(arg(a, 2, "blank", Value::boolean(false)))));
  if (name == "wordcount") {
    const std::string s = to_str(input);
    budget().work(s.size());
    std::int64_t words = 0;
    bool in_word = false;
    for (std::size_t pos = 0; pos < s.size();) {
      const bool word = py_word_char(decode_at(s, pos));
      words += word && !in_word ? 1 : 0;
      in_word = word;
    }
    return Value::integer(words);
  }
  fail_no_filter(name);
}

// Python's `a % b == r` (odd, even and divisibleby are defined by it, floats included).
bool remainder_is(const Value& a, const Value& b, std::int64_t r) { return equals(arithmetic("%", a, b), Value::integer(r)); }

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
  if (name == "escaped") return v.is_string() && v.markup;
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
  if (name == "lt" || name == "<" || name == "lessthan") return ordered(v, other(), "<");
  if (name == "le" || name == "<=") return ordered(v, other(), "<=");
  if (name == "gt" || name == ">" || name == "greaterthan") return ordered(v, other(), ">");
  if (name == "ge" || name == ">=") return ordered(v, other(), ">=");
  if (name == "in") return contains(other(), v);
  if (name == "odd") return remainder_is(v, Value::integer(2), 1);
  if (name == "even") return remainder_is(v, Value::integer(2), 0);
  if (name == "divisibleby") return remainder_is(v, other(), 0);
  if (name == "lower" || name == "upper") return py_is(to_str(v), name);
  fail_no_test(name);
}

// ---- Python's number parsing, for the int and float filters --------------------------------

// A character's value as a digit (letters after 9, either case), 99 for what is no digit.
int digit_value(char c) {
  const auto u = static_cast<unsigned char>(c);
  return std::isdigit(u) ? c - '0' : std::isalpha(u) ? std::tolower(u) - 'a' + 10 : 99;
}

// Digits in `base` with single underscores between them (Python's int() and float() allow those).
bool digits_with_underscores(const std::string& s, std::size_t begin, std::size_t end, int base, bool allow_leading_underscore) {
  if (begin >= end) return false;
  bool previous_digit = allow_leading_underscore;
  for (std::size_t k = begin; k < end; ++k) {
    const char c = s[k];
    if (c == '_') {
      if (!previous_digit) return false;
      previous_digit = false;
      continue;
    }
    if (digit_value(c) >= base) return false;
    previous_digit = true;
  }
  return previous_digit;
}

std::string without_underscores(const std::string& s) {
  std::string out;
  for (const char c : s)
    if (c != '_') out += c;
  return out;
}

std::optional<std::int64_t> python_int(const std::string& text, std::int64_t base) {
  if (base != 0 && (base < 2 || base > 36)) throw Failure("int() base must be >= 2 and <= 36, or 0");
  const std::string s = strip_chars(text, Value::none(), true, true);
  std::size_t k = 0;
  bool negative = false;
  if (k < s.size() && (s[k] == '+' || s[k] == '-')) negative = s[k++] == '-';
  bool prefixed = false;
  if (k + 1 < s.size() && s[k] == '0') {
    const char p = static_cast<char>(std::tolower(static_cast<unsigned char>(s[k + 1])));
    const int prefix_base = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (prefix_base != 0 && (base == 0 || base == prefix_base)) {
      base = prefix_base;
      k += 2;
      prefixed = true;
    }
  }
  if (base == 0) {
    // no prefix: decimal, where a leading zero is allowed only for zero itself
    base = 10;
    const std::string digits = without_underscores(s.substr(k));
    if (digits.size() > 1 && digits[0] == '0' && digits.find_first_not_of('0') != std::string::npos) return std::nullopt;
  }
  if (!digits_with_underscores(s, k, s.size(), static_cast<int>(base), prefixed)) return std::nullopt;
  const std::string digits = without_underscores(s.substr(k));
  std::int64_t value = 0;
  for (const char c : digits)
    if (__builtin_mul_overflow(value, base, &value) || __builtin_sub_overflow(value, digit_value(c), &value)) fail_overflow();  // accumulated negative
  if (!negative) {
    if (value == std::numeric_limits<std::int64_t>::min()) fail_overflow();
    value = -value;
  }
  return value;
}

std::optional<double> python_float(const std::string& text) {
  const std::string s = strip_chars(text, Value::none(), true, true);
  std::size_t k = 0;
  if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
  std::string rest = s.substr(k);
  for (auto& c : rest) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool negative = k > 0 && s[0] == '-';
  if (rest == "inf" || rest == "infinity") return negative ? -HUGE_VAL : HUGE_VAL;
  if (rest == "nan") return negative ? -std::nan("") : std::nan("");
  // digits [. digits] [e [sign] digits], each run of digits with single underscores
  std::size_t end = k;
  const auto run = [&](std::size_t from) {
    std::size_t to = from;
    while (to < s.size() && (std::isdigit(static_cast<unsigned char>(s[to])) || s[to] == '_')) ++to;
    return to;
  };
  const std::size_t whole_end = run(end);
  bool any_digits = whole_end > end;
  if (any_digits && !digits_with_underscores(s, end, whole_end, 10, false)) return std::nullopt;
  end = whole_end;
  if (end < s.size() && s[end] == '.') {
    const std::size_t fraction_end = run(end + 1);
    if (fraction_end > end + 1 && !digits_with_underscores(s, end + 1, fraction_end, 10, false)) return std::nullopt;
    any_digits = any_digits || fraction_end > end + 1;
    end = fraction_end;
  }
  if (!any_digits) return std::nullopt;
  if (end < s.size() && (s[end] == 'e' || s[end] == 'E')) {
    std::size_t e = end + 1;
    if (e < s.size() && (s[e] == '+' || s[e] == '-')) ++e;
    const std::size_t exponent_end = run(e);
    if (!digits_with_underscores(s, e, exponent_end, 10, false)) return std::nullopt;
    end = exponent_end;
  }
  if (end != s.size()) return std::nullopt;
  return std::strtod(without_underscores(s).c_str(), nullptr);
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
    // Its length first, in 128 bits: the sandbox's limit is checked before anything is built.
    const __int128 span = step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
    const __int128 stride = step > 0 ? static_cast<__int128>(step) : -static_cast<__int128>(step);
    const __int128 count = span <= 0 ? 0 : (span + stride - 1) / stride;
    if (count > 100000) throw Failure("range of more than 100000 items (the sandbox's limit)");
    ListBuilder out;
    out.reserve(static_cast<std::size_t>(count));
    for (__int128 k = 0; k < count; ++k) out.add(Value::integer(static_cast<std::int64_t>(start + k * step)));
    return out.value();
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
  if (const std::size_t bad = kit::invalid_utf8_at(source); bad != std::string_view::npos)
    throw UserError("chat template '" + impl->name + "', line " + std::to_string(1 + std::count(source.begin(), source.begin() + static_cast<long>(bad), '\n')) +
                    ": byte " + std::to_string(bad) + " is not UTF-8 (a template is text; save it as UTF-8)");
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
  if (!context.is_object()) throw UserError("chat template '" + impl_->name + "': the context must be a JSON object");
  // Everything the render builds is counted against this budget, and freed before it goes.
  Budget budget(impl_->settings);
  const Budget::Active active(budget);
  Rendered result;
  int line = 0;
  try {
    Scope global_scope = globals;
    Scope top;
    for (const auto& [k, v] : context.items()) top[k] = from_json(v);
    Interp in{budget, impl_->name, {&global_scope, &top}, &result.text, &result.text, {}, 0, 0, Interp::Flow::kNormal};
    try {
      in.exec(impl_->body);
    } catch (const Failure&) {
      line = in.line;
      throw;
    }
    result.generation_spans = std::move(in.spans);
  } catch (const Failure& e) {
    throw UserError("chat template '" + impl_->name + "', line " + std::to_string(line) + ": " + e.what());
  }
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
