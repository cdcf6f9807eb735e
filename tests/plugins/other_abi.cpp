// A plugin built with the other C++ standard library ABI. LibTorch's CMake package puts
// -D_GLIBCXX_USE_CXX11_ABI=1 last on every command line it reaches, so the choice is made here,
// before the first standard header. It calls nothing of the SDK's, so it loads, and the host must
// refuse it by its descriptor before any std::string crosses between them.
#undef _GLIBCXX_USE_CXX11_ABI
#define _GLIBCXX_USE_CXX11_ABI 0
#include "loom/plugin.hpp"

namespace {
std::vector<loom::OptionSpec> options() { return {}; }
std::unique_ptr<loom::Plugin> create(const loom::Options&) { return nullptr; }
}  // namespace

LOOM_PLUGIN(loom::kKindCollator, "other-abi", "1.0.0", "built with the other C++ ABI", options, create)
