#include "loom/options.hpp"

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace loom {
namespace {

const char* single_type_name(unsigned bit) {
  switch (bit) {
    case kBool: return "boolean";
    case kInt: return "integer";
    case kFloat: return "float";
    case kString: return "string";
    case kStringList: return "list of strings";
    case kIntList: return "list of integers";
    case kStringMap: return "table of strings";
  }
  return "unknown";
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::string option_type_name(unsigned types) {
  std::vector<std::string> names;
  for (unsigned bit = 1; bit <= kStringMap; bit <<= 1)
    if (types & bit) names.emplace_back(single_type_name(bit));
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += (i + 1 == names.size()) ? " or " : ", ";
    out += names[i];
  }
  return out;
}

unsigned option_value_type(const OptionValue& value) {
  static constexpr unsigned kByIndex[] = {kBool, kInt, kFloat, kString, kStringList, kIntList, kStringMap};
  return kByIndex[value.index()];
}

std::string format_option_value(const OptionValue& value) {
  struct Formatter {
    std::string operator()(bool v) const { return v ? "true" : "false"; }
    std::string operator()(std::int64_t v) const { return std::to_string(v); }
    std::string operator()(double v) const {
      std::ostringstream s;
      s << v;
      std::string out = s.str();
      if (out.find_first_of(".eEn") == std::string::npos) out += ".0";  // keep it a TOML float
      return out;
    }
    std::string operator()(const std::string& v) const { return quote(v); }
    std::string operator()(const StringList& v) const {
      std::string out = "[";
      for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + quote(v[i]);
      return out + "]";
    }
    std::string operator()(const IntList& v) const {
      std::string out = "[";
      for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
      return out + "]";
    }
    std::string operator()(const StringMap& v) const {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, val] : v) {
        out += (first ? " " : ", ") + quote(k) + " = " + quote(val);
        first = false;
      }
      return out + (v.empty() ? "}" : " }");
    }
  };
  return std::visit(Formatter{}, value);
}

OptionSpec OptionSpec::boolean(std::string name, bool def, std::string doc) {
  return any_of(std::move(name), kBool, OptionValue{def}, std::move(doc));
}
OptionSpec OptionSpec::integer(std::string name, std::optional<std::int64_t> def, std::string doc) {
  std::optional<OptionValue> d;
  if (def) d = *def;
  return any_of(std::move(name), kInt, d, std::move(doc));
}
OptionSpec OptionSpec::real(std::string name, std::optional<double> def, std::string doc) {
  std::optional<OptionValue> d;
  if (def) d = *def;
  return any_of(std::move(name), kFloat, d, std::move(doc));
}
OptionSpec OptionSpec::string(std::string name, std::optional<std::string> def, std::string doc) {
  std::optional<OptionValue> d;
  if (def) d = *def;
  return any_of(std::move(name), kString, d, std::move(doc));
}
OptionSpec OptionSpec::string_list(std::string name, std::optional<StringList> def, std::string doc) {
  std::optional<OptionValue> d;
  if (def) d = *def;
  return any_of(std::move(name), kStringList, d, std::move(doc));
}
OptionSpec OptionSpec::string_map(std::string name, std::string doc) {
  return any_of(std::move(name), kStringMap, std::nullopt, std::move(doc));
}
OptionSpec OptionSpec::any_of(std::string name, unsigned types, std::optional<OptionValue> def,
                              std::string doc) {
  if (def && !(option_value_type(*def) & types))
    throw std::logic_error("option '" + name + "': default is a " +
                           option_type_name(option_value_type(*def)) + ", declared " +
                           option_type_name(types));
  OptionSpec spec;
  spec.name = std::move(name);
  spec.types = types;
  spec.default_value = std::move(def);
  spec.doc = std::move(doc);
  return spec;
}

OptionSpec& OptionSpec::require() {
  required = true;
  return *this;
}
OptionSpec& OptionSpec::at_least(double v) {
  min = v;
  return *this;
}
OptionSpec& OptionSpec::at_most(double v) {
  max = v;
  return *this;
}
OptionSpec& OptionSpec::one_of(StringList allowed) {
  choices = std::move(allowed);
  return *this;
}

OptionSpec& OptionSpec::path() {
  is_path = true;
  return *this;
}

const OptionValue& Options::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) throw std::logic_error("option '" + name + "' is not set (plugin bug: declare a default or check has())");
  return it->second;
}

namespace {
template <typename T>
const T& typed(const Options& options, const std::string& name) {
  const auto& value = options.get(name);
  if (const T* v = std::get_if<T>(&value)) return *v;
  throw std::logic_error("option '" + name + "' holds a " + option_type_name(option_value_type(value)) +
                         ", read with the wrong accessor (plugin bug)");
}
}  // namespace

bool Options::get_bool(const std::string& name) const { return typed<bool>(*this, name); }
std::int64_t Options::get_int(const std::string& name) const { return typed<std::int64_t>(*this, name); }
double Options::get_float(const std::string& name) const { return typed<double>(*this, name); }
const std::string& Options::get_string(const std::string& name) const { return typed<std::string>(*this, name); }
const StringList& Options::get_string_list(const std::string& name) const { return typed<StringList>(*this, name); }
const IntList& Options::get_int_list(const std::string& name) const { return typed<IntList>(*this, name); }
const StringMap& Options::get_string_map(const std::string& name) const { return typed<StringMap>(*this, name); }

}  // namespace loom
