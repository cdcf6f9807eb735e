// The parser: tokens into the syntax tree, the subset's statements and expressions with
// Python's precedence; what the subset does not hold is a SyntaxError naming its line.
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

namespace {

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

}  // namespace

Body parse(std::vector<Token> tokens, bool& saw_generation) {
  Parser parser(std::move(tokens));
  Body body = parser.parse_template();
  saw_generation = parser.saw_generation;
  return body;
}

}  // namespace loom::formats::jinja
