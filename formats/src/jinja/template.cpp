// The template: parsed once, rendered with a context under the render's budget; HF's globals.
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
    impl->body = parse(tokenize(source, impl->settings), impl->generation);
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

}  // namespace loom::formats::jinja
