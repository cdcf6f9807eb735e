#include "chat/jinja_value.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace loom::core::jinja {

Value Value::undefined(std::string why) {
  Value v;
  v.s = std::move(why);
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
  v.s = std::move(x);
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
  return v;
}
Value Value::function(std::string name, Native fn) {
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  for (auto& [k, old] : items)
    if (k == key) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

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
    case Value::Kind::kString: return !v.s.empty();
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
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision - 1, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  // buf: [-]D[.DDD]e[+-]XX
  std::string text(buf);
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
    char exp[8];
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
  for (int k = 0; k < extra && pos < s.size(); ++k, ++pos) cp = (cp << 6) | (static_cast<unsigned char>(s[pos]) & 0x3Fu);
  return cp;
}

std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  for (std::size_t pos = 0; pos < s.size();) {
    const std::size_t start = pos;
    decode_at(s, pos);
    out.push_back(s.substr(start, pos - start));
  }
  return out;
}

std::size_t code_point_count(const std::string& s) {
  std::size_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

bool is_py_space(std::uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

namespace {

// Characters Python's repr escapes: controls, separators and the common format characters.
bool py_printable(std::uint32_t cp) {
  if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) return false;
  if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) || (cp >= 0x205F && cp <= 0x2064) ||
      (cp >= 0x2066 && cp <= 0x206F) || cp == 0x3000 || cp == 0xFEFF || (cp >= 0xFFF9 && cp <= 0xFFFB) || (cp >= 0xE000 && cp <= 0xF8FF) ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return false;
  return true;
}

std::string repr_string(const std::string& s) {
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
      out += s.substr(start, pos - start);
  }
  return out + quote;
}

std::string join_repr(const List& items, const char* open, const char* close, bool one_tuple) {
  std::string out = open;
  for (std::size_t k = 0; k < items.size(); ++k) out += (k ? ", " : "") + repr(items[k]);
  if (one_tuple && items.size() == 1) out += ",";
  return out + close;
}

std::string dict_repr(const Dict& d) {
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : d.items) {
    out += (first ? "" : ", ") + repr_string(k) + ": " + repr(v);
    first = false;
  }
  return out + "}";
}

}  // namespace

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString: return repr_string(v.s);
    case Value::Kind::kUndefined: return "Undefined";
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.b ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.i);
    case Value::Kind::kFloat: return py_float(v.f);
    case Value::Kind::kString: return v.s;
    case Value::Kind::kList: return join_repr(*v.list, "[", "]", false);
    case Value::Kind::kTuple: return join_repr(*v.list, "(", ")", true);
    case Value::Kind::kDict: return dict_repr(*v.dict);
    case Value::Kind::kNamespace: return "<Namespace " + dict_repr(*v.dict) + ">";
    case Value::Kind::kCallable: return "<function " + v.fn->name + ">";
  }
  return "";
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_double() == b.as_double();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.s == b.s;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      if (a.list->size() != b.list->size()) return false;
      for (std::size_t k = 0; k < a.list->size(); ++k)
        if (!equals((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::kDict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* other = b.dict->find(k);
        if (!other || !equals(v, *other)) return false;
      }
      return true;
    default: return a.dict == b.dict && a.fn == b.fn;
  }
}

int compare(const Value& a, const Value& b, const char* op) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y;
  }
  if (a.is_string() && b.is_string()) return a.s.compare(b.s) < 0 ? -1 : a.s.compare(b.s) > 0;  // UTF-8 bytes order as code points
  if (a.kind == b.kind && a.is_sequence()) {
    const auto& x = *a.list;
    const auto& y = *b.list;
    for (std::size_t k = 0; k < x.size() && k < y.size(); ++k)
      if (!equals(x[k], y[k])) return compare(x[k], y[k], op);
    return x.size() < y.size() ? -1 : x.size() > y.size();
  }
  throw Failure(std::string("'") + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

namespace {

std::string json_string(const std::string& s) {
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
  }
  return out + "\"";
}

void dump(const Value& v, int indent, bool sort_keys, const std::string& item_sep, const std::string& key_sep, int level, std::string& out) {
  const auto newline = [&](int at) {
    if (indent >= 0) out += "\n" + std::string(static_cast<std::size_t>(indent * at), ' ');
  };
  switch (v.kind) {
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.b ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.i); return;
    case Value::Kind::kFloat:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : py_float(v.f);
      return;
    case Value::Kind::kString: out += json_string(v.s); return;
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += "[";
      for (std::size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += item_sep;
        newline(level + 1);
        dump((*v.list)[k], indent, sort_keys, item_sep, key_sep, level + 1, out);
      }
      newline(level);
      out += "]";
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : v.dict->items) items.push_back(&item);
      if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* x, auto* y) { return x->first < y->first; });
      out += "{";
      for (std::size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        newline(level + 1);
        out += json_string(items[k]->first) + key_sep;
        dump(items[k]->second, indent, sort_keys, item_sep, key_sep, level + 1, out);
      }
      newline(level);
      out += "}";
      return;
    }
    default: throw Failure("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, int indent, bool sort_keys, const std::string& item_separator, const std::string& key_separator) {
  std::string out;
  dump(v, indent, sort_keys, item_separator, key_separator, 0, out);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
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
      List items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item));
      return Value::make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      d.items.reserve(j.size());
      for (const auto& [k, item] : j.items()) d.items.emplace_back(k, from_json(item));
      return Value::make_dict(std::move(d));
    }
    default: return Value::none();
  }
}

}  // namespace loom::core::jinja
