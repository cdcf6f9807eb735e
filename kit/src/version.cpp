#include "loom/kit/version.hpp"

namespace loom::kit {

Version kit_version() { return {LOOM_KIT_VERSION_MAJOR, LOOM_KIT_VERSION_MINOR, 0}; }

std::uint16_t kit_layout_minor() { return LOOM_KIT_LAYOUT_MINOR; }

}  // namespace loom::kit
