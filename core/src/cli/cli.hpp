#pragma once
#include <optional>
#include <string>
#include <vector>

#include "distributed/distributed.hpp"

namespace loom::core {

// The `loom` command line. Returns the process exit code: 0 success, 2 user error (one clear
// message, no stack trace), 1 internal error, 3 another rank died or hung.
int run_cli(int argc, char** argv);

// As above, from the program name and its arguments. `rank`, when given, stands in for the
// rendezvous a launcher's environment would describe (RANK, WORLD_SIZE, ...) for `run` and
// `generate`: the tests run the ranks of one run as threads of one process, each its own.
int run_cli(const std::vector<std::string>& argv, const std::optional<Rendezvous>& rank = std::nullopt);

// Fixes glibc's malloc thresholds for LibTorch's CPU tensors (see the definition); called first
// by `loom` and by the test binary, which runs commands in its own process.
void tune_host_allocator();

}  // namespace loom::core
