#pragma once
// Every call from the host into a plugin goes through a guard: a plugin reports what the user can
// fix as UserError; anything else it throws is its own bug, reported as an internal error (exit 1)
// naming the plugin, its version and file, and the call that failed, never passed off as the
// user's mistake with a library's message.
#include <memory>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

#include "loom/adapter.hpp"
#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/model.hpp"
#include "loom/objective.hpp"
#include "loom/reward.hpp"
#include "loom/placement.hpp"
#include "loom/tokenizer.hpp"
#include "plugins/filesystem_errors.hpp"
#include "plugins/plugin_registry.hpp"

namespace loom::core {

// A plugin failed with something other than UserError.
class PluginFault : public std::runtime_error {
 public:
  PluginFault(const LoadedPlugin& plugin, const std::string& call, const std::string& what);
};

// A device ran out of memory in a plugin's call: the plan said the run fits, so this is loom's
// miss (or another process's memory), not the plugin's bug. `where`: the plugin and its call.
class DeviceOutOfMemory : public std::runtime_error {
 public:
  DeviceOutOfMemory(const std::string& where, const std::string& what) : std::runtime_error("out of memory in " + where + ": " + what) {}
};

// Runs `body` (a call into `plugin`'s code named `call`), turning any exception but UserError into
// a PluginFault (LibTorch's without its backtrace), or a DeviceOutOfMemory. Either from a nested
// call (a collator calling the tokenizer) keeps its plugin.
template <class Body>
decltype(auto) guarded(const LoadedPlugin& plugin, const char* call, Body&& body) {
  try {
    return body();
  } catch (const UserError&) {
    throw;
  } catch (const PluginFault&) {
    throw;
  } catch (const DeviceOutOfMemory&) {
    throw;
  } catch (const c10::OutOfMemoryError& e) {
    throw DeviceOutOfMemory(plugin.kind + " plugin '" + plugin.name + "' " + plugin.version + ", " + call + "()", e.what_without_backtrace());
  } catch (const std::filesystem::filesystem_error& e) {
    // A full disk, a read-only place or a path that became a file is the machine's state, which
    // the user fixes; any other filesystem error is the plugin's own.
    if (!is_environment_error(e.code())) throw PluginFault(plugin, call, e.what());
    throw UserError(plugin.kind + " plugin '" + plugin.name + "', " + call + "(): " + describe_filesystem_error(e));
  } catch (const c10::Error& e) {
    throw PluginFault(plugin, call, e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw PluginFault(plugin, call, e.what());
  } catch (...) {
    throw PluginFault(plugin, call, "an exception that is not a std::exception");
  }
}

// Runs the plugin's factory and returns its object as `Interface`, wrapped so that every later
// call into it is guarded. A factory that fails with anything but UserError, returns nothing, or
// returns an object of another kind is a PluginFault. UserErrors name the plugin.
template <class Interface>
std::unique_ptr<Interface> create_guarded(const PluginRegistry& registry, const LoadedPlugin& plugin, const Options& options);

// What every guard is besides its kind's interface: the plugin's own object, as a pointer to that
// interface (erased, as kinds differ), for capability<C>().
class Guard {
 public:
  virtual ~Guard();
  virtual const void* guarded_object() const = 0;
};

// Capability C of a plugin object (loom/capability.hpp): null when the plugin's own object does
// not derive from C (it predates C, or does not offer it), else the object as C, through its guard
// when it is guarded.
template <class C, class Interface>
const C* capability(const Interface& object) {
  const auto* guard = dynamic_cast<const Guard*>(&object);
  if (!guard) return dynamic_cast<const C*>(&object);
  const auto* own = static_cast<const Interface*>(guard->guarded_object());
  return own != nullptr && dynamic_cast<const C*>(own) != nullptr ? dynamic_cast<const C*>(&object) : nullptr;
}
// The same for an object the host may change (a loaded model generating through its cache).
template <class C, class Interface>
C* capability(Interface& object) {
  return const_cast<C*>(capability<C>(static_cast<const Interface&>(object)));
}

extern template std::unique_ptr<Model> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
extern template std::unique_ptr<Tokenizer> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
extern template std::unique_ptr<Adapter> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
extern template std::unique_ptr<Collator> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
extern template std::unique_ptr<Placement> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);

}  // namespace loom::core
