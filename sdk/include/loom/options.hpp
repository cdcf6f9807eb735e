#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "loom/export.hpp"

namespace loom {

// Value types an option may take. A spec may accept several (a bitmask), e.g. a template given as a
// string or as a list of token ids.
enum OptionType : unsigned {
  kBool = 1u << 0,
  kInt = 1u << 1,
  kFloat = 1u << 2,  // an integer literal is accepted and widened
  kString = 1u << 3,
  kStringList = 1u << 4,
  kIntList = 1u << 5,
  kStringMap = 1u << 6,  // inline table of string values: { "cuda:0" = "14GiB" }
};

using StringList = std::vector<std::string>;
using IntList = std::vector<std::int64_t>;
using StringMap = std::map<std::string, std::string>;
using OptionValue = std::variant<bool, std::int64_t, double, std::string, StringList, IntList, StringMap>;

// Human name of a type mask: "integer", "string or list of integers".
LOOM_API std::string option_type_name(unsigned types);
// The single type bit a value has.
LOOM_API unsigned option_value_type(const OptionValue& value);
// TOML spelling of a value, for docs and messages: 42, "left", ["q_proj", "v_proj"].
LOOM_API std::string format_option_value(const OptionValue& value);

// One declared option: name, accepted types, default, one-line doc and the bounds the host checks
// before the plugin sees the value. Built with the named constructors and chained setters:
//   OptionSpec::integer("r", 8, "LoRA rank").at_least(1)
struct LOOM_API OptionSpec {
  std::string name;
  unsigned types = 0;
  std::optional<OptionValue> default_value;  // absent: optional and unset, unless `required`
  std::string doc;
  bool required = false;
  std::optional<double> min;  // numbers: value bounds; lists: length bounds
  std::optional<double> max;
  StringList choices;         // strings: the only values allowed
  bool is_path = false;       // strings: a relative path is resolved against the pipeline's folder

  static OptionSpec boolean(std::string name, bool def, std::string doc);
  static OptionSpec integer(std::string name, std::optional<std::int64_t> def, std::string doc);
  static OptionSpec real(std::string name, std::optional<double> def, std::string doc);
  static OptionSpec string(std::string name, std::optional<std::string> def, std::string doc);
  static OptionSpec string_list(std::string name, std::optional<StringList> def, std::string doc);
  static OptionSpec string_map(std::string name, std::string doc);
  // Accepts any of `types`; the default (if any) must be one of them.
  static OptionSpec any_of(std::string name, unsigned types, std::optional<OptionValue> def, std::string doc);

  OptionSpec& require();
  OptionSpec& at_least(double v);
  OptionSpec& at_most(double v);
  OptionSpec& one_of(StringList allowed);
  OptionSpec& path();
};

// Validated option values handed to a plugin factory: every declared option with a default is
// present; values have the declared types (an integer given for a float option arrives as double).
class LOOM_API Options {
 public:
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  void set(const std::string& name, OptionValue value) { values_[name] = std::move(value); }
  const std::map<std::string, OptionValue>& values() const { return values_; }

  // Typed access. Asking for an option the schema did not declare, or with a type it cannot
  // have, is a plugin bug and throws std::logic_error naming the option.
  bool get_bool(const std::string& name) const;
  std::int64_t get_int(const std::string& name) const;
  double get_float(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;
  const StringList& get_string_list(const std::string& name) const;
  const IntList& get_int_list(const std::string& name) const;
  const StringMap& get_string_map(const std::string& name) const;
  const OptionValue& get(const std::string& name) const;

 private:
  std::map<std::string, OptionValue> values_;
};

}  // namespace loom
