#pragma once
// Values of the Jinja engine (chat/jinja.hpp) with Python's semantics: what prints, what is
// equal, what is true, how numbers format. Private to the engine and its tests.
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace loom::core::jinja {

// A failure while rendering; the engine adds the template's name and line.
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Value;
struct Dict;
struct Interp;
using List = std::vector<Value>;

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> named;
};
using Native = std::function<Value(CallArgs&, Interp&)>;
struct Callable {
  std::string name;
  Native fn;
};

struct Value {
  enum class Kind : std::uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kTuple, kDict, kNamespace, kCallable };
  Kind kind = Kind::kUndefined;
  bool b = false;
  std::int64_t i = 0;
  double f = 0;
  std::string s;  // a string's bytes (UTF-8); for an undefined, what it stands for ("'x' is undefined")
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Callable> fn;

  static Value undefined(std::string why);
  static Value none();
  static Value boolean(bool v);
  static Value integer(std::int64_t v);
  static Value real(double v);
  static Value string(std::string v);
  static Value make_list(List items, bool tuple = false);
  static Value make_dict(Dict d, bool namespace_object = false);
  static Value function(std::string name, Native fn);

  bool defined() const { return kind != Kind::kUndefined; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_sequence() const { return kind == Kind::kList || kind == Kind::kTuple; }
  bool is_number() const { return kind == Kind::kBool || kind == Kind::kInt || kind == Kind::kFloat; }
  bool is_integral() const { return kind == Kind::kBool || kind == Kind::kInt; }
  std::int64_t as_int() const { return kind == Kind::kBool ? (b ? 1 : 0) : i; }
  double as_double() const { return kind == Kind::kFloat ? f : static_cast<double>(as_int()); }
};

struct Dict {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, as Python's dict
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);
};

// Python's type name of a value ("str", "int", "list", ...), for messages.
std::string type_name(const Value& v);
bool truthy(const Value& v);
std::string to_str(const Value& v);   // str(v); an undefined prints as ""
std::string repr(const Value& v);     // repr(v)
std::string py_float(double d);       // float.__repr__: shortest round trip, 1e+16 / 1e-05 past its range
bool equals(const Value& a, const Value& b);
int compare(const Value& a, const Value& b, const char* op);  // <0, 0, >0; Failure where Python raises TypeError
// HF's tojson: json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...).
std::string to_json(const Value& v, int indent, bool sort_keys, const std::string& item_separator, const std::string& key_separator);

Value from_json(const nlohmann::ordered_json& j);

// UTF-8: strings count, index and slice by code point, as Python's str does.
std::vector<std::string> code_points(const std::string& s);
std::size_t code_point_count(const std::string& s);
bool is_py_space(std::uint32_t cp);
std::uint32_t decode_at(const std::string& s, std::size_t& pos);  // advances pos past one code point

}  // namespace loom::core::jinja
