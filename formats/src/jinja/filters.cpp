// Filters and tests, as jinja2's (and transformers' tojson) behave, and Python's number parsing
// for int and float.
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

}  // namespace loom::formats::jinja
