#pragma once
// What the Jinja renderer's parts share (formats/src/jinja/): the lexer's tokens, the syntax tree
// and the interpreter state its nodes evaluate in, and the helpers the evaluation, the filters and
// the parser call across files. Internal to the formats library.
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "jinja/values.hpp"

namespace loom::formats::jinja {

// ---- lexing (lexer.cpp) ----------------------------------------------------------------------

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

// The template's tokens, Jinja's whitespace control applied. SyntaxError on a malformed tag.
std::vector<Token> tokenize(const std::string& source, const Settings& settings);

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

// ---- evaluation's helpers (runtime.cpp) -------------------------------------------------------

// The render's budget (Budget::current()).
Budget& budget();
[[noreturn]] void fail_undefined(const Value& v);
[[noreturn]] void fail_overflow();

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

// s[start:end] of find, count, startswith and endswith's optional arguments: its bytes and the
// code point it starts at, or nothing where start passes the end (Python then finds nothing, not
// even an empty string).
struct Window {
  std::size_t begin = 0, end = 0;
  std::int64_t first = 0;
};

void charge_search(const std::string& haystack, const std::string& needle);
std::string shown(const std::string& text);
Value bounded(Value v);
Value string_like(const Value& like, std::string text);
Value markup(std::string text);
std::string need_string(const Value& v, const char* what);
std::int64_t need_int(const Value& v, const char* what);
std::size_t byte_of(const std::string& s, std::int64_t k);
List iterate(const Value& v);
std::int64_t length_of(const Value& v);
bool contains(const Value& container, const Value& item);
std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right);
List split_string(const std::string& s, const Value& sep, std::int64_t max_split);
void for_each_line(const std::string& s, const std::function<void(std::size_t begin, std::size_t end, std::size_t next)>& line);
List split_lines(const std::string& s, bool keep_ends);
std::string title_filter(const std::string& s);
std::string replace_all(const std::string& s, const std::string& from, const std::string& to, std::int64_t count);
const Value* named_arg(const CallArgs& args, const char* key);
Value arg(const CallArgs& args, std::size_t index, const char* key, Value fallback = Value::undefined(""));
std::string join_bounded(const List& items, const std::string& separator, const std::function<std::string(std::size_t, const Value&)>& text_of);
bool affix_match(const std::string& s, std::size_t begin, std::size_t end, const Value& affix, bool prefix);
void check_arguments(const std::string& method, const CallArgs& a, std::size_t least, std::size_t most, std::initializer_list<const char*> names = {});
std::optional<Window> window_of(const std::string& s, const CallArgs& a);
Value string_method(const Value& self, const std::string& method, CallArgs& a);
bool is_string_method(const std::string& m);
Value dict_method(const std::shared_ptr<Dict>& d, const std::string& method, CallArgs& a);
Value get_attribute(const Value& obj, const std::string& attr);
std::optional<std::string> code_point_at(const std::string& s, std::int64_t k);
Value get_item(const Value& obj, const Value& key);
Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v);
bool ordered(const Value& a, const Value& b, const std::string& op);
std::pair<double, double> float_divmod(double x, double y);
std::int64_t add_int(std::int64_t x, std::int64_t y);
std::int64_t sub_int(std::int64_t x, std::int64_t y);
std::int64_t mul_int(std::int64_t x, std::int64_t y);
std::int64_t int_power(std::int64_t x, std::int64_t y);
Value repeat(const Value& a, std::int64_t times);
Value arithmetic(const std::string& op, const Value& a, const Value& b);
bool is_dict_method(const std::string& m);

// ---- the syntax tree's nodes (their evaluation: runtime.cpp) ----------------------------------

// ---- expressions -----------------------------------------------------------------------------

struct Literal : Expr {
  Value value;
  Value eval(Interp&) const override;
};

struct Name : Expr {
  std::string name;
  Value eval(Interp& in) const override;
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Interp& in) const override;
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Interp& in) const override;
};

struct Attribute : Expr {
  ExprPtr object;
  std::string attr;
  Value eval(Interp& in) const override;
};

struct Item : Expr {
  ExprPtr object, key;
  Value eval(Interp& in) const override;
};

struct Slice : Expr {
  ExprPtr object, start, stop, step;
  Value eval(Interp& in) const override;
};

struct Args {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> named;
  CallArgs eval(Interp& in) const;
};

struct Call : Expr {
  ExprPtr callee;
  Args args;
  Value eval(Interp& in) const override;
};

Value apply_filter(const std::string& name, const Value& input, CallArgs& args, Interp& in);
bool run_test(const std::string& name, const Value& v, const std::vector<Value>& args, Interp& in);

struct FilterExpr : Expr {
  ExprPtr input;
  FilterCall filter;
  Value eval(Interp& in) const override;
};

struct TestExpr : Expr {
  ExprPtr input;
  std::string test;
  std::vector<ExprPtr> args;
  bool negated = false;
  Value eval(Interp& in) const override;
};

struct Unary : Expr {
  std::string op;
  ExprPtr operand;
  Value eval(Interp& in) const override;
};

struct Binary : Expr {
  std::string op;
  ExprPtr left, right;
  Value eval(Interp& in) const override;
};

struct Compare : Expr {
  ExprPtr first;
  std::vector<std::pair<std::string, ExprPtr>> rest;  // a < b <= c, Python's chain
  Value eval(Interp& in) const override;
};

struct Conditional : Expr {
  ExprPtr test, then, otherwise;
  Value eval(Interp& in) const override;
};

// ---- statements ------------------------------------------------------------------------------

struct Output : Stmt {
  std::string text;
  void exec(Interp& in) const override;
};

struct Print : Stmt {
  ExprPtr value;
  void exec(Interp& in) const override;
};

struct If : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body otherwise;
  void exec(Interp& in) const override;
};

// Assignment targets: a name, a namespace's attribute, or names to unpack a sequence into.
struct Target {
  std::vector<std::string> names;  // several: unpack
  std::string attribute;           // set ns.attr
  bool tuple = false;
};

struct For : Stmt {
  Target target;
  ExprPtr iterable, condition;
  Body body, otherwise;
  void exec(Interp& in) const override;
};

struct LoopControl : Stmt {
  bool is_break = false;
  void exec(Interp& in) const override;
};

struct Set : Stmt {
  Target target;
  ExprPtr value;
  void exec(Interp& in) const override;
};

struct SetBlock : Stmt {
  Target target;
  Body body;
  std::vector<FilterCall> filters;
  void exec(Interp& in) const override;
};

struct FilterBlock : Stmt {
  std::vector<FilterCall> filters;
  Body body;
  void exec(Interp& in) const override;
};

struct Generation : Stmt {
  Body body;
  void exec(Interp& in) const override;
};

struct Macro : Stmt {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // per param, null where none
  Body body;
  void exec(Interp& in) const override;
};

void assign(Interp& in, const Target& target, const Value& v);
Value apply_filters(const std::vector<FilterCall>& filters, Value v, Interp& in);

// ---- filters and tests (filters.cpp) ----------------------------------------------------------

std::vector<Value> attribute_parts(const std::string& path);
Value attribute_path(const Value& v, const std::vector<Value>& parts);
Value select_items(const Value& input, CallArgs& a, Interp& in, bool by_attribute, bool keep);
List sorted_by(List items, const std::function<Value(const Value&)>& key, bool reverse);
std::int64_t truncate_to_int(double d);
Value to_int(const Value& input, const Value& fallback, std::int64_t base);
double round_float(double x, std::int64_t n);
std::int64_t round_int(std::int64_t x, std::int64_t n);
Value round_filter(const Value& input, CallArgs& a);
std::string pad_of(const Value& width, const char* what);
std::string indent_filter(const std::string& text, const Value& width, bool first, bool blank);
Value tojson_filter(const Value& input, CallArgs& a);
std::string join_filter(const Value& input, const std::string& separator, const Value& attribute);
std::string escape_text(const std::string& s);
Value first_or_last(const Value& input, bool first);
Value apply_filter(const std::string& name, const Value& input, CallArgs& a, Interp& in);
bool run_test(const std::string& name, const Value& v, const std::vector<Value>& args, Interp&);
int digit_value(char c);
bool digits_with_underscores(const std::string& s, std::size_t begin, std::size_t end, int base, bool allow_leading_underscore);
std::string without_underscores(const std::string& s);
std::optional<std::int64_t> python_int(const std::string& text, std::int64_t base);
std::optional<double> python_float(const std::string& text);
double power_of_ten(std::int64_t k);
bool remainder_is(const Value& a, const Value& b, std::int64_t r);

// ---- parsing (parser.cpp) ---------------------------------------------------------------------

const std::set<std::string>& filter_names();
const std::set<std::string>& test_names();
const std::set<std::string>& jinja2_filter_names();
const std::set<std::string>& jinja2_test_names();
[[noreturn]] void fail_no_filter(const std::string& name);
[[noreturn]] void fail_no_test(const std::string& name);
// The template's statements from its tokens; `saw_generation` says whether it holds
// {% generation %} blocks. SyntaxError on what the subset does not hold.
Body parse(std::vector<Token> tokens, bool& saw_generation);

// ---- the template (template.cpp) --------------------------------------------------------------

// What HF's environment gives a template: range, namespace, dict, raise_exception, strftime_now.
Scope make_globals();

}  // namespace loom::formats::jinja
