#pragma once
// The contract between a plugin library and the host. A plugin library exports exactly one
// descriptor through the LOOM_PLUGIN macro; the host reads its frozen prefix (magic and versions)
// before it touches anything else, and refuses the library on a mismatch.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <boost/dll/alias.hpp>
#include <torch/csrc/api/include/torch/version.h>

#include "loom/export.hpp"
#include "loom/options.hpp"
#include "loom/version.hpp"

namespace loom {

// Plugin kinds the SDK defines; the kind is a string in the descriptor so that a new kind is an
// append, not an ABI change. Each kind has an interface class deriving from Plugin.
inline constexpr const char* kKindModel = "model";
inline constexpr const char* kKindTokenizer = "tokenizer";
inline constexpr const char* kKindAdapter = "adapter";
inline constexpr const char* kKindCollator = "collator";
inline constexpr const char* kKindPlacement = "placement";
inline constexpr const char* kKindObjective = "objective";  // SDK 3.12 (loom/objective.hpp)
inline constexpr const char* kKindReward = "reward";        // SDK 3.12 (loom/reward.hpp)
LOOM_API const std::vector<std::string>& plugin_kinds();

// Options every plugin of a kind accepts in addition to its own (e.g. every tokenizer takes
// add_bos/add_eos/padding_side/pad_token). The host merges them into the plugin's schema.
LOOM_API std::vector<OptionSpec> common_options(const std::string& kind);

// Base of every object a plugin factory creates. The host dynamic_casts it to the kind's interface.
class LOOM_API Plugin {
 public:
  virtual ~Plugin();
};

using PluginFactory = std::unique_ptr<Plugin> (*)(const Options& options);
using OptionSchema = std::vector<OptionSpec> (*)();
// A model plugin's config.json `model_type` values (SDK 3.8): a [model] section that names no
// plugin takes the one whose list holds its folder's model_type.
using ModelTypes = std::vector<std::string> (*)();

inline constexpr std::uint32_t kDescriptorMagic = 0x4d4f4f4c;  // "LOOM" little-endian

// PluginDescriptor::flags (0 in plugins of SDK 2.3 and older): what else must match
// the host for the plugin's C++ types to be the host's. kFlagsSet says the others were recorded.
inline constexpr std::uint16_t kFlagsSet = 0x8000;
inline constexpr std::uint16_t kFlagCxx11Abi = 0x0001;  // built with _GLIBCXX_USE_CXX11_ABI=1 (std::string, std::list)
// The flags of the code that includes this header.
inline constexpr std::uint16_t kBuildFlags = kFlagsSet
#if defined(_GLIBCXX_USE_CXX11_ABI) && _GLIBCXX_USE_CXX11_ABI
                                             | kFlagCxx11Abi
#endif
    ;

struct PluginDescriptor {
  // Frozen prefix: plain C layout, identical in every SDK major, so any host can read it and
  // refuse a plugin politely.
  std::uint32_t magic;
  std::uint16_t sdk_major;
  std::uint16_t sdk_minor;
  std::uint16_t torch_major;
  std::uint16_t torch_minor;
  std::uint16_t torch_patch;
  std::uint16_t flags;  // kBuildFlags
  const char* kind;
  const char* name;
  const char* version;  // the plugin's own version
  const char* summary;  // one line for `loom plugins`
  // Valid only when sdk_major matches the host's.
  OptionSchema options;
  PluginFactory create;
  // Appended in SDK 3.8: the host reads it only from a plugin whose sdk_minor is 8 or more, whose
  // descriptor has it. Model plugins (LOOM_MODEL_PLUGIN) fill it; every other plugin leaves it null.
  ModelTypes model_types;
  // Appended in SDK 3.13, read from plugins of 3.13 on: the kit version the plugin was built
  // against (loom/kit/version.hpp), 0.0 for one built without the kit. The host refuses a kit newer
  // than its own, or older than its kit's layout minor.
  std::uint16_t kit_major;
  std::uint16_t kit_minor;
};

// The kit version a plugin builds against: 0 (none) unless loom/kit/version.hpp, included before
// LOOM_PLUGIN, declares the closer match built_kit_version(int).
constexpr std::uint32_t built_kit_version(long) { return 0; }

}  // namespace loom

// Name of the exported Boost.DLL alias the host looks up.
#define LOOM_PLUGIN_ENTRY_NAME "loom_plugin_descriptor"

// Declares this library's plugin. Use once per library, at global scope:
//   LOOM_PLUGIN(loom::kKindTokenizer, "bytes", "0.1.0", "byte-level tokenizer", options, create)
// where `options` returns the option schema and `create` builds the plugin from validated options.
// A model plugin uses LOOM_MODEL_PLUGIN, which also names the config.json model_types it reads:
//   LOOM_MODEL_PLUGIN("llama", "0.2.0", "Llama decoder family", options, create, model_types)
#define LOOM_PLUGIN(KIND, NAME, VERSION, SUMMARY, OPTIONS_FN, CREATE_FN) LOOM_PLUGIN_DESCRIPTOR(KIND, NAME, VERSION, SUMMARY, OPTIONS_FN, CREATE_FN, nullptr)
#define LOOM_MODEL_PLUGIN(NAME, VERSION, SUMMARY, OPTIONS_FN, CREATE_FN, MODEL_TYPES_FN) \
  LOOM_PLUGIN_DESCRIPTOR(::loom::kKindModel, NAME, VERSION, SUMMARY, OPTIONS_FN, CREATE_FN, MODEL_TYPES_FN)
#define LOOM_PLUGIN_DESCRIPTOR(KIND, NAME, VERSION, SUMMARY, OPTIONS_FN, CREATE_FN, MODEL_TYPES_FN) \
  namespace loom_plugin_entry {                                                                  \
  const ::loom::PluginDescriptor* describe() {                                                   \
    static const ::loom::PluginDescriptor descriptor{                                            \
        ::loom::kDescriptorMagic, LOOM_SDK_VERSION_MAJOR, LOOM_SDK_VERSION_MINOR,                \
        TORCH_VERSION_MAJOR,      TORCH_VERSION_MINOR,    TORCH_VERSION_PATCH,                   \
        ::loom::kBuildFlags,      KIND,                   NAME,                                  \
        VERSION,                  SUMMARY,                OPTIONS_FN,                            \
        CREATE_FN,                MODEL_TYPES_FN,                                                \
        static_cast<std::uint16_t>(::loom::built_kit_version(0) >> 16),                          \
        static_cast<std::uint16_t>(::loom::built_kit_version(0) & 0xFFFFu)};                     \
    return &descriptor;                                                                          \
  }                                                                                              \
  }                                                                                              \
  BOOST_DLL_ALIAS(loom_plugin_entry::describe, loom_plugin_descriptor)
