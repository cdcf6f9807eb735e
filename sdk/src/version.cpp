#include "loom/version.hpp"

namespace loom {

std::string Version::str() const {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

Version sdk_version() { return {LOOM_SDK_VERSION_MAJOR, LOOM_SDK_VERSION_MINOR, 0}; }

std::string loom_version() { return LOOM_VERSION_STRING; }

}  // namespace loom
