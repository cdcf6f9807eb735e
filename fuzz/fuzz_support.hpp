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

#include "loom/options.hpp"
#include "plugins/plugin_guard.hpp"
#include "plugins/plugin_registry.hpp"

namespace loom::fuzz {

// The fuzzer's bytes split at `separator` into exactly `parts` pieces (the last holds the rest;
// missing pieces are empty), so one input can carry several files.
inline std::vector<std::string> split(const std::uint8_t* data, std::size_t size, std::string_view separator, std::size_t parts) {
  std::vector<std::string> out;
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  while (out.size() + 1 < parts) {
    const auto at = rest.find(separator);
    if (at == std::string_view::npos) break;
    out.emplace_back(rest.substr(0, at));
    rest.remove_prefix(at + separator.size());
  }
  out.emplace_back(rest);
  out.resize(parts);
  return out;
}

// A folder of this process for the files a target writes; emptied on each call.
inline std::filesystem::path scratch() {
  static const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("loom-fuzz-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline void write(const std::filesystem::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

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
