#pragma once
// How SDK 3 grows. After 3.0 no class of the contract gains a virtual and no struct a member:
// their layouts are what every 3.x plugin was built against. What a later minor adds is a
// capability, a new class deriving from Capability that a plugin's object derives from as well.
// The host finds it with dynamic_cast and, where the object lacks it (a plugin built before it
// existed, or one that does not offer it), does without. tests/registry_test.cpp holds the
// contract's classes and data to this.
#include "loom/export.hpp"

namespace loom {

class LOOM_API Capability {
 public:
  virtual ~Capability();  // defined in the SDK library: one typeinfo for host and plugins
};

}  // namespace loom
