#pragma once
// Shared by the libFuzzer targets: each feeds the fuzzer's bytes to one of loom's parsers on its
// real code path. A UserError is the expected answer to bad input; anything else escaping (a
// PluginFault, a library exception) aborts the run, and libFuzzer reports it as a crash.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include "fuzz_files.hpp"
#include "loom/options.hpp"
#include "plugins/plugin_guard.hpp"
#include "plugins/plugin_registry.hpp"

namespace loom::fuzz {

// The built-in plugins (beside the fuzz binaries, as beside loom), loaded into `registry`.
inline void load_builtin(core::PluginRegistry& registry) {
  for (const auto& folder : core::default_search_path()) registry.scan_directory(folder.dir, folder.must_exist);
}

inline const core::PluginRegistry& registry() {
  static core::PluginRegistry r = [] {
    core::PluginRegistry loaded;
    load_builtin(loaded);
    return loaded;
  }();
  return r;
}

// A built-in plugin object with its defaults, overridden by `given`, wrapped as the host wraps it.
template <class Interface>
std::unique_ptr<Interface> plugin(const std::string& kind, const std::string& name, const std::map<std::string, OptionValue>& given) {
  const auto* p = registry().find(kind, name);
  Options o;
  for (const auto& s : p->schema)
    if (s.default_value) o.set(s.name, *s.default_value);
  for (const auto& [k, v] : given) o.set(k, v);
  return core::create_guarded<Interface>(registry(), *p, o);
}

}  // namespace loom::fuzz
