// Compiled with the runtime room's include folder by the CTest test core_rooms_refuse_a_climbing_include:
// the runtime room sees itself and the rooms below it, so a header of the cli room above it is not
// found (core/CMakeLists.txt). runtime/trainer.cpp included cli/export.hpp until issue 67.
#include "cli/export.hpp"
