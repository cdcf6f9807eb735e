#include "config/pipeline.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <fstream>
#include <map>
#include <sstream>
#include <system_error>

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include "loom/devices.hpp"
#include "loom/error.hpp"
#include "loom/kit/hub_cache.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/utf8.hpp"
#include "chat/chat_data.hpp"
#include "config/data.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace {

// A pipeline is a few KiB; a bound keeps a hostile or mistaken path (a model file, /dev/zero)
// from being read whole into memory.
constexpr std::uintmax_t kMaxPipelineBytes = 4u << 20;

const std::vector<std::string> kSections = {"run",     "model",     "tokenizer", "data",  "objective", "reward", "collator",
                                            "adapter", "placement", "parallel",  "train", "plugins"};

std::string quoted_list(const std::vector<std::string>& items) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + ("'" + items[i] + "'");
  return out.empty() ? "none" : out;
}

// Keys users bring from transformers' TrainingArguments, TRL, axolotl and torchtune, and what loom
// calls them: a section and the key (or the setting) to write there.
const std::map<std::string, std::pair<std::string, std::string>>& foreign_keys() {
  static const std::map<std::string, std::pair<std::string, std::string>> names = {
      {"learning_rate", {"train", "lr"}},
      {"gradient_accumulation_steps", {"train", "grad_accum"}},
      {"num_train_epochs", {"train", "epochs"}},
      {"num_epochs", {"train", "epochs"}},
      {"per_device_train_batch_size", {"train", "batch_size"}},
      {"micro_batch_size", {"train", "batch_size"}},
      {"train_batch_size", {"train", "batch_size"}},
      {"eval_steps", {"train", "eval_every"}},
      {"evaluation_strategy", {"train", "eval_every"}},
      {"eval_strategy", {"train", "eval_every"}},
      {"logging_steps", {"train", "log_every"}},
      {"save_steps", {"train", "checkpoint_every"}},
      {"save_total_limit", {"train", "keep_checkpoints"}},
      {"metric_for_best_model", {"train", "best_metric"}},
      {"load_best_model_at_end", {"train", "best_metric = \"eval_loss\""}},
      {"lr_scheduler_type", {"train", "scheduler"}},
      {"lr_scheduler", {"train", "scheduler"}},
      {"optim", {"train", "optimizer"}},
      {"cosine_min_lr_ratio", {"train", "min_lr_ratio"}},
      {"min_lr_rate", {"train", "min_lr_ratio"}},
      {"num_cycles", {"train", "cycles"}},
      {"adam_eps", {"train", "adam_epsilon"}},
      {"gradient_checkpointing", {"train", "activation_checkpointing = \"every-layer\""}},
      {"max_seq_length", {"data", "max_length"}},
      {"val_set_size", {"data", "eval_split"}},
      {"test_size", {"data", "eval_split"}},
      {"max_seq_len", {"data", "max_length"}},
      {"sequence_len", {"data", "max_length"}},
      {"seq_length", {"data", "max_length"}},
      {"dataset_text_field", {"data", "format = \"{FIELD}\""}},
      {"bf16", {"run", "dtype = \"bf16\""}},
      {"fp16", {"run", "dtype = \"fp16\""}},
      {"torch_dtype", {"run", "dtype"}},
      {"lora_r", {"adapter", "r"}},
      {"lora_alpha", {"adapter", "alpha"}},
      {"lora_dropout", {"adapter", "dropout"}},
      {"lora_target_modules", {"adapter", "target_modules"}},
      {"base_model", {"model", "path"}},
      {"model_name_or_path", {"model", "path"}},
      {"pretrained_model_name_or_path", {"model", "path"}},
  };
  return names;
}

// toml++ 3.3's whitespace table reaches __builtin_unreachable for many non-ASCII code points
// (U+00A1..U+0499, U+2FBE..U+33B7 but U+3000; found by fuzzing under UBSan), and it asks that table
// about the characters of keys and bare values and about the first character after a line-ending
// backslash in a multi-line basic string. So before parsing, text is checked and made safe:
// non-ASCII outside strings and comments is an error (it is not TOML 1.0 anyway), and a non-ASCII
// character after a line-ending backslash is written as its \u escape, the same string. (Columns
// after such an escape on its line are off by a few in messages.)
struct TomlText {
  std::string text;
  // The first thing refused before parsing: line, column and what it is.
  struct Problem {
    int line = 0, column = 0;
    bool non_ascii = false;  // outside strings and comments; else a bad escape
    std::string message;
  };
  std::optional<Problem> problem;
};

TomlText toml_safe(std::string_view t) {
  TomlText out;
  out.text.reserve(t.size());
  int line = 1, col = 1;
  std::size_t i = 0;
  bool line_start = true;  // nothing but whitespace since the last newline
  char last = '\n';        // the last character outside whitespace, strings and comments
  const auto step = [&] {
    if (t[i] == '\n') line += 1, col = 1;
    else if ((static_cast<unsigned char>(t[i]) & 0xC0) != 0x80) ++col;
    out.text.push_back(t[i]);
    ++i;
  };
  while (i < t.size()) {
    const char c = t[i];
    if (c == '#') {
      while (i < t.size() && t[i] != '\n') step();
    } else if (c == '\n') {
      line_start = true;
      step();
    } else if (c == ' ' || c == '\t' || c == '\r') {
      step();
    } else if ((c == '"' || c == '\'') && (line_start || std::string_view("=[,{.").find(last) != std::string_view::npos)) {
      // A string starts only where TOML allows one; inside an invalid bare value the parser reads on.
      const bool multi_line = t.compare(i, 3, std::string(3, c)) == 0;
      const std::string delimiter = multi_line ? std::string(3, c) : std::string(1, c);
      for (std::size_t k = 0; k < delimiter.size(); ++k) step();
      while (i < t.size()) {
        if (c == '"' && t[i] == '\\') {
          const std::size_t after = t.find_first_not_of(" \t", i + 1);
          if (multi_line && after != std::string_view::npos && (t[after] == '\n' || t[after] == '\r')) {
            // A line-ending backslash: the parser skips whitespace up to the next character.
            step();  // the backslash
            while (i < t.size() && (t[i] == ' ' || t[i] == '\t' || t[i] == '\r' || t[i] == '\n')) step();
            if (i < t.size() && static_cast<unsigned char>(t[i]) >= 0x80) {
              const auto lead = static_cast<unsigned char>(t[i]);
              const std::size_t n = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
              std::uint32_t cp = lead & (n == 4 ? 0x07 : n == 3 ? 0x0F : 0x1F);
              for (std::size_t k = 1; k < n && i + k < t.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(t[i + k]) & 0x3F);
              char escape[16];
              std::snprintf(escape, sizeof escape, cp > 0xFFFF ? "\\U%08X" : "\\u%04X", static_cast<unsigned>(cp));
              out.text += escape;
              i += std::min(n, t.size() - i);
              ++col;
            }
          } else if (multi_line && i + 1 < t.size() && static_cast<unsigned char>(t[i + 1]) >= 0x80) {
            // Not an escape in TOML, and toml++ would ask its whitespace table about the character.
            out.problem = TomlText::Problem{line, col, false,
                                            "a backslash followed by a non-ASCII character is not a TOML escape (write \\\\ for a backslash)"};
            return out;
          } else {  // an escape: the next character is the string's
            step();
            if (i < t.size()) step();
          }
        } else if (t.compare(i, delimiter.size(), delimiter) == 0) {
          for (std::size_t k = 0; k < delimiter.size(); ++k) step();
          break;
        } else if (!multi_line && t[i] == '\n') {
          break;  // unterminated; the parser says so
        } else {
          step();
        }
      }
      line_start = false;
      last = '"';
    } else if (static_cast<unsigned char>(c) >= 0x80) {
      out.problem = TomlText::Problem{line, col, true,
                                      "a non-ASCII character outside a string or comment (TOML keys and values other than strings are ASCII)"};
      return out;
    } else {
      line_start = false;
      last = c;
      step();
    }
  }
  return out;
}

// The text with each non-ASCII code point replaced by one ASCII letter: the same structure and the
// same positions (toml++ counts columns in code points), and nothing toml++'s whitespace table
// mishandles. toml_safe() judges strings by a scan that is right for valid TOML only, while toml++
// reads ahead through quotes inside invalid values (a bare value is scanned up to its terminator),
// so a document is parsed in this form first: only one whose structure is valid TOML reaches the
// parser with its real characters.
std::string ascii_stand_in(std::string_view t) {
  std::string out;
  out.reserve(t.size());
  for (const char c : t) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x80) out.push_back(c);
    else if ((byte & 0xC0) != 0x80) out.push_back('a');  // a code point's first byte; its continuation bytes are dropped
  }
  return out;
}

Location location_of(const std::string& file, const toml::source_region& region) {
  return {file, static_cast<int>(region.begin.line), static_cast<int>(region.begin.column)};
}

std::string describe_node(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "a string (\"" + std::string(*node.value<std::string_view>()) + "\")";
    case toml::node_type::integer: return "an integer (" + std::to_string(*node.value<std::int64_t>()) + ")";
    case toml::node_type::floating_point: {
      std::ostringstream s;
      s << *node.value<double>();
      return "a float (" + s.str() + ")";
    }
    case toml::node_type::boolean: return std::string("a boolean (") + (*node.value<bool>() ? "true" : "false") + ")";
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "a value";
  }
}

std::string with_article(const std::string& type_name) {
  const char c = type_name.empty() ? 'x' : type_name[0];
  return (c == 'a' || c == 'e' || c == 'i' || c == 'o' || c == 'u' ? "an " : "a ") + type_name;
}

struct Converter {
  const std::string& file;
  const std::string& section;
  const OptionSpec& spec;
  Location where;
  Diagnostics& diagnostics;

  void error(const Location& at, const std::string& message) const {
    diagnostics.add(at, "[" + section + "] " + spec.name + ": " + message);
  }
  Location at(const toml::node& node) const {
    return where.line > 0 && node.source().begin.line > 0 ? location_of(file, node.source()) : where;
  }
  void type_error(const toml::node& node) const {
    error(at(node), "expected " + with_article(option_type_name(spec.types)) + ", got " + describe_node(node));
  }

  std::optional<OptionValue> convert(const toml::node& node) const {
    const unsigned t = spec.types;
    if (node.is_boolean() && (t & kBool)) return OptionValue{*node.value<bool>()};
    if (node.is_integer() && (t & kInt)) return OptionValue{*node.value<std::int64_t>()};
    if (node.is_integer() && (t & kFloat)) return OptionValue{static_cast<double>(*node.value<std::int64_t>())};
    if (node.is_floating_point() && (t & kFloat)) {
      const double v = *node.value<double>();
      if (!std::isfinite(v)) {
        error(at(node), "must be a finite number");
        return std::nullopt;
      }
      return OptionValue{v};
    }
    if (node.is_string() && (t & kString)) return OptionValue{std::string(*node.value<std::string_view>())};
    if (const auto* array = node.as_array(); array && (t & (kStringList | kIntList))) return convert_array(*array);
    if (const auto* table = node.as_table(); table && (t & kStringMap)) return convert_table(*table);
    type_error(node);
    return std::nullopt;
  }

  std::optional<OptionValue> convert_array(const toml::array& array) const {
    const bool strings_ok = spec.types & kStringList, ints_ok = spec.types & kIntList;
    if (array.empty()) return strings_ok ? OptionValue{StringList{}} : OptionValue{IntList{}};
    const bool as_strings = strings_ok && (array[0].is_string() || !ints_ok);
    StringList strings;
    IntList ints;
    for (const auto& element : array) {
      if (as_strings && element.is_string()) {
        strings.emplace_back(*element.value<std::string_view>());
      } else if (!as_strings && element.is_integer()) {
        ints.push_back(*element.value<std::int64_t>());
      } else {
        error(at(element), "every element must be " + std::string(as_strings ? "a string" : "an integer") + ", got " +
                               describe_node(element));
        return std::nullopt;
      }
    }
    return as_strings ? OptionValue{std::move(strings)} : OptionValue{std::move(ints)};
  }

  std::optional<OptionValue> convert_table(const toml::table& table) const {
    StringMap map;
    for (const auto& [key, value] : table) {
      if (!value.is_string()) {
        error(at(value), "value of '" + std::string(key.str()) + "' must be a string, got " + describe_node(value));
        return std::nullopt;
      }
      map.emplace(std::string(key.str()), std::string(*value.value<std::string_view>()));
    }
    return OptionValue{std::move(map)};
  }

  // Range and choice checks the host makes before any plugin sees the value.
  bool check_bounds(const OptionValue& value, const Location& loc) const {
    std::optional<double> number;
    std::string shown = format_option_value(value);
    std::string what = "";
    if (const auto* i = std::get_if<std::int64_t>(&value)) number = static_cast<double>(*i);
    if (const auto* d = std::get_if<double>(&value)) number = *d;
    if (const auto* l = std::get_if<StringList>(&value)) number = static_cast<double>(l->size()), what = "length ";
    if (const auto* l = std::get_if<IntList>(&value)) number = static_cast<double>(l->size()), what = "length ";
    if (number) {
      const auto fmt = [](double v) {
        std::ostringstream s;
        s << v;
        return s.str();
      };
      if (spec.min && *number < *spec.min) {
        error(loc, what + (what.empty() ? shown : fmt(*number)) + " is out of range: must be at least " + fmt(*spec.min));
        return false;
      }
      if (spec.max && *number > *spec.max) {
        error(loc, what + (what.empty() ? shown : fmt(*number)) + " is out of range: must be at most " + fmt(*spec.max));
        return false;
      }
    }
    if (const auto* s = std::get_if<std::string>(&value); s && !spec.choices.empty()) {
      if (std::find(spec.choices.begin(), spec.choices.end(), *s) == spec.choices.end()) {
        std::vector<std::string> quoted;
        for (const auto& c : spec.choices) quoted.push_back("\"" + c + "\"");
        std::string list;
        for (std::size_t i = 0; i < quoted.size(); ++i) list += (i ? ", " : "") + quoted[i];
        const std::string close = closest_match(*s, spec.choices);
        error(loc, shown + " is not one of " + list + (close.empty() ? "" : "; did you mean \"" + close + "\"?"));
        return false;
      }
    }
    return true;
  }
};

struct Loader {
  fs::path path;
  std::string file;  // as shown in messages
  PluginRegistry& registry;
  Purpose purpose;
  Diagnostics diagnostics;
  std::map<std::string, Location> overridden;  // "section.key" -> where on the command line

  Location file_only() const { return {file, 0, 0}; }

  // A path value that names nothing relative to the pipeline's folder but reads as a hub id.
  bool is_hub_id_here(const OptionValue& value, bool from_command_line) const {
    const auto* text = std::get_if<std::string>(&value);
    std::error_code ec;
    return text != nullptr && kit::looks_like_hub_id(*text) && !fs::exists(from_command_line ? *text : resolve(*text), ec);
  }

  // How a relative path given at `key` was read, for an error about a file it does not find.
  std::string path_rule(const std::string& section, const std::string& key) const {
    if (overridden.count(section + "." + key)) return " (a path given on the command line is relative to the current folder)";
    const fs::path base = path.parent_path().empty() ? fs::path(".") : path.parent_path();
    return " (a path in a pipeline is relative to the pipeline's folder, " + base.string() + "/; one given by --set, to the current folder)";
  }

  // Paths in a pipeline are relative to the pipeline's folder, wherever loom is started from.
  std::string resolve(const std::string& p) const {
    const fs::path path_value(p);
    if (p.empty() || path_value.is_absolute()) return p;
    const fs::path base = path.parent_path().empty() ? fs::path(".") : path.parent_path();
    return (base / path_value).lexically_normal().string();
  }

  toml::table read() {
    const std::string text = kit::without_bom(kit::read_regular_file(path, kMaxPipelineBytes, "pipeline"));
    const TomlText toml_text = toml_safe(text);
    if (const auto& bad = toml_text.problem) throw PipelineError({{Location{file, bad->line, bad->column}, bad->message}});
    try {
      (void)toml::parse(ascii_stand_in(text), file);  // structure first (see ascii_stand_in)
      return toml::parse(toml_text.text, file);
    } catch (const toml::parse_error& e) {
      throw PipelineError({{location_of(file, e.source()), "TOML syntax error: " + std::string(e.description())}});
    }
  }

  void apply_override(toml::table& root, const std::string& text) {
    const Location where{"--set " + text, 0, 0};
    const auto eq = text.find('=');
    const auto dot = text.find('.');
    if (eq == std::string::npos || dot == std::string::npos || dot > eq || dot == 0 || dot + 1 == eq) {
      diagnostics.add(where, "expected --set SECTION.KEY=VALUE, e.g. --set train.lr=1e-4");
      return;
    }
    const std::string section = text.substr(0, dot), key = text.substr(dot + 1, eq - dot - 1);
    const std::string value = text.substr(eq + 1);
    if (value.find_first_of("\r\n") != std::string::npos) {
      diagnostics.add(where, "the value holds a line break; --set takes one value (write \\n inside a quoted string)");
      return;
    }
    const TomlText safe_value = toml_safe(value);
    if (safe_value.problem) {
      diagnostics.add(where, safe_value.problem->non_ascii ? "a non-ASCII character outside a quoted string; quote text values" : safe_value.problem->message);
      return;
    }
    // A value is read as TOML (numbers, booleans, arrays, quoted strings); anything TOML cannot
    // read, such as runs/x, is taken as a bare string.
    toml::table parsed;
    try {
      (void)toml::parse("v = " + ascii_stand_in(value));  // structure first (see ascii_stand_in)
      parsed = toml::parse("v = " + safe_value.text);
    } catch (const toml::parse_error&) {
      parsed = toml::table{};
    }
    if (parsed.size() != 1 || !parsed.contains("v")) {
      parsed = toml::table{};
      parsed.insert_or_assign("v", value);
    }
    // --set reward.NAME.KEY=VALUE reaches the section [reward.NAME].
    std::vector<std::string> path{section};
    std::string leaf = key;
    if (section == kKindReward) {
      const auto inner = key.find('.');
      if (inner == 0 || inner + 1 == key.size()) {
        diagnostics.add(where, "expected --set reward.NAME.KEY=VALUE, e.g. --set reward.correct.weight=2");
        return;
      }
      if (inner != std::string::npos) {
        path.push_back(key.substr(0, inner));
        leaf = key.substr(inner + 1);
      }
    }
    toml::table* table = &root;
    std::string named;
    for (const auto& part : path) {
      named += (named.empty() ? "" : ".") + part;
      if (!table->contains(part)) table->insert_or_assign(part, toml::table{});
      table = table->get(part)->as_table();
      if (table == nullptr) {
        diagnostics.add(where, "'" + named + "' is not a section");
        return;
      }
    }
    table->insert_or_assign(leaf, *parsed.get("v"));
    overridden[section + "." + key] = {"--set " + section + "." + key, 0, 0};
    if (path.size() > 1) overridden.emplace(named, overridden[section + "." + key]);  // a [reward.NAME] the file lacks is where --set made it
  }

  Location where_is(const std::string& section, const std::string& key, const toml::key& k) const {
    auto it = overridden.find(section + "." + key);
    if (it != overridden.end()) return it->second;
    return location_of(file, k.source());
  }

  // [model] without plugin: the model plugin whose model_types holds the model_type of
  // path/config.json, one error naming the candidates where not exactly one does.
  bool pick_model_plugin(const toml::table& table, SectionSpec& sec) {
    const toml::node* path_node = table.get("path");
    const Location at = overridden.count("model.path") ? overridden.at("model.path") : location_of(file, path_node->source());
    sec.plugin_where = at;
    if (!path_node->is_string()) {
      diagnostics.add(at, "[model] path: expected a string, got " + describe_node(*path_node));
      return false;
    }
    const std::string written(*path_node->value<std::string_view>());
    std::string model_type;
    const bool from_command_line = overridden.count("model.path") > 0;
    fs::path folder = from_command_line ? fs::path(written) : fs::path(resolve(written));
    try {
      const toml::node* revision = table.get("revision");
      if (is_hub_id_here(written, from_command_line))
        folder = kit::model_folder(written, revision && revision->is_string() ? std::string(*revision->value<std::string_view>()) : "", "[model] path");
      const auto config = kit::json::read_file(folder / "config.json", 16u << 20, "model config");
      const auto type = config.find("model_type");
      if (type == config.end() || !type->is_string() || type->get<std::string>().empty())
        throw UserError((folder / "config.json").string() + " has no \"model_type\" string to choose a model plugin by");
      model_type = type->get<std::string>();
    } catch (const UserError& e) {
      diagnostics.add(at, std::string("[model] names no plugin, so it is chosen by the folder's config.json: ") + e.what() +
                              "; or name the plugin with plugin = \"NAME\"");
      return false;
    }
    std::vector<const LoadedPlugin*> readers;
    std::string families;
    for (const auto& p : registry.plugins()) {
      if (p.kind != kKindModel) continue;
      std::string types;
      for (const auto& t : p.model_types) types += (types.empty() ? "" : ", ") + t;
      families += (families.empty() ? "" : "; ") + p.name + " (" + (types.empty() ? "declares none" : types) + ")";
      if (std::find(p.model_types.begin(), p.model_types.end(), model_type) != p.model_types.end()) readers.push_back(&p);
    }
    if (readers.size() == 1) {
      sec.plugin = readers.front()->name;
      return true;
    }
    if (readers.empty()) {
      diagnostics.add(at, "[model] names no plugin, and no model plugin reads model_type \"" + model_type + "\" (" + (folder / "config.json").string() +
                              "); the model plugins and the model_types they read: " + families);
      return false;
    }
    std::string claimants;
    for (const auto* p : readers) claimants += (claimants.empty() ? "" : " and ") + std::string("'") + p->name + "' (" + p->file.string() + ")";
    diagnostics.add(at, "[model] names no plugin, and model_type \"" + model_type + "\" is read by both " + claimants +
                            "; name one with plugin = \"NAME\"");
    return false;
  }

  // What another tool's name for a key, or a host key written in another section, is called here:
  // "; loom calls it lr", "; loom's is [run] seed"; empty where nothing is known.
  static std::string known_elsewhere(const std::string& section, const std::string& key) {
    std::pair<std::string, std::string> target;
    if (const auto it = foreign_keys().find(key); it != foreign_keys().end()) target = it->second;
    for (const char* host : {"run", "data", "train", "parallel"}) {
      if (!target.first.empty() || section == host) continue;
      const auto& schema = host_section_schema(host);
      if (std::any_of(schema.begin(), schema.end(), [&](const OptionSpec& s) { return s.name == key; })) target = {host, key};
    }
    if (target.first.empty()) return "";
    return target.first == section ? "; loom calls it " + target.second : "; loom's is [" + target.first + "] " + target.second;
  }

  // Checks a section's keys against `schema`; fills `out` with values and defaults.
  void check_section(const std::string& name, const toml::table& table, const std::vector<OptionSpec>& schema,
                     SectionSpec& out, bool skip_plugin_key) {
    std::vector<std::string> names;
    for (const auto& s : schema) names.push_back(s.name);
    if (skip_plugin_key) names.push_back("plugin");
    for (const auto& [k, node] : table) {
      const std::string key(k.str());
      if (skip_plugin_key && key == "plugin") continue;
      const Location loc = where_is(name, key, k);
      const auto spec = std::find_if(schema.begin(), schema.end(), [&](const OptionSpec& s) { return s.name == key; });
      if (spec == schema.end()) {
        const std::string owner = out.plugin.empty() ? "" : " (" + name + " plugin '" + out.plugin + "')";
        const std::string hint = known_elsewhere(name, key);
        diagnostics.add(loc, "[" + name + "] unknown key '" + key + "'" + owner + (hint.empty() ? did_you_mean(key, names) : hint));
        continue;
      }
      Converter conv{file, name, *spec, loc, diagnostics};
      auto value = conv.convert(node);
      if (!value || !conv.check_bounds(*value, conv.at(node))) continue;
      if (spec->is_path) {
        // A model's or tokenizer's path that is no folder here but has a hub id's shape stays as
        // written: the plugin finds it in the hub cache (loom/kit/hub_cache.hpp).
        // One rule: a path written in the pipeline is relative to its folder; one given on the
        // command line (--set, --output), to the current folder, as the shell's own paths are.
        const bool from_command_line = overridden.count(name + "." + key) > 0;
        const bool hub_id = key == "path" && (name == kKindModel || name == kKindTokenizer) && is_hub_id_here(*value, from_command_line);
        if (auto* text = std::get_if<std::string>(&*value); text && !hub_id && !from_command_line) *text = resolve(*text);
        if (auto* list = std::get_if<StringList>(&*value); list && !from_command_line)
          for (auto& item : *list) item = resolve(item);
      }
      out.options.set(key, std::move(*value));
      out.locations[key] = conv.at(node);  // later checks on the value point at the value
    }
    for (const auto& s : schema) {
      if (out.options.has(s.name)) continue;
      if (s.required) {
        diagnostics.add(out.where, "[" + name + "] missing required key '" + s.name + "' (" + s.doc + ")");
      } else if (s.default_value) {
        out.options.set(s.name, *s.default_value);
      }
    }
  }

  // An absent host section still has its defaults (a plan reads [data] max_length, say).
  static void fill_defaults(const std::string& name, SectionSpec& out) {
    for (const auto& s : host_section_schema(name))
      if (s.default_value) out.options.set(s.name, *s.default_value);
  }

  PipelineSpec load(const std::vector<std::string>& overrides) {
    toml::table root = read();
    for (const auto& o : overrides) apply_override(root, o);

    PipelineSpec spec;
    spec.file = path;
    for (const auto& s : kSections) spec.sections[s].where = file_only();

    // Unknown sections and non-table top-level keys.
    for (const auto& [k, node] : root) {
      const std::string key(k.str());
      const Location loc = location_of(file, k.source());
      if (std::find(kSections.begin(), kSections.end(), key) == kSections.end()) {
        const std::string close = closest_match(key, kSections);
        diagnostics.add(loc, "unknown section [" + key + "]" + (close.empty() ? "" : ", did you mean [" + close + "]?") +
                                 " (sections: " + quoted_list(kSections) + ")");
      } else if (!node.is_table()) {
        diagnostics.add(loc, "'" + key + "' must be a section ([" + key + "]), got " + describe_node(node));
      } else {
        auto& sec = spec.sections[key];
        sec.present = true;
        // A section made by --set has no position in the file.
        const auto& region = node.source().begin.line > 0 ? node.source() : k.source();
        sec.where = region.begin.line > 0 ? location_of(file, region) : file_only();
      }
    }

    // [plugins] first: its paths add plugins the other sections may name.
    if (const auto* t = root["plugins"].as_table()) {
      auto& sec = spec.sections["plugins"];
      check_section("plugins", *t, host_section_schema("plugins"), sec, false);
      if (sec.options.has("paths")) {
        for (const auto& p : sec.options.get_string_list("paths")) {
          try {
            registry.scan_directory(p, true);
          } catch (const UserError& e) {
            diagnostics.add(sec.location_of("paths"), std::string("[plugins] paths: ") + e.what());
          }
        }
      }
    } else {
      spec.sections["plugins"].options.set("paths", StringList{});
    }
    for (const auto& r : registry.refusals()) diagnostics.add({r.file.string(), 0, 0}, "refused: " + r.reason);

    for (const auto& name : kSections) {
      if (name == "plugins") continue;
      auto& sec = spec.sections[name];
      const toml::table* table = root[name].as_table();
      if (name == kKindReward) {
        if (table) check_rewards(*table, spec);
        continue;
      }
      // Without [objective], training is supervised fine-tuning.
      if (!table && name == kKindObjective) {
        if (const LoadedPlugin* sft = registry.find(name, "sft")) {
          sec.plugin = "sft";
          sec.where = file_only();
          sec.plugin_where = file_only();
          check_section(name, toml::table{}, sft->schema, sec, true);
        }
        continue;
      }
      const bool needed = name == "model" || name == "placement" ||
                          (purpose == Purpose::kRun && (name == "tokenizer" || name == "data"));
      // Plain-text data trains on every token unless a [collator] says otherwise, as TRL's SFT
      // trainer does with a text dataset (chat formats are labeled by the host).
      if (!table && name == kKindCollator && purpose == Purpose::kRun && !is_chat_format(spec.sections["data"].options.has("format")
                                                                                        ? spec.sections["data"].options.get_string("format")
                                                                                        : std::string("{text}"))) {
        if (const LoadedPlugin* all_tokens = registry.find(name, "all-tokens")) {
          sec.plugin = "all-tokens";
          sec.present = true;
          sec.where = file_only();
          sec.plugin_where = file_only();
          check_section(name, toml::table{}, all_tokens->schema, sec, true);
          continue;
        }
      }
      if (!table) {
        if (needed)
          diagnostics.add(file_only(), "missing section [" + name + "]" +
                                           (is_plugin_section(name) ? " (known " + name + " plugins: " +
                                                                          quoted_list(registry.names_of_kind(name)) + ")"
                                                                    : ""));
        if (!is_plugin_section(name)) fill_defaults(name, sec);
        continue;
      }
      if (!is_plugin_section(name)) {
        check_section(name, *table, host_section_schema(name), sec, false);
        continue;
      }
      const auto known = registry.names_of_kind(name);
      const toml::node* plugin_node = table->get("plugin");
      if (plugin_node == nullptr) {
        // A model folder's config.json names its family: [model] path alone picks the plugin.
        if (name == kKindModel && table->get("path") != nullptr) {
          if (!pick_model_plugin(*table, sec)) continue;
        } else {
          diagnostics.add(sec.where, "[" + name + "] needs plugin = \"NAME\" (known " + name + " plugins: " + quoted_list(known) + ")" +
                                         (name == kKindModel ? ", or path = a model folder whose config.json names its model_type" : ""));
          continue;
        }
      } else {
        sec.plugin_where = overridden.count(name + ".plugin") ? overridden[name + ".plugin"] : location_of(file, plugin_node->source());
        if (!plugin_node->is_string()) {
          diagnostics.add(sec.plugin_where, "[" + name + "] plugin: expected a string, got " + describe_node(*plugin_node));
          continue;
        }
        sec.plugin = std::string(*plugin_node->value<std::string_view>());
      }
      const LoadedPlugin* plugin = registry.find(name, sec.plugin);
      if (plugin == nullptr) {
        diagnostics.add(sec.plugin_where, "[" + name + "] unknown " + name + " plugin '" + sec.plugin + "'" +
                                              did_you_mean(sec.plugin, known) + " (known: " + quoted_list(known) + ")");
        continue;
      }
      check_section(name, *table, plugin->schema, sec, true);
    }

    check_versions(root, spec);
    check_host_values(spec);
    diagnostics.throw_if_any();
    return spec;
  }

  // [reward.NAME] sections: each a reward plugin with its options and weight, in the file's order.
  void check_rewards(const toml::table& table, PipelineSpec& spec) {
    const auto known = registry.names_of_kind(kKindReward);
    for (const auto& [k, node] : table) {
      const std::string name(k.str());
      const Location at = where_is(kKindReward, name, k);
      const toml::table* sub = node.as_table();
      if (sub == nullptr) {
        diagnostics.add(at, "[reward] " + name + ": each reward is a section of its own, [reward." + name + "] with plugin = \"NAME\" (known reward plugins: " +
                                quoted_list(known) + ")");
        continue;
      }
      const std::string section = std::string(kKindReward) + "." + name;
      SectionSpec sec;
      sec.present = true;
      sec.where = sub->source().begin.line > 0 ? location_of(file, sub->source()) : at;
      const toml::node* plugin_node = sub->get("plugin");
      if (plugin_node == nullptr || !plugin_node->is_string()) {
        diagnostics.add(plugin_node ? location_of(file, plugin_node->source()) : sec.where,
                        "[" + section + "] needs plugin = \"NAME\" (known reward plugins: " + quoted_list(known) + ")");
        continue;
      }
      sec.plugin_where = overridden.count(section + ".plugin") ? overridden[section + ".plugin"] : location_of(file, plugin_node->source());
      sec.plugin = std::string(*plugin_node->value<std::string_view>());
      const LoadedPlugin* plugin = registry.find(kKindReward, sec.plugin);
      if (plugin == nullptr) {
        diagnostics.add(sec.plugin_where, "[" + section + "] unknown reward plugin '" + sec.plugin + "'" + did_you_mean(sec.plugin, known) +
                                              " (known: " + quoted_list(known) + ")");
        continue;
      }
      check_section(section, *sub, plugin->schema, sec, true);
      spec.rewards.emplace_back(name, std::move(sec));
    }
  }

  // [plugins] versions = { NAME = "1.2.3" }: each named plugin is one this pipeline uses, and the
  // version found satisfies the requirement, so an upgrade cannot silently change a pinned run.
  void check_versions(const toml::table& root, const PipelineSpec& spec) {
    const auto& sec = spec.sections.at("plugins");
    if (!sec.options.has("versions")) return;
    const toml::table* entries = root["plugins"]["versions"].as_table();
    std::vector<const LoadedPlugin*> used;
    std::vector<std::string> used_names;
    for (const auto& kind : plugin_kinds()) {
      const auto it = spec.sections.find(kind);
      if (it == spec.sections.end() || it->second.plugin.empty()) continue;
      if (const LoadedPlugin* p = registry.find(kind, it->second.plugin)) {
        used.push_back(p);
        used_names.push_back(p->name);
      }
    }
    for (const auto& [name, reward] : spec.rewards)
      if (const LoadedPlugin* p = registry.find(kKindReward, reward.plugin); p && std::find(used.begin(), used.end(), p) == used.end()) {
        used.push_back(p);
        used_names.push_back(p->name);
      }
    for (const auto& [name, wanted] : sec.options.get_string_map("versions")) {
      Location at = sec.location_of("versions");
      if (entries)
        if (const toml::node* n = entries->get(name); n && n->source().begin.line > 0) at = location_of(file, n->source());
      const LoadedPlugin* found = nullptr;
      for (const auto* p : used)
        if (name == p->name || name == p->kind + "/" + p->name) found = p;
      if (!found) {
        diagnostics.add(at, "[plugins] versions: this pipeline uses no plugin '" + name + "'" + did_you_mean(name, used_names) + " (it uses " +
                                quoted_list(used_names) + ")");
        continue;
      }
      const auto want = split_version(wanted);
      if (want.empty() || want.size() > 3) {
        diagnostics.add(at, "[plugins] versions: " + name + " = \"" + wanted +
                                "\" is not a version requirement; write \"1.2.3\" (that version), \"1.2\" or \"1\" (any version starting so)");
        continue;
      }
      const auto have = split_version(found->version);
      if (have.size() < want.size() || !std::equal(want.begin(), want.end(), have.begin()))
        diagnostics.add(at, "[plugins] versions: the pipeline needs " + found->kind + " plugin '" + found->name + "' " + wanted + ", but the one found is " +
                                found->version + " (" + found->file.string() + "); install that version or change the requirement");
    }
  }

  // "1.2.3" -> {"1", "2", "3"}; empty when a part is not a number.
  static std::vector<std::string> split_version(const std::string& v) {
    std::vector<std::string> parts;
    std::size_t start = 0;
    while (true) {
      const auto dot = v.find('.', start);
      const std::string part = v.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos) return {};
      parts.push_back(part);
      if (dot == std::string::npos) return parts;
      start = dot + 1;
    }
  }

  // Checks on values that the schemas cannot express.
  void check_host_values(PipelineSpec& spec) {
    auto& run = spec.sections["run"];
    if (!run.options.has("output_dir"))
      run.options.set("output_dir", (fs::path("runs") / path.stem()).string());
    if (purpose != Purpose::kRun) return;
    // What `run` would find in the data, found here: the format, and the first records of each
    // file read and rendered through it (the rest is read when training starts).
    const auto& data = spec.sections["data"];
    const std::string& format = data.options.get_string("format");
    bool format_ok = true;
    try {
      check_format(format);
    } catch (const UserError& e) {
      diagnostics.add(data.location_of("format"), e.what());
      format_ok = false;
    }
    const bool skip = data.options.get_string("on_bad_line") == "skip";
    // An objective other than sft may read records whose conversation is only a prompt; it is
    // known to once its plugin says what it reads (open_session), which reads them again.
    const auto objective = spec.sections.find(kKindObjective);
    const bool prompts_maybe = objective != spec.sections.end() && !objective->second.plugin.empty() && objective->second.plugin != "sft";
    for (const char* key : {"train", "eval"}) {
      if (!data.options.has(key)) continue;
      const auto& given = data.options.get(key);
      const StringList files = std::holds_alternative<std::string>(given) ? StringList{std::get<std::string>(given)} : std::get<StringList>(given);
      for (const auto& file : files) {
        try {
          // The first file's head stands for the run's in the checks before the first step.
          if (!format_ok) kit::require_regular_file(file, "data file");
          else if (prompts_maybe) (void)load_data(file, format, skip, kRecordsChecked, true, true);
          else if (!spec.data_heads.count(key)) spec.data_heads[key] = load_data(file, format, skip, kRecordsChecked);
          else (void)load_data(file, format, skip, kRecordsChecked);
        } catch (const UserError& e) {
          std::error_code ec;
          const bool missing = !fs::exists(file, ec);
          diagnostics.add(data.location_of(key), std::string("[data] ") + key + ": " + e.what() + (missing ? path_rule("data", key) : ""));
        }
      }
    }
  }
};

}  // namespace

Location SectionSpec::location_of(const std::string& key) const {
  auto it = locations.find(key);
  return it != locations.end() ? it->second : where;
}

nlohmann::json PipelineSpec::resolved() const {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, sec] : sections) {
    if (!sec.present && is_plugin_section(name)) continue;
    nlohmann::json s = nlohmann::json::object();
    if (!sec.plugin.empty()) s["plugin"] = sec.plugin;
    for (const auto& [key, value] : sec.options.values()) {
      const std::string& name = key;  // a structured binding cannot be captured before C++20
      std::visit([&](const auto& v) { s[name] = v; }, value);
    }
    out[name] = std::move(s);
  }
  for (const auto& [name, sec] : rewards) {
    nlohmann::json s = {{"plugin", sec.plugin}};
    for (const auto& [key, value] : sec.options.values()) {
      const std::string& option = key;
      std::visit([&](const auto& v) { s[option] = v; }, value);
    }
    out[kKindReward][name] = std::move(s);
  }
  return out;
}

const std::vector<std::string>& section_names() { return kSections; }

bool is_plugin_section(const std::string& section) {
  const auto& kinds = plugin_kinds();
  return std::find(kinds.begin(), kinds.end(), section) != kinds.end();
}

PipelineSpec load_pipeline(const fs::path& file, const std::vector<std::string>& overrides, PluginRegistry& registry,
                           Purpose purpose) {
  Loader loader{file, file.string(), registry, purpose, {}, {}};
  return loader.load(overrides);
}

}  // namespace loom::core
