#pragma once
#include <cstdint>
#include <string>

#include "loom/export.hpp"

// SDK version rules. The SDK is the contract: the plugin interfaces and the data that crosses them
// (what plugins share beyond that, the kit, is versioned apart: loom/kit/version.hpp). A minor
// adds capability interfaces (loom/capability.hpp), kinds and option types, and never a virtual
// to a class that exists; a major may break. The host loads a plugin built against the same major
// and a minor not newer than its own. The CMake package's version is this one:
// find_package(Loom 3.0) asks for an SDK with what 3.0 has.
//   3.1: ChatTemplateSource (loom/tokenizer.hpp).
//   3.2: StaticCacheDecoding, StaticKVCache, CachedPass, StaticCacheSizing (loom/model.hpp).
//   3.3: PackedSequences (loom/model.hpp).
//   3.4: FrozenHeadWorkingSet (loom/model.hpp).
//   3.5: DeltaAddedInPlace (loom/layers.hpp).
//   3.6: WholeProduct (loom/layers.hpp).
//   3.7: FoldableDelta (loom/layers.hpp).
//   3.8: PluginDescriptor::model_types, appended (LOOM_MODEL_PLUGIN; loom/plugin.hpp): read only
//        from a 3.8 plugin, so the descriptor is the one struct that grows, at its end.
//   3.9: StaticCacheWindow (loom/model.hpp).
//   3.10: AuxiliaryLoss, ExpertsDelta, NamedExperts, ExpertWeights, ExpertsInfo, ExpertStructure (loom/model.hpp);
//         ExpertAdapterSizing (loom/adapter.hpp).
//   3.11: AllToAll, ExpertParallel (loom/communicator.hpp); ExpertsHeld, ExpertShards (loom/model.hpp).
//   3.12: the objective and reward kinds: Objective (loom/objective.hpp), Reward (loom/reward.hpp).
//   3.13: PluginDescriptor::kit_major and kit_minor, appended (loom/plugin.hpp): the kit a plugin
//         was built against, checked when it loads. scripts/check-abi.sh holds the SDK's library to
//         every recorded minor of its major (abi/).
//   3.14: TokenCountedMemory, HeadTokenLogps (loom/model.hpp).
#define LOOM_SDK_VERSION_MAJOR 3
#define LOOM_SDK_VERSION_MINOR 14

namespace loom {

struct LOOM_API Version {
  std::uint16_t major = 0;
  std::uint16_t minor = 0;
  std::uint16_t patch = 0;
  std::string str() const;  // "major.minor.patch"
};

// Version of the SDK library loaded in this process (not the headers a plugin was compiled with).
LOOM_API Version sdk_version();
// loom's own release version, shared by host and SDK.
LOOM_API std::string loom_version();

}  // namespace loom
