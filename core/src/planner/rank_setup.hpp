#pragma once
// A process's set-up for a run, between the plan and the runtime: its replica's plan on its host's
// devices, its place in the mesh and its groups, and its share of the host's cores.
#include <memory>
#include <optional>

#include "loom/communicator.hpp"
#include "loom/placement.hpp"
#include "config/session.hpp"
#include "distributed/distributed.hpp"
#include "planner/planner.hpp"

namespace loom::core {

// This process's part of a run: its replica's plan (on the host's device names), its pipeline
// rank, and its groups (NCCL when its blocks are on a GPU, that GPU made current). Without a
// rendezvous (or a world of one) the groups are one process's.
struct RankSetup {
  Plan plan;
  int pipeline_rank = 0;
  std::unique_ptr<Parallel> parallel;
};
RankSetup set_up_rank(const Session& session, const MeshPlan& mesh_plan, const std::optional<Rendezvous>& rendezvous);

// Applies [train] threads to the calling thread's CPU work; processes sharing a host share its
// cores unless [train] threads says otherwise.
void share_cores(const Session& session, int local_world);

}  // namespace loom::core
