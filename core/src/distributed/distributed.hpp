#pragma once
// The processes of one run: where this one sits (from torchrun's, Slurm's or loom's own launcher
// environment), the mesh the pipeline asks for, and the c10d groups that connect them.
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "loom/communicator.hpp"
#include "config/run_config.hpp"

namespace loom::core {

struct Rendezvous {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr;
  int master_port = 0;
  std::string source;  // "torchrun", "slurm": which variables it came from
  // What makes the ranks one run, the same on each: the launch's id where the launcher gives one
  // (LOOM_RUN_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID.SLURM_STEP_ID), then the pipeline's digest
  // (set_up_rank adds it). Ranks of two runs that share MASTER_PORT are refused, never mixed.
  std::string run;
};

// The rendezvous the environment describes: torchrun's RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, or Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
// (with MASTER_ADDR and MASTER_PORT). nullopt when none is set (one process); UserError naming the
// variable when one is missing, malformed or inconsistent.
std::optional<Rendezvous> rendezvous_from_env();

// The processes [parallel] names when it sets data (data x pipeline x tensor); 0 when data = 0
// leaves the count to the launch.
int requested_world(const RunConfig& config);

// The mesh [parallel] asks for over `world` processes; data = 0 takes what the other axes leave.
// Throws PipelineError pointing at [parallel] when the product is not the world size.
Mesh resolve_mesh(const RunConfig& config, int world);

// [parallel] expert: the data ranks that share out a mixture of experts' experts (1: none).
// Throws PipelineError at the key when it does not divide `mesh`'s data ranks.
int resolve_expert_ranks(const RunConfig& config, const Mesh& mesh);

// This process's groups over c10d: NCCL when `cuda` (tensors on cuda:local_rank), Gloo otherwise.
// Every rank of the rendezvous calls it; it returns once all have joined, or throws UserError
// naming the ranks that did not within `timeout`. A watchdog thread then makes this process exit
// (code 3) with one line naming the rank when a collective waits longer than `timeout` for a
// rank that died or hangs. `join_timeout` bounds the rendezvous and the groups' connections when
// given: a run uses [run] timeout for both; a test that shortens only the watchdog's gives more.
// With `expert_ranks` > 1 the Parallel offers ExpertParallel over runs of that many data ranks.
std::unique_ptr<Parallel> connect(const Rendezvous& rendezvous, const Mesh& mesh, bool cuda, std::chrono::seconds timeout,
                                  std::optional<std::chrono::seconds> join_timeout = std::nullopt, int expert_ranks = 1);

// The data ranks that share out a mixture of experts' experts (ExpertParallel::expert()'s size; 1
// without expert parallelism).
int expert_ranks(Parallel& parallel);
// ExpertParallel::expert(), or null without expert parallelism.
Communicator* expert_group(Parallel& parallel);

// Every group of one rank, for a one-process run.
std::unique_ptr<Parallel> single_process();

// Marks the start of step `step` for the watchdog's messages ("rank 1 is at step 4").
void note_progress(std::int64_t step);

inline constexpr int kExitPeerFailed = 3;

}  // namespace loom::core
