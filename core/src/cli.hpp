#pragma once

namespace loom::core {

// The `loom` command line. Returns the process exit code: 0 success, 2 user error (one clear
// message, no stack trace), 1 internal error.
int run_cli(int argc, char** argv);

}  // namespace loom::core
