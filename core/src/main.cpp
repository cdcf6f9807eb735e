#include <malloc.h>

#include <csignal>
#include <cstdlib>

#include "cli/cli.hpp"

namespace {

// LibTorch's CPU tensors come from malloc. glibc serves blocks above its mmap threshold with fresh
// mappings, and moves that threshold as blocks are freed, so how often a training step's
// activations fault in fresh zeroed pages depended on what the process happened to free first:
// the quickstart ran at 10k or 8.7k tokens/s by that history alone, and at 18k with the threshold
// fixed at glibc's largest (bench/RESULTS.md, "Host allocator"). Blocks up to 32 MiB are kept and
// reused; the top of the heap is returned once 256 MiB of it is free. A user's own malloc
// settings (GLIBC_TUNABLES or MALLOC_*_ variables) are left as they are.
void fix_malloc_thresholds() {
  for (const char* name : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"})
    if (std::getenv(name) != nullptr) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  fix_malloc_thresholds();
  // Past a file size limit (ulimit -f), a write fails with EFBIG and is reported like a full
  // disk, instead of the default SIGXFSZ killing the process mid-write.
  std::signal(SIGXFSZ, SIG_IGN);
  return loom::core::run_cli(argc, argv);
}
