#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loom/options.hpp"
#include "loom/plugin.hpp"
#include "loom/version.hpp"

namespace loom::core {

struct LoadedPlugin {
  std::filesystem::path file;
  std::string kind;
  std::string name;
  std::string version;
  std::string summary;
  Version sdk;    // the SDK the plugin was built against
  Version torch;  // the LibTorch it was built against
  std::vector<OptionSpec> schema;  // its own options followed by the kind's common options
  PluginFactory create = nullptr;
  std::vector<std::string> model_types;  // a model plugin's config.json model_types (SDK 3.8 on; empty before)
};

struct Refusal {
  std::filesystem::path file;
  std::string reason;
  std::string str() const;  // "<file>: refused: <reason>"
};

// Loads plugin libraries and keeps them loaded for the life of the process, so no object a
// plugin created can outlive its code.
class PluginRegistry {
 public:
  // Every regular file ending in .so in `dir` (not recursive). A missing directory is ignored
  // when `must_exist` is false (default search folders), an error otherwise.
  void scan_directory(const std::filesystem::path& dir, bool must_exist);
  // Loads one library, or records why it was refused.
  void load_file(const std::filesystem::path& file);

  const LoadedPlugin* find(const std::string& kind, const std::string& name) const;
  std::vector<const LoadedPlugin*> of_kind(const std::string& kind) const;
  std::vector<std::string> names_of_kind(const std::string& kind) const;
  // The plugins of `kind` whose own schema declares option `option` with exactly `types`: how a
  // command finds "the tokenizer that reads a path" or "the placement that takes a block map"
  // without naming a plugin.
  std::vector<const LoadedPlugin*> declaring(const std::string& kind, const std::string& option, unsigned types) const;
  const std::vector<LoadedPlugin>& plugins() const { return plugins_; }
  const std::vector<Refusal>& refusals() const { return refusals_; }

  // Runs the plugin's factory. A UserError it throws comes back naming the plugin; any other
  // failure, or no object, is a PluginFault (plugin_guard.hpp). Hosts use create_guarded().
  std::unique_ptr<Plugin> create(const LoadedPlugin& plugin, const Options& options) const;

 private:
  std::vector<LoadedPlugin> plugins_;
  std::vector<Refusal> refusals_;
  std::vector<std::filesystem::path> scanned_;
};

// Built-in folders beside the executable, then each entry of LOOM_PLUGIN_PATH (colon-separated).
struct SearchFolder {
  std::filesystem::path dir;
  bool must_exist;
};
std::vector<SearchFolder> default_search_path();
// A registry of every plugin on the default search path.
PluginRegistry load_default_registry();

// Host's own versions, compared against each plugin's.
Version host_torch_version();

}  // namespace loom::core
