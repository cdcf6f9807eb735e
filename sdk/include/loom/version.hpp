#pragma once
#include <cstdint>
#include <string>

#include "loom/export.hpp"

// SDK version rules: a minor bump only appends (new virtuals at the end of interfaces, new kinds,
// new option types); a major bump may break. The host loads a plugin built against the same major
// and a minor not newer than its own.
#define LOOM_SDK_VERSION_MAJOR 2
#define LOOM_SDK_VERSION_MINOR 3

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
