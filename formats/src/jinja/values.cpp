#include "jinja/values.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include <unicode/uchar.h>
#include <unicode/ustring.h>

namespace loom::formats::jinja {

// ---------------------------------------------------------------------------------------------
// Freeing without recursion: the last owner of a list or dict hands it to the thread's graveyard,
// and the outermost destructor frees the graveyard one container at a time (each container's
// children add theirs), so the stack stays flat however deep the value was nested.

namespace {

// Set once the thread's graveyard is gone (at the thread's or the program's end): values freed
// after that (the engine's static globals) free their members as they would anyway.
thread_local bool t_graveyard_gone = false;

struct Graveyard {
  std::vector<std::shared_ptr<List>> lists;
  std::vector<std::shared_ptr<Dict>> dicts;
  std::vector<std::shared_ptr<Callable>> functions;  // a bound dict method holds its dict
  bool draining = false;
  ~Graveyard() { t_graveyard_gone = true; }
};
thread_local Graveyard t_graveyard;

}  // namespace

Value::~Value() {
  if ((!list && !dict && !fn) || t_graveyard_gone) return;
  Graveyard& g = t_graveyard;
  if (list && list.use_count() == 1) g.lists.push_back(std::move(list));
  if (dict && dict.use_count() == 1) g.dicts.push_back(std::move(dict));
  if (fn && fn.use_count() == 1) g.functions.push_back(std::move(fn));
  if (g.draining) return;
  g.draining = true;
  // Each container freed here frees its items, whose destructors only add to the graveyard.
  const auto free_last = [](auto& pile) {
    auto last = std::move(pile.back());
    pile.pop_back();
    last.reset();
  };
  while (!g.lists.empty() || !g.dicts.empty() || !g.functions.empty()) {
    if (!g.lists.empty())
      free_last(g.lists);
    else if (!g.dicts.empty())
      free_last(g.dicts);
    else
      free_last(g.functions);
  }
  g.draining = false;
}

Value Value::undefined(std::string why) {
  Value v;
  if (!why.empty()) v.text = std::make_shared<const std::string>(std::move(why));
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::kBool;
  v.b = x;
  return v;
}
Value Value::integer(std::int64_t x) {
  Value v;
  v.kind = Kind::kInt;
  v.i = x;
  return v;
}
Value Value::real(double x) {
  Value v;
  v.kind = Kind::kFloat;
  v.f = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::kString;
  v.text = std::make_shared<const std::string>(std::move(x));
  return v;
}
Value Value::make_list(List items, bool tuple) {
  Value v;
  v.kind = tuple ? Kind::kTuple : Kind::kList;
  v.list = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::make_dict(Dict d, bool namespace_object) {
  Value v;
  v.kind = namespace_object ? Kind::kNamespace : Kind::kDict;
  v.dict = std::make_shared<Dict>(std::move(d));
  if (namespace_object) Budget::current().remember_namespace(v.dict);
  return v;
}
Value Value::function(std::string name, Native fn) {
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

const std::string& Value::str() const {
  static const std::string empty;
  return text ? *text : empty;
}

const Value* Dict::find(const std::string& key) const {
  // A scan of the keys, each of the same length compared byte by byte.
  Budget::current().work(checked_mul(items.size(), key.size() + 8) + 8);
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  Budget::current().work(checked_mul(items.size() + 1, key.size() + 8));  // the scan, and the key's copy
  for (auto& [k, old] : items)
    if (k == key) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

// ---------------------------------------------------------------------------------------------
// The budget.

namespace {

thread_local Budget* t_active = nullptr;

Settings unbounded_work() {
  Settings s;
  s.max_steps = std::numeric_limits<std::uint64_t>::max();
  s.max_work_bytes = std::numeric_limits<std::uint64_t>::max();
  return s;
}

std::string mib(std::uint64_t bytes) {
  return bytes % (std::uint64_t{1} << 20) == 0 ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes) + " bytes";
}

}  // namespace

Budget::Budget(const Settings& settings) : settings_(settings), stack_top_(static_cast<const char*>(__builtin_frame_address(0))) {}

Budget::~Budget() {
  // A namespace may hold itself (ns.me = ns) or a value holding it: emptied here, those cycles go.
  for (const auto& weak : namespaces_)
    if (const auto ns = weak.lock()) {
      std::vector<std::pair<std::string, Value>> items;
      items.swap(ns->items);
    }
}

void Budget::step() {
  if (++steps_ > settings_.max_steps) throw Failure("the template ran more than " + std::to_string(settings_.max_steps) + " steps");
}

void Budget::work(std::uint64_t bytes) {
  if (bytes > settings_.max_work_bytes || work_ > settings_.max_work_bytes - bytes)
    throw Failure("the template's operations went past " + mib(settings_.max_work_bytes) + " of work (bytes read, copied or built)");
  work_ += bytes;
}

void Budget::check_size(std::uint64_t bytes) const {
  if (bytes > settings_.max_value_bytes) fail_too_large();
}

// Frames differ in size (a sanitizer's are several times a release build's), so the stack a
// render has taken is bounded too, well inside the 8 MiB a thread is given.
constexpr std::ptrdiff_t kMaxStackBytes = std::ptrdiff_t{2} << 20;

void Budget::enter() {
  const auto* here = static_cast<const char*>(__builtin_frame_address(0));
  if (++nesting_ > 4 * kMaxNesting || stack_top_ - here > kMaxStackBytes) {
    --nesting_;
    throw Failure("the template nested blocks, expressions and calls more than " + std::to_string(4 * kMaxNesting) + " deep (or past " +
                  std::to_string(kMaxStackBytes >> 20) + " MiB of stack)");
  }
}

Budget& Budget::current() {
  if (t_active) return *t_active;
  thread_local Budget outside(unbounded_work());
  return outside;
}

Budget::Active::Active(Budget& budget) : previous_(t_active) { t_active = &budget; }
Budget::Active::~Active() { t_active = previous_; }

void fail_too_large() { throw Failure("a value of more than " + mib(Budget::current().max_value_bytes())); }

std::uint64_t checked_add(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) fail_too_large();
  return r;
}

std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) fail_too_large();
  return r;
}

// ---------------------------------------------------------------------------------------------

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kList: return "list";
    case Value::Kind::kTuple: return "tuple";
    case Value::Kind::kDict: return "dict";
    case Value::Kind::kNamespace: return "Namespace";
    case Value::Kind::kCallable: return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.b;
    case Value::Kind::kInt: return v.i != 0;
    case Value::Kind::kFloat: return v.f != 0;
    case Value::Kind::kString: return !v.str().empty();
    case Value::Kind::kList:
    case Value::Kind::kTuple: return !v.list->empty();
    case Value::Kind::kDict: return !v.dict->items.empty();
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable: return true;
  }
  return false;
}

std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // The shortest digits that read back to d (what Python's repr prints), in scientific form.
  char buf[64];
  const auto written = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  // buf: [-]D[.DDD]e[+-]XX
  std::string text(buf, written.ptr);
  const bool negative = text[0] == '-';
  if (negative) text.erase(0, 1);
  const auto e = text.find('e');
  std::string digits = text.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exponent = std::atoi(text.c_str() + e + 1);
  std::string out;
  if (exponent >= -4 && exponent < 16) {
    if (exponent >= 0) {
      const auto whole = static_cast<std::size_t>(exponent) + 1;
      if (digits.size() <= whole)
        out = digits + std::string(whole - digits.size(), '0') + ".0";
      else
        out = digits.substr(0, whole) + "." + digits.substr(whole);
    } else {
      out = "0." + std::string(static_cast<std::size_t>(-exponent - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp[16];
    std::snprintf(exp, sizeof exp, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp;
  }
  return negative ? "-" + out : out;
}

std::uint32_t decode_at(const std::string& s, std::size_t& pos) {
  const auto c = static_cast<unsigned char>(s[pos]);
  int extra = c < 0x80 ? 0 : c < 0xE0 ? 1 : c < 0xF0 ? 2 : 3;
  if (c >= 0x80 && c < 0xC0) extra = 0;  // a stray continuation byte stands for itself
  std::uint32_t cp = extra == 0 ? c : extra == 1 ? (c & 0x1Fu) : extra == 2 ? (c & 0x0Fu) : (c & 0x07u);
  ++pos;
  // Only continuation bytes belong to it, as code_point_count counts: text that is not UTF-8 (a
  // context built in code) never moves a walk past the string's end.
  for (int k = 0; k < extra && pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80; ++k, ++pos)
    cp = (cp << 6) | (static_cast<unsigned char>(s[pos]) & 0x3Fu);
  return cp;
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

std::size_t code_point_before(const std::string& s, std::size_t end) {
  std::size_t at = end - 1;
  while (at > 0 && end - at < 4 && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80) --at;
  return at;
}

std::size_t code_point_count(const std::string& s) {
  Budget::current().work(s.size());
  std::size_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

bool is_py_space(std::uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// ---------------------------------------------------------------------------------------------
// Printing: str() and repr() as Python prints them, a container that holds itself as [...] or {...}.

namespace {

// What Python's repr prints as it is (str.isprintable): every character but the categories
// Other (controls, format, surrogates, private use, unassigned) and Separator, the space aside.
bool py_printable(std::uint32_t cp) {
  if (cp == ' ') return true;
  switch (u_charType(static_cast<UChar32>(cp))) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR: return false;
    default: return true;
  }
}

// Text a printer builds: each piece within the value bound and counted as work before it is added.
class BoundedText {
 public:
  explicit BoundedText(Budget& budget) : budget_(budget) {}
  void add(const std::string& s) {
    budget_.check_size(checked_add(out_.size(), s.size()));
    budget_.work(s.size());
    out_ += s;
  }
  std::string& text() { return out_; }
  std::string take() { return std::move(out_); }

 private:
  Budget& budget_;
  std::string out_;
};

[[noreturn]] void fail_nested() { throw Failure("a value nested more than " + std::to_string(kMaxNesting) + " deep"); }

class Printer {
 public:
  explicit Printer(Budget& budget) : budget_(budget), out_(budget) {}

  void value(const Value& v, bool quoted) {
    switch (v.kind) {
      case Value::Kind::kString:
        if (!quoted) {
          add(v.str());
          return;
        }
        if (v.markup) add("Markup(");  // markupsafe's repr
        string_repr(v.str());
        if (v.markup) add(")");
        return;
      case Value::Kind::kUndefined: add(quoted ? "Undefined" : ""); return;
      case Value::Kind::kNone: add("None"); return;
      case Value::Kind::kBool: add(v.b ? "True" : "False"); return;
      case Value::Kind::kInt: add(std::to_string(v.i)); return;
      case Value::Kind::kFloat: add(py_float(v.f)); return;
      case Value::Kind::kList:
      case Value::Kind::kTuple: sequence(v); return;
      case Value::Kind::kDict: dict(*v.dict); return;
      case Value::Kind::kNamespace:
        add("<Namespace ");
        dict(*v.dict);
        add(">");
        return;
      case Value::Kind::kCallable: add("<function " + v.fn->name + ">"); return;
    }
  }

  std::string take() { return out_.take(); }

 private:
  void add(const std::string& s) { out_.add(s); }

  // Python's repr of a list, tuple or dict that is being printed already (Py_ReprEnter).
  bool reentered(const void* container) const { return std::find(open_.begin(), open_.end(), container) != open_.end(); }

  struct Open {
    Printer& p;
    Open(Printer& printer, const void* container) : p(printer) {
      if (p.open_.size() >= static_cast<std::size_t>(kMaxNesting)) fail_nested();
      p.open_.push_back(container);
    }
    ~Open() { p.open_.pop_back(); }
  };

  void sequence(const Value& v) {
    const bool tuple = v.kind == Value::Kind::kTuple;
    if (reentered(v.list.get())) {
      add(tuple ? "(...)" : "[...]");
      return;
    }
    Open open(*this, v.list.get());
    add(tuple ? "(" : "[");
    for (std::size_t k = 0; k < v.list->size(); ++k) {
      if (k) add(", ");
      value((*v.list)[k], true);
    }
    if (tuple && v.list->size() == 1) add(",");
    add(tuple ? ")" : "]");
  }

  void dict(const Dict& d) {
    if (reentered(&d)) {
      add("{...}");
      return;
    }
    Open open(*this, &d);
    add("{");
    bool first = true;
    for (const auto& [k, v] : d.items) {
      if (!first) add(", ");
      first = false;
      string_repr(k);
      add(": ");
      value(v, true);
    }
    add("}");
  }

  void string_repr(const std::string& s) {
    budget_.work(s.size());
    const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
    const char quote = has_single && !has_double ? '"' : '\'';
    std::string out(1, quote);
    for (std::size_t pos = 0; pos < s.size();) {
      const std::size_t start = pos;
      const std::uint32_t cp = decode_at(s, pos);
      char buf[16];
      if (cp == '\\') out += "\\\\";
      else if (cp == static_cast<std::uint32_t>(quote)) out += std::string("\\") + quote;
      else if (cp == '\n') out += "\\n";
      else if (cp == '\r') out += "\\r";
      else if (cp == '\t') out += "\\t";
      else if (!py_printable(cp)) {
        std::snprintf(buf, sizeof buf, cp < 0x100 ? "\\x%02x" : cp < 0x10000 ? "\\u%04x" : "\\U%08x", cp);
        out += buf;
      } else
        out.append(s, start, pos - start);
      if (out.size() > budget_.max_value_bytes()) fail_too_large();
    }
    add(out + quote);
  }

  Budget& budget_;
  BoundedText out_;
  std::vector<const void*> open_;
};

}  // namespace

std::string repr(const Value& v) {
  Printer p(Budget::current());
  p.value(v, true);
  return p.take();
}

std::string to_str(const Value& v) {
  Printer p(Budget::current());
  p.value(v, false);
  return p.take();
}

// ---------------------------------------------------------------------------------------------
// Equality and order.

namespace {

bool equals_at(const Value& a, const Value& b, int depth) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    if (a.kind == Value::Kind::kFloat && b.kind == Value::Kind::kFloat) return a.f == b.f;
    // An int beside a float: exact, as Python compares them (2**53 + 1 != 2.0**53).
    const double x = a.as_double(), y = b.as_double();
    if (x != y) return false;
    const Value& integral = a.is_integral() ? a : b;
    const double real = a.is_integral() ? y : x;
    return real >= -9.2233720368547758e18 && real < 9.2233720368547758e18 && static_cast<std::int64_t>(real) == integral.as_int();
  }
  if (a.kind != b.kind) return false;
  Budget& budget = Budget::current();
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString:
      budget.work(std::min(a.str().size(), b.str().size()));
      return a.str() == b.str();
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      if (a.list == b.list) return true;
      if (a.list->size() != b.list->size()) return false;
      if (depth >= kMaxNesting) fail_nested();
      for (std::size_t k = 0; k < a.list->size(); ++k) {
        budget.items(1);
        if (!equals_at((*a.list)[k], (*b.list)[k], depth + 1)) return false;
      }
      return true;
    case Value::Kind::kDict:
      if (a.dict == b.dict) return true;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      if (depth >= kMaxNesting) fail_nested();
      for (const auto& [k, v] : a.dict->items) {
        const Value* other = b.dict->find(k);
        if (!other || !equals_at(v, *other, depth + 1)) return false;
      }
      return true;
    default: return a.dict == b.dict && a.fn == b.fn;  // namespaces and functions: the same object
  }
}

int compare_at(const Value& a, const Value& b, const char* op, int depth) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y;
  }
  Budget& budget = Budget::current();
  if (a.is_string() && b.is_string()) {
    budget.work(std::min(a.str().size(), b.str().size()));
    return a.str().compare(b.str()) < 0 ? -1 : a.str().compare(b.str()) > 0;  // UTF-8 bytes order as code points
  }
  if (a.kind == b.kind && a.is_sequence()) {
    if (depth >= kMaxNesting) fail_nested();
    const auto& x = *a.list;
    const auto& y = *b.list;
    for (std::size_t k = 0; k < x.size() && k < y.size(); ++k) {
      budget.items(1);
      if (!equals_at(x[k], y[k], depth + 1)) return compare_at(x[k], y[k], op, depth + 1);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size();
  }
  throw Failure(std::string("'") + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

}  // namespace

bool equals(const Value& a, const Value& b) { return equals_at(a, b, 0); }

int compare(const Value& a, const Value& b, const char* op) { return compare_at(a, b, op, 0); }

namespace {

std::string hash_key_at(const Value& v, int depth) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "U";
    case Value::Kind::kNone: return "N";
    case Value::Kind::kBool:
    case Value::Kind::kInt: return "i" + std::to_string(v.as_int());
    case Value::Kind::kFloat:
      if (std::isfinite(v.f) && v.f == std::floor(v.f) && std::fabs(v.f) < 9.2e18) return "i" + std::to_string(static_cast<std::int64_t>(v.f));
      return "f" + py_float(v.f);
    case Value::Kind::kString:
      Budget::current().work(v.str().size());
      return "s" + std::to_string(v.str().size()) + ":" + v.str();
    case Value::Kind::kTuple: {
      if (depth >= kMaxNesting) fail_nested();
      std::string key = "t" + std::to_string(v.list->size()) + "(";
      for (const auto& item : *v.list) {
        const std::string part = hash_key_at(item, depth + 1);
        Budget::current().check_size(checked_add(key.size(), part.size() + 24));
        Budget::current().work(part.size() + 24);
        key += std::to_string(part.size()) + ":" + part;
      }
      return key + ")";
    }
    case Value::Kind::kNamespace: return "n" + std::to_string(reinterpret_cast<std::uintptr_t>(v.dict.get()));
    case Value::Kind::kCallable: return "c" + std::to_string(reinterpret_cast<std::uintptr_t>(v.fn.get()));
    default: throw Failure("unhashable type: '" + type_name(v) + "'");
  }
}

}  // namespace

std::string hash_key(const Value& v) { return hash_key_at(v, 0); }

// ---------------------------------------------------------------------------------------------
// JSON, as Python's json.dumps writes it.

namespace {

class JsonWriter {
 public:
  JsonWriter(const std::string* indent, bool sort_keys, const std::string& item_sep, const std::string& key_sep)
      : budget_(Budget::current()), indent_(indent), sort_keys_(sort_keys), item_sep_(item_sep), key_sep_(key_sep), out_(budget_) {}

  void value(const Value& v, int level) {
    switch (v.kind) {
      case Value::Kind::kNone: add("null"); return;
      case Value::Kind::kBool: add(v.b ? "true" : "false"); return;
      case Value::Kind::kInt: add(std::to_string(v.i)); return;
      case Value::Kind::kFloat: add(std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : py_float(v.f)); return;
      case Value::Kind::kString: string(v.str()); return;
      case Value::Kind::kList:
      case Value::Kind::kTuple: {
        if (v.list->empty()) {
          add("[]");
          return;
        }
        if (level >= kMaxNesting) fail_nested();
        add("[");
        for (std::size_t k = 0; k < v.list->size(); ++k) {
          if (k) add(item_sep_);
          newline(level + 1);
          value((*v.list)[k], level + 1);
        }
        newline(level);
        add("]");
        return;
      }
      case Value::Kind::kDict: {
        if (v.dict->items.empty()) {
          add("{}");
          return;
        }
        if (level >= kMaxNesting) fail_nested();
        std::vector<const std::pair<std::string, Value>*> items;
        for (const auto& item : v.dict->items) items.push_back(&item);
        budget_.items(items.size());
        if (sort_keys_) std::stable_sort(items.begin(), items.end(), [](auto* x, auto* y) { return x->first < y->first; });
        add("{");
        for (std::size_t k = 0; k < items.size(); ++k) {
          if (k) add(item_sep_);
          newline(level + 1);
          string(items[k]->first);
          add(key_sep_);
          value(items[k]->second, level + 1);
        }
        newline(level);
        add("}");
        return;
      }
      default: throw Failure("Object of type " + type_name(v) + " is not JSON serializable");
    }
  }

  std::string take() { return out_.take(); }

 private:
  void add(const std::string& s) { out_.add(s); }

  void newline(int level) {
    if (!indent_) return;
    // Sized before it is built: a huge indent fails here, not in the allocator.
    const std::uint64_t width = checked_mul(indent_->size(), static_cast<std::uint64_t>(level));
    std::string& out = out_.text();
    budget_.check_size(checked_add(checked_add(out.size(), width), 1));
    budget_.work(width + 1);
    out += '\n';
    for (int k = 0; k < level; ++k) out += *indent_;
  }

  void string(const std::string& s) {
    budget_.work(s.size());
    std::string out = "\"";
    for (const char c : s) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
            out += buf;
          } else
            out += c;
      }
      if (out.size() > budget_.max_value_bytes()) fail_too_large();
    }
    add(out + "\"");
  }

  Budget& budget_;
  const std::string* indent_;
  bool sort_keys_;
  const std::string& item_sep_;
  const std::string& key_sep_;
  BoundedText out_;
};

Value from_json_at(const nlohmann::ordered_json& j, int depth) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<std::int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(INT64_MAX)) return Value::real(static_cast<double>(u));
      return Value::integer(static_cast<std::int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      if (depth >= kMaxNesting) fail_nested();
      List items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json_at(item, depth + 1));
      return Value::make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      if (depth >= kMaxNesting) fail_nested();
      Dict d;
      d.items.reserve(j.size());
      for (const auto& [k, item] : j.items()) d.items.emplace_back(k, from_json_at(item, depth + 1));
      return Value::make_dict(std::move(d));
    }
    default: return Value::none();
  }
}

}  // namespace

std::string to_json(const Value& v, const std::string* indent, bool sort_keys, const std::string& item_separator, const std::string& key_separator) {
  JsonWriter w(indent, sort_keys, item_separator, key_separator);
  w.value(v, 0);
  return w.take();
}

Value from_json(const nlohmann::ordered_json& j) { return from_json_at(j, 0); }

// ---------------------------------------------------------------------------------------------
// Unicode: Python's str methods on ICU's character database.

namespace {

std::u16string to_utf16(const std::string& s) {
  Budget::current().work(checked_mul(s.size(), 2));
  std::u16string out(s.size(), u'\0');
  int32_t length = 0;
  UErrorCode status = U_ZERO_ERROR;
  u_strFromUTF8WithSub(reinterpret_cast<UChar*>(out.data()), static_cast<int32_t>(out.size()), &length, s.data(), static_cast<int32_t>(s.size()),
                       0xFFFD, nullptr, &status);
  if (U_FAILURE(status)) throw Failure("a string is not valid UTF-8");
  out.resize(static_cast<std::size_t>(length));
  return out;
}

std::string to_utf8(const std::u16string& s) {
  std::string out(checked_mul(s.size(), 3), '\0');
  int32_t length = 0;
  UErrorCode status = U_ZERO_ERROR;
  u_strToUTF8WithSub(out.data(), static_cast<int32_t>(out.size()), &length, reinterpret_cast<const UChar*>(s.data()), static_cast<int32_t>(s.size()),
                     0xFFFD, nullptr, &status);
  if (U_FAILURE(status)) throw Failure("a string could not be case-mapped");
  out.resize(static_cast<std::size_t>(length));
  return out;
}

using CaseMapping = int32_t (*)(UChar*, int32_t, const UChar*, int32_t, const char*, UErrorCode*);

// Full case mapping (ß upper-cases to SS), as Python's str.upper and str.lower do.
std::string map_case(const std::string& s, CaseMapping mapping) {
  if (std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
    Budget::current().work(s.size());
    std::string out = s;
    for (auto& c : out) c = static_cast<char>(mapping == u_strToUpper ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
    return out;
  }
  Budget::current().check_size(checked_mul(s.size(), 3));  // a mapping at most triples a string's bytes
  const std::u16string in = to_utf16(s);
  std::u16string out(checked_add(checked_mul(in.size(), 3), 1), u'\0');
  UErrorCode status = U_ZERO_ERROR;
  const int32_t length = mapping(reinterpret_cast<UChar*>(out.data()), static_cast<int32_t>(out.size()), reinterpret_cast<const UChar*>(in.data()),
                                 static_cast<int32_t>(in.size()), "", &status);
  if (U_FAILURE(status)) throw Failure("a string could not be case-mapped");
  out.resize(static_cast<std::size_t>(length));
  return to_utf8(out);
}

std::string one_code_point(std::uint32_t cp) {
  std::string s;
  append_utf8(s, cp);
  return s;
}

// Titlecase of one code point: its title mapping, or where upper-casing it gives several (ß: SS),
// the first of those and the rest lowered (Ss), as Unicode's special casing has it.
std::string title_of(std::uint32_t cp) {
  const std::string upper = map_case(one_code_point(cp), u_strToUpper);
  std::size_t pos = 0;
  decode_at(upper, pos);
  if (pos == upper.size()) return one_code_point(static_cast<std::uint32_t>(u_totitle(static_cast<UChar32>(cp))));
  return upper.substr(0, pos) + map_case(upper.substr(pos), u_strToLower);
}

bool is_cased(std::uint32_t cp) {
  const auto c = static_cast<UChar32>(cp);
  return u_hasBinaryProperty(c, UCHAR_UPPERCASE) || u_hasBinaryProperty(c, UCHAR_LOWERCASE) || u_charType(c) == U_TITLECASE_LETTER;
}

bool is_alpha(std::uint32_t cp) {
  switch (u_charType(static_cast<UChar32>(cp))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER: return true;
    default: return false;
  }
}

int numeric_type(std::uint32_t cp) { return u_getIntPropertyValue(static_cast<UChar32>(cp), UCHAR_NUMERIC_TYPE); }
bool is_digit(std::uint32_t cp) { return numeric_type(cp) == U_NT_DECIMAL || numeric_type(cp) == U_NT_DIGIT; }
bool is_alnum(std::uint32_t cp) { return is_alpha(cp) || numeric_type(cp) != U_NT_NONE; }

// Greek capital sigma lowers to final sigma (ς) at a word's end: after a cased letter and
// before none, case-ignorable characters (apostrophes, accents) skipped, as Python's lower() has it.
bool final_sigma(const std::string& s, std::size_t start, std::size_t end) {
  bool after_cased = false;
  for (std::size_t pos = start; pos > 0;) {
    pos = code_point_before(s, pos);
    std::size_t probe = pos;
    const std::uint32_t cp = decode_at(s, probe);
    if (u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_CASE_IGNORABLE)) continue;
    after_cased = is_cased(cp);
    break;
  }
  if (!after_cased) return false;
  for (std::size_t pos = end; pos < s.size();) {
    const std::uint32_t cp = decode_at(s, pos);
    if (u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_CASE_IGNORABLE)) continue;
    return !is_cased(cp);
  }
  return true;
}

// One code point of `s` ([start, end)) upper-, title- or lower-cased where it stands.
std::string cased_at(const std::string& s, std::size_t start, std::size_t end, std::uint32_t cp, bool title) {
  if (cp < 0x80) return std::string(1, static_cast<char>(title ? std::toupper(static_cast<int>(cp)) : std::tolower(static_cast<int>(cp))));
  Budget::current().work(256);  // ICU's mapping of one code point costs far more than a byte's
  if (title) return title_of(cp);
  if (cp == 0x03A3) return final_sigma(s, start, end) ? "\u03c2" : "\u03c3";
  return map_case(one_code_point(cp), u_strToLower);
}

}  // namespace

std::string py_upper(const std::string& s) { return map_case(s, u_strToUpper); }
std::string py_lower(const std::string& s) { return map_case(s, u_strToLower); }

std::string py_title(const std::string& s) {
  Budget::current().work(s.size());
  std::string out;
  bool previous_cased = false;
  for (std::size_t pos = 0; pos < s.size();) {
    const std::size_t start = pos;
    const std::uint32_t cp = decode_at(s, pos);
    out += cased_at(s, start, pos, cp, !previous_cased);
    previous_cased = is_cased(cp);
    if (out.size() > Budget::current().max_value_bytes()) fail_too_large();
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  Budget::current().work(s.size());
  std::string out;
  for (std::size_t pos = 0; pos < s.size();) {
    const std::size_t start = pos;
    const std::uint32_t cp = decode_at(s, pos);
    out += cased_at(s, start, pos, cp, start == 0);
    if (out.size() > Budget::current().max_value_bytes()) fail_too_large();
  }
  return out;
}

bool py_is(const std::string& s, const std::string& what) {
  Budget::current().work(s.size());
  if (s.empty()) return false;
  bool cased = false;
  for (std::size_t pos = 0; pos < s.size();) {
    const std::uint32_t cp = decode_at(s, pos);
    const auto c = static_cast<UChar32>(cp);
    if (what == "space" && !is_py_space(cp)) return false;
    if (what == "alpha" && !is_alpha(cp)) return false;
    if (what == "digit" && !is_digit(cp)) return false;
    if (what == "alnum" && !is_alnum(cp)) return false;
    if (what == "upper" || what == "lower") {
      // Python: no character of the other case (or titlecase), and at least one of this one.
      const bool upper = u_hasBinaryProperty(c, UCHAR_UPPERCASE), lower = u_hasBinaryProperty(c, UCHAR_LOWERCASE);
      if (u_charType(c) == U_TITLECASE_LETTER || (what == "upper" ? lower : upper)) return false;
      cased = cased || (what == "upper" ? upper : lower);
    }
  }
  return (what != "upper" && what != "lower") || cased;
}

bool py_word_char(std::uint32_t cp) { return cp == '_' || is_alnum(cp); }

}  // namespace loom::formats::jinja
