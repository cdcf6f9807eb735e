#pragma once
// Values of the Jinja engine (chat/jinja.hpp) with Python's semantics: what prints, what is
// equal, what is true, how numbers format. Private to the engine and its tests.
//
// Strings are shared and immutable (as Python's are), so copying a value never copies its bytes.
// Every helper here counts what it reads and builds against the render's Budget.
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/formats/jinja.hpp"

namespace loom::formats::jinja {

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
  bool markup = false;  // a string jinja2 holds as Markup (escape, safe): what is added to it is escaped
  std::int64_t i = 0;
  double f = 0;
  std::shared_ptr<const std::string> text;  // a string's bytes (UTF-8); for an undefined, what it stands for
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Callable> fn;

  Value() = default;
  Value(const Value&) = default;
  Value(Value&&) noexcept = default;
  Value& operator=(const Value&) = default;
  Value& operator=(Value&&) noexcept = default;
  // Frees nested lists and dicts one at a time, never recursively: a list nested a million deep
  // would otherwise overflow the stack as it goes.
  ~Value();

  static Value undefined(std::string why);
  static Value none();
  static Value boolean(bool v);
  static Value integer(std::int64_t v);
  static Value real(double v);
  static Value string(std::string v);
  static Value make_list(List items, bool tuple = false);
  static Value make_dict(Dict d, bool namespace_object = false);
  static Value function(std::string name, Native fn);

  const std::string& str() const;
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

// What one render may still spend (Settings' bounds). The render installs it on its thread for
// its duration (Budget::Active), and every helper charges the one installed, so no helper needs
// it passed in; outside a render the helpers run unbounded in work, bounded in value size.
class Budget {
 public:
  explicit Budget(const Settings& settings);
  Budget(const Budget&) = delete;
  Budget& operator=(const Budget&) = delete;
  ~Budget();  // empties the namespaces the render made, so cycles through them are freed

  void step();                   // a statement, a loop iteration, a call
  void work(std::uint64_t bytes);  // bytes read, copied or built
  void items(std::uint64_t n) { work(n * sizeof(Value)); }
  // A value of `bytes` may be built (checked before it is allocated).
  void check_size(std::uint64_t bytes) const;
  std::size_t max_value_bytes() const { return settings_.max_value_bytes; }
  const Settings& settings() const { return settings_; }
  void remember_namespace(const std::shared_ptr<Dict>& ns) {
    work(64);  // the namespace's block outlives it while this weak reference does
    namespaces_.push_back(ns);
  }

  // Runtime nesting (blocks, expressions, calls): bounded so that no template reaches the stack's end.
  void enter();
  void leave() { --nesting_; }

  static Budget& current();

  class Active {
   public:
    explicit Active(Budget& budget);
    ~Active();
    Active(const Active&) = delete;
    Active& operator=(const Active&) = delete;

   private:
    Budget* previous_;
  };

 private:
  Settings settings_;
  std::uint64_t steps_ = 0, work_ = 0;
  int nesting_ = 0;
  const char* stack_top_;  // the render's frame: nesting is also bounded by the stack it takes
  std::vector<std::weak_ptr<Dict>> namespaces_;
};

// Sizes in arithmetic that cannot wrap: past the value bound (or past 2^64) is a Failure naming it.
std::uint64_t checked_add(std::uint64_t a, std::uint64_t b);
std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b);
[[noreturn]] void fail_too_large();

// Containers nested deeper than this are refused where Python would hit its recursion limit
// (printing, comparing, JSON); parsing bounds expressions and blocks the same.
inline constexpr int kMaxNesting = 200;

// Python's type name of a value ("str", "int", "list", ...), for messages.
std::string type_name(const Value& v);
bool truthy(const Value& v);
std::string to_str(const Value& v);   // str(v); an undefined prints as ""
std::string repr(const Value& v);     // repr(v)
std::string py_float(double d);       // float.__repr__: shortest round trip, 1e+16 / 1e-05 past its range
bool equals(const Value& a, const Value& b);
int compare(const Value& a, const Value& b, const char* op);  // <0, 0, >0; Failure where Python raises TypeError
// HF's tojson: json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...);
// `indent` empty: None (one line).
std::string to_json(const Value& v, const std::string* indent, bool sort_keys, const std::string& item_separator, const std::string& key_separator);
// A key for Python's hash of a value (sets, unique): equal values (1, 1.0, True) share one;
// Failure for what Python cannot hash (lists, dicts).
std::string hash_key(const Value& v);

Value from_json(const nlohmann::ordered_json& j);

// UTF-8: strings count, index and slice by code point, as Python's str does.
std::size_t code_point_count(const std::string& s);
std::size_t code_point_before(const std::string& s, std::size_t end);  // the start of the code point ending at `end` (> 0)
bool is_py_space(std::uint32_t cp);
std::uint32_t decode_at(const std::string& s, std::size_t& pos);  // advances pos past one code point
void append_utf8(std::string& out, std::uint32_t cp);

// Python's str methods where Unicode matters (ICU's character database stands for Python's).
std::string py_upper(const std::string& s);
std::string py_lower(const std::string& s);
std::string py_title(const std::string& s);       // str.title()
std::string py_capitalize(const std::string& s);  // str.capitalize()
// str.isupper() and the like: "upper", "lower", "alpha", "digit", "alnum", "space".
bool py_is(const std::string& s, const std::string& what);
bool py_word_char(std::uint32_t cp);  // re's \w: alphanumeric (str.isalnum) or _

}  // namespace loom::formats::jinja
