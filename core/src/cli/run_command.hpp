#pragma once
// `loom run` for one process: everything after the command line is read. The CLI calls it with
// the rendezvous its environment describes; the tests call it from one thread per rank, each with
// its own rendezvous, so a matrix of meshes runs in one process over real c10d groups.
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distributed/distributed.hpp"

namespace loom::core {

struct RunCommand {
  std::filesystem::path pipeline;
  std::vector<std::string> overrides;  // --set SECTION.KEY=VALUE, --output folded in as run.output_dir
  bool resume = false;
  bool dry_run = false;
  bool json = false;  // the summary as one JSON document on stdout (the progress lines go to stderr)
  std::vector<std::string> argv;  // the command as typed, recorded in run.json
};

// Validates, plans, checks the output folder, connects to the other ranks of `rendezvous` (none:
// one process), writes run.json (rank 0) and trains; rank 0 prints the summary. Returns the
// process's exit code (128 + signal when SIGTERM/SIGINT stopped the run at a checkpoint); throws
// what `exit_code_of` turns into a message.
int run_rank(const RunCommand& command, const std::optional<Rendezvous>& rendezvous);

// A run folder's run.json, read with a bound; UserError naming the file unless it is a JSON object.
nlohmann::json read_manifest(const std::filesystem::path& path);

}  // namespace loom::core
