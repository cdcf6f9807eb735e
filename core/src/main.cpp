#include <csignal>

#include "cli/cli.hpp"

int main(int argc, char** argv) {
  loom::core::tune_host_allocator();
  // Past a file size limit (ulimit -f), a write fails with EFBIG and is reported like a full
  // disk, instead of the default SIGXFSZ killing the process mid-write.
  std::signal(SIGXFSZ, SIG_IGN);
  // A peer rank that dies closes its sockets; the next send to it must fail as an error that names
  // the lost rank (exit 3), not kill this rank with SIGPIPE (seen with the CUDA build's Gloo).
  std::signal(SIGPIPE, SIG_IGN);
  return loom::core::run_cli(argc, argv);
}
