// The evaluation: values' operations with Python's semantics (strings, arithmetic, attributes and
// items, slices), and each node of the syntax tree evaluated.
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
Value arg(const CallArgs& args, std::size_t index, const char* key, Value fallback) {
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
void check_arguments(const std::string& method, const CallArgs& a, std::size_t least, std::size_t most, std::initializer_list<const char*> names) {
  const std::size_t given = a.positional.size() + a.named.size();
  for (const auto& named : a.named)
    if (std::none_of(names.begin(), names.end(), [&](const char* n) { return named.first == n; }))
      throw Failure("str." + method + "() takes no keyword argument '" + named.first + "'");
  if (given < least || given > most)
    throw Failure("str." + method + "() takes " + (least == most ? std::to_string(least) : std::to_string(least) + " to " + std::to_string(most)) +
                  " arguments (" + std::to_string(given) + " given)");
}


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

// ---- expressions and statements ----------------------------------------------------------------

Value Literal::eval(Interp&) const { return value; }

Value Name::eval(Interp& in) const { return in.lookup(name); }

Value ListExpr::eval(Interp& in) const {
  in.budget.items(items.size());
  List out;
  for (const auto& e : items) out.push_back(e->evaluate(in));
  return Value::make_list(std::move(out), tuple);
}

Value DictExpr::eval(Interp& in) const {
  Dict d;
  for (const auto& [k, v] : items) {
    const Value key = k->evaluate(in);
    if (!key.is_string()) throw Failure("dictionary keys other than strings are not supported (got " + type_name(key) + ")");
    in.budget.work(key.str().size());  // the key is copied into the dict
    d.set(key.str(), v->evaluate(in));
  }
  return Value::make_dict(std::move(d));
}

Value Attribute::eval(Interp& in) const {
  const Value obj = object->evaluate(in);
  in.line = line;
  return get_attribute(obj, attr);
}

Value Item::eval(Interp& in) const {
  const Value obj = object->evaluate(in);
  const Value k = key->evaluate(in);
  in.line = line;
  return get_item(obj, k);
}

Value Slice::eval(Interp& in) const {
  const Value obj = object->evaluate(in);
  const auto opt = [&](const ExprPtr& e) { return e ? e->evaluate(in) : Value::none(); };
  const Value a = opt(start), b = opt(stop), c = opt(step);
  in.line = line;
  return slice(obj, a, b, c);
}

CallArgs Args::eval(Interp& in) const {
  CallArgs a;
  for (const auto& e : positional) a.positional.push_back(e->evaluate(in));
  for (const auto& [k, e] : named) a.named.emplace_back(k, e->evaluate(in));
  return a;
}

Value Call::eval(Interp& in) const {
  const Value f = callee->evaluate(in);
  CallArgs a = args.eval(in);
  in.line = line;
  if (f.kind == Value::Kind::kUndefined) fail_undefined(f);
  if (f.kind != Value::Kind::kCallable) throw Failure("'" + type_name(f) + "' object is not callable");
  in.step();
  return bounded(f.fn->fn(a, in));
}

Value FilterExpr::eval(Interp& in) const {
  const Value v = input->evaluate(in);
  CallArgs a;
  for (const auto& e : filter.args) a.positional.push_back(e->evaluate(in));
  for (const auto& [k, e] : filter.kwargs) a.named.emplace_back(k, e->evaluate(in));
  in.line = line;
  return bounded(apply_filter(filter.name, v, a, in));
}

Value TestExpr::eval(Interp& in) const {
  const Value v = input->evaluate(in);
  std::vector<Value> a;
  for (const auto& e : args) a.push_back(e->evaluate(in));
  in.line = line;
  return Value::boolean(run_test(test, v, a, in) != negated);
}

Value Unary::eval(Interp& in) const {
  const Value v = operand->evaluate(in);
  if (op == "not") return Value::boolean(!truthy(v));
  in.line = line;
  if (!v.defined()) fail_undefined(v);
  if (!v.is_number()) throw Failure("bad operand type for unary " + op + ": '" + type_name(v) + "'");
  if (op == "+") return v.kind == Value::Kind::kFloat ? v : Value::integer(v.as_int());
  if (v.kind == Value::Kind::kFloat) return Value::real(-v.f);
  return Value::integer(sub_int(0, v.as_int()));
}

Value Binary::eval(Interp& in) const {
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

Value Compare::eval(Interp& in) const {
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

Value Conditional::eval(Interp& in) const {
  if (truthy(test->evaluate(in))) return then->evaluate(in);
  return otherwise ? otherwise->evaluate(in) : Value::undefined("the conditional expression has no else");
}

void Output::exec(Interp& in) const { in.write(text); }

void Print::exec(Interp& in) const { in.write(to_str(value->evaluate(in))); }

void If::exec(Interp& in) const {
  for (const auto& [test, body] : branches)
    if (truthy(test->evaluate(in))) {
      in.exec(body);
      return;
    }
  in.exec(otherwise);
}

void For::exec(Interp& in) const {
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

void LoopControl::exec(Interp& in) const { in.flow = is_break ? Interp::Flow::kBreak : Interp::Flow::kContinue; }

void Set::exec(Interp& in) const {
  const Value v = value->evaluate(in);
  in.line = line;
  assign(in, target, v);
}

void SetBlock::exec(Interp& in) const {
  const Value v = apply_filters(filters, Value::string(in.capture(body)), in);
  assign(in, target, v);
}

void FilterBlock::exec(Interp& in) const { in.write(to_str(apply_filters(filters, Value::string(in.capture(body)), in))); }

void Generation::exec(Interp& in) const {
  const bool tracked = in.out == in.main_out;
  const std::size_t begin = in.out->size();
  in.exec(body);
  if (tracked && in.out->size() > begin) in.spans.emplace_back(begin, in.out->size());
}

void Macro::exec(Interp& in) const {
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

}  // namespace loom::formats::jinja
