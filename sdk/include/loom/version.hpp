#pragma once
#include <cstdint>
#include <string>

#include "loom/export.hpp"

// SDK version rules: a minor bump only appends (new virtuals at the end of interfaces, new kinds,
// new option types); a major bump may break. The host loads a plugin built against the same major
// and a minor not newer than its own, and calls a virtual a minor appended only on plugins built
// at that minor or later (core/src/plugin_guard.cpp; each such virtual says "SDK 2.N" in its
// comment, and a test holds the guards to it). The CMake package's version is this one:
// find_package(Loom 2.4) asks for an SDK with what 2.4 added.
#define LOOM_SDK_VERSION_MAJOR 2
#define LOOM_SDK_VERSION_MINOR 4

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
