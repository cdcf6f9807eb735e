#pragma once
#include <string>
#include <vector>

namespace loom::core {

// `loom run --nproc-per-node N`: starts N copies of this program with `args` (the same command
// without --nproc-per-node) and torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), prefixes every line they print
// with "[rank R] ", forwards SIGINT/SIGTERM to them, and when one fails stops the others and
// returns that failure's exit code (128 + signal for a rank killed by a signal). Returns 0 when
// all succeed.
int launch_local_workers(int nproc, const std::vector<std::string>& args);

}  // namespace loom::core
