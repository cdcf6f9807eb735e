#include "plugins/plugin_registry.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <system_error>

#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>

#include "loom/error.hpp"
#include "loom/kit/version.hpp"
#include "plugins/plugin_guard.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace {

// Never unloaded: a plugin's code must outlive every object and static it created. One handle per
// file, however many registries load it (commands run one after another, or side by side as the
// tests' rank threads, in one process).
void keep_loaded(const boost::dll::shared_library& library, const fs::path& file) {
  static std::mutex mutex;
  static auto* libraries = new std::map<fs::path, boost::dll::shared_library>();
  std::lock_guard<std::mutex> lock(mutex);
  libraries->emplace(file, library);
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

std::string two(const Version& v) { return std::to_string(v.major) + "." + std::to_string(v.minor); }

}  // namespace

Version host_torch_version() { return {TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH}; }

std::string Refusal::str() const { return file.string() + ": refused: " + reason; }

void PluginRegistry::scan_directory(const fs::path& dir, bool must_exist) {
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(dir, ec);
  if (std::find(scanned_.begin(), scanned_.end(), canonical) != scanned_.end()) return;
  scanned_.push_back(canonical);
  if (!fs::is_directory(dir, ec)) {
    if (must_exist) throw UserError("plugin folder " + dir.string() + " does not exist or is not a folder");
    return;
  }
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().extension() == ".so" && entry.is_regular_file(ec)) files.push_back(entry.path());
  if (ec) throw UserError("cannot list plugin folder " + dir.string() + ": " + ec.message());
  std::sort(files.begin(), files.end());  // load order, and so duplicate reports, do not depend on the file system
  for (const auto& f : files) load_file(f);
}

void PluginRegistry::load_file(const fs::path& file) {
  const auto refuse = [&](std::string reason) { refusals_.push_back({file, std::move(reason)}); };

  boost::dll::shared_library library;
  try {
    // rtld_now: unresolved symbols are reported here, not as a crash in the middle of a run.
    library.load(file,
                 boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    // Boost wraps the loader's own words ("invalid ELF header", "undefined symbol: x") in its
    // own text; only the loader's are worth showing.
    std::string why = e.what();
    const std::string marker = "dlerror system message: ";
    if (const auto at = why.find(marker); at != std::string::npos) {
      why = why.substr(at + marker.size());
      if (const auto end = why.rfind("):"); end != std::string::npos) why = why.substr(0, end);
      if (why.rfind(file.string() + ": ", 0) == 0) why = why.substr(file.string().size() + 2);
    }
    return refuse("not a loadable shared library (" + why + ")");
  }
  if (!library.has(LOOM_PLUGIN_ENTRY_NAME))
    return refuse("no loom plugin descriptor (symbol '" LOOM_PLUGIN_ENTRY_NAME
                  "' not found); a loom plugin declares one with LOOM_PLUGIN(...)");
  keep_loaded(library, file);

  const PluginDescriptor* d = nullptr;
  try {
    d = library.get_alias<const PluginDescriptor*()>(LOOM_PLUGIN_ENTRY_NAME)();
  } catch (const std::exception& e) {
    return refuse(std::string("its descriptor function failed: ") + e.what());
  }
  if (d == nullptr) return refuse("its descriptor function returned null");
  if (d->magic != kDescriptorMagic) return refuse("descriptor has the wrong magic number (not a loom plugin, or a corrupted build)");

  const Version sdk{d->sdk_major, d->sdk_minor, 0};
  const Version host_sdk = sdk_version();
  if (sdk.major != host_sdk.major)
    return refuse("built against loom SDK " + two(sdk) + ", this loom provides SDK " + two(host_sdk) +
                  " (major versions differ); rebuild the plugin against SDK " + std::to_string(host_sdk.major) + ".x");
  if (sdk.minor > host_sdk.minor)
    return refuse("built against loom SDK " + two(sdk) + ", newer than this loom's SDK " + two(host_sdk) +
                  "; upgrade loom or rebuild the plugin against SDK " + two(host_sdk));
  // A plugin of another C++ library ABI loads, but every std::string crossing the boundary would
  // be read as the other layout. LOOM_PLUGIN records it in every SDK-3 descriptor.
  if (!(d->flags & kFlagsSet))
    return refuse("its descriptor does not record the C++ library ABI it was built with (one not made by LOOM_PLUGIN); declare the plugin with LOOM_PLUGIN");
  if ((d->flags & kFlagCxx11Abi) != (kBuildFlags & kFlagCxx11Abi)) {
    const auto abi = [](std::uint16_t flags) { return std::string((flags & kFlagCxx11Abi) ? "1" : "0"); };
    return refuse("built with _GLIBCXX_USE_CXX11_ABI=" + abi(d->flags) + ", this loom with _GLIBCXX_USE_CXX11_ABI=" + abi(kBuildFlags) +
                  " (its LibTorch's); rebuild the plugin with _GLIBCXX_USE_CXX11_ABI=" + abi(kBuildFlags));
  }
  // The kit the plugin built against (recorded from SDK 3.13 on; 0.0: none): the structs and
  // classes it shares with the kit must have this kit's layouts.
  if (sdk.minor >= 13 && d->kit_major != 0) {
    const Version kit{d->kit_major, d->kit_minor, 0};
    const Version host_kit = kit::kit_version();
    if (kit.major != host_kit.major)
      return refuse("built against loom kit " + two(kit) + ", this loom's kit is " + two(host_kit) + " (major versions differ); rebuild the plugin against kit " +
                    std::to_string(host_kit.major) + ".x");
    if (kit.minor > host_kit.minor)
      return refuse("built against loom kit " + two(kit) + ", newer than this loom's kit " + two(host_kit) + "; upgrade loom or rebuild the plugin against kit " +
                    two(host_kit));
    if (kit.minor < kit::kit_layout_minor())
      return refuse("built against loom kit " + two(kit) + ", whose layouts kit " + std::to_string(kit.major) + "." + std::to_string(kit::kit_layout_minor()) +
                    " changed (loom/kit/version.hpp); this loom's kit is " + two(host_kit) + ": rebuild the plugin against it");
  }
  const Version torch{d->torch_major, d->torch_minor, d->torch_patch};
  const Version host_torch = host_torch_version();
  if (torch.major != host_torch.major || torch.minor != host_torch.minor)
    return refuse("built against LibTorch " + torch.str() + ", this loom runs LibTorch " + host_torch.str() +
                  "; rebuild the plugin against LibTorch " + two(host_torch));

  const auto text = [](const char* s) { return s ? std::string(s) : std::string(); };
  LoadedPlugin p;
  p.file = file;
  p.kind = text(d->kind);
  p.name = text(d->name);
  p.version = text(d->version);
  p.summary = text(d->summary);
  p.sdk = sdk;
  p.torch = torch;
  p.create = d->create;

  const auto& kinds = plugin_kinds();
  if (std::find(kinds.begin(), kinds.end(), p.kind) == kinds.end())
    return refuse("declares kind '" + p.kind + "', which this loom does not know (known: " + join(kinds) + ")");
  if (p.name.empty()) return refuse("declares an empty plugin name");
  if (p.create == nullptr || d->options == nullptr) return refuse("its descriptor has no factory or no option schema");
  if (const LoadedPlugin* other = find(p.kind, p.name))
    return refuse("duplicate " + p.kind + " plugin '" + p.name + "': already loaded from " + other->file.string() +
                  "; remove one of them from the plugin path");

  try {
    p.schema = d->options();
  } catch (const std::exception& e) {
    return refuse(std::string("its option schema failed: ") + e.what());
  }
  // The descriptor's 3.8 field: a plugin built against an older minor has a shorter descriptor.
  if (sdk.minor >= 8 && p.kind == kKindModel && d->model_types != nullptr) {
    try {
      p.model_types = d->model_types();
    } catch (const std::exception& e) {
      return refuse(std::string("its model_types function failed: ") + e.what());
    }
    for (const auto& t : p.model_types)
      if (t.empty() || t.size() > 128) return refuse("declares a model_type that is empty or longer than 128 characters");
  }
  for (auto& common : common_options(p.kind)) {
    const bool redeclared = std::any_of(p.schema.begin(), p.schema.end(), [&](const OptionSpec& s) { return s.name == common.name; });
    if (redeclared) return refuse("declares option '" + common.name + "', which every " + p.kind + " plugin gets from the SDK");
    p.schema.push_back(std::move(common));
  }
  for (std::size_t i = 0; i < p.schema.size(); ++i) {
    const auto& s = p.schema[i];
    if (s.name.empty() || s.name == "plugin" || s.types == 0)
      return refuse("declares an invalid option '" + s.name + "' (empty name, reserved name 'plugin', or no type)");
    for (std::size_t j = 0; j < i; ++j)
      if (p.schema[j].name == s.name) return refuse("declares option '" + s.name + "' twice");
  }
  plugins_.push_back(std::move(p));
}

const LoadedPlugin* PluginRegistry::find(const std::string& kind, const std::string& name) const {
  for (const auto& p : plugins_)
    if (p.kind == kind && p.name == name) return &p;
  return nullptr;
}

std::vector<const LoadedPlugin*> PluginRegistry::of_kind(const std::string& kind) const {
  std::vector<const LoadedPlugin*> out;
  for (const auto& p : plugins_)
    if (p.kind == kind) out.push_back(&p);
  return out;
}

std::vector<const LoadedPlugin*> PluginRegistry::declaring(const std::string& kind, const std::string& option, unsigned types) const {
  std::vector<const LoadedPlugin*> out;
  for (const auto* p : of_kind(kind))
    for (const auto& spec : p->schema)
      if (spec.name == option && spec.types == types) {
        out.push_back(p);
        break;
      }
  std::sort(out.begin(), out.end(), [](const LoadedPlugin* a, const LoadedPlugin* b) { return a->name < b->name; });
  return out;
}

std::vector<std::string> PluginRegistry::names_of_kind(const std::string& kind) const {
  std::vector<std::string> out;
  for (const auto* p : of_kind(kind)) out.push_back(p->name);
  std::sort(out.begin(), out.end());
  return out;
}

std::unique_ptr<Plugin> PluginRegistry::create(const LoadedPlugin& plugin, const Options& options) const {
  std::unique_ptr<Plugin> object;
  try {
    object = guarded(plugin, "create", [&] { return plugin.create(options); });
  } catch (const UserError& e) {
    throw UserError(plugin.kind + " plugin '" + plugin.name + "': " + e.what());
  }
  if (!object) throw PluginFault(plugin, "create", "it returned no object");
  return object;
}

std::vector<SearchFolder> default_search_path() {
  std::vector<SearchFolder> out;
  std::error_code ec;
  const auto exe_dir = fs::path(boost::dll::program_location().string()).parent_path();
  out.push_back({exe_dir / "plugins", false});                       // build tree
  out.push_back({exe_dir.parent_path() / "lib" / "loom" / "plugins", false});  // installed
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH")) {
    std::string list = env;
    std::size_t start = 0;
    while (start <= list.size()) {
      const auto end = std::min(list.find(':', start), list.size());
      if (end > start) out.push_back({list.substr(start, end - start), true});
      start = end + 1;
    }
  }
  return out;
}

PluginRegistry load_default_registry() {
  PluginRegistry registry;
  for (const auto& folder : default_search_path()) registry.scan_directory(folder.dir, folder.must_exist);
  return registry;
}

}  // namespace loom::core
