#pragma once
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "config/data.hpp"
#include "config/diagnostics.hpp"
#include "loom/options.hpp"
#include "plugins/plugin_registry.hpp"

namespace loom::core {

// One [section] of a validated pipeline. Plugin-backed sections carry the plugin's name.
struct SectionSpec {
  bool present = false;
  std::string plugin;           // plugin sections only
  Location where;               // the [section] header (or the file, when absent)
  Location plugin_where;        // the `plugin = ...` value
  Options options;              // every declared option: given values, then defaults
  std::map<std::string, Location> locations;  // where each given key was set
  Location location_of(const std::string& key) const;
};

struct PipelineSpec {
  std::filesystem::path file;
  std::map<std::string, SectionSpec> sections;  // every known section; `present` tells if written
  std::vector<std::pair<std::string, SectionSpec>> rewards;  // [reward.NAME], in the file's order
  // The first kRecordsChecked records of [data] train and eval as validation read them (Purpose::kRun
  // only), so the checks before the first step do not read the files again.
  std::map<std::string, Dataset> data_heads;

  const SectionSpec& section(const std::string& name) const { return sections.at(name); }
  // The pipeline as loom will run it: every section, every key, defaults filled in.
  nlohmann::json resolved() const;
};

// What the pipeline will be used for: `run` (and validate) needs tokenizer and data; `plan` needs
// only the model and placement.
enum class Purpose { kRun, kPlan };

// Sections the host owns and the kind of plugin behind the others.
const std::vector<std::string>& section_names();
bool is_plugin_section(const std::string& section);  // section name == plugin kind
const std::vector<OptionSpec>& host_section_schema(const std::string& section);

// Reads, overrides (`--set section.key=value`), loads the plugins the pipeline's [plugins] paths
// name into `registry`, and validates every section against its schema. Throws PipelineError
// with every problem found, each as file:line:col.
PipelineSpec load_pipeline(const std::filesystem::path& file, const std::vector<std::string>& overrides,
                           PluginRegistry& registry, Purpose purpose);

}  // namespace loom::core
