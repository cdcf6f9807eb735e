#include "planner/rank_setup.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "loom/kit/torch_compat.hpp"

namespace loom::core {

RankSetup set_up_rank(const Session& session, const MeshPlan& mesh_plan, const std::optional<Rendezvous>& rendezvous) {
  const int rank = rendezvous ? rendezvous->rank : 0;
  RankSetup r;
  r.plan = mesh_plan.replicas[static_cast<std::size_t>(mesh_plan.replica_of(rank))];
  for (auto& b : r.plan.blocks) b.device = mesh_plan.physical_device(rank, b.device);
  r.pipeline_rank = mesh_plan.pipeline_rank_of(rank);
  if (const auto cap = session.config.gpu_memory; cap > 0)
    for (const auto& b : r.plan.blocks)
      if (b.rank == r.pipeline_rank && b.device != "cpu") kit::compat::limit_cuda_memory(parse_device(b.device).index, cap);
  if (!rendezvous || rendezvous->world == 1) {
    r.parallel = single_process();
    return r;
  }
  bool cuda = false;
  for (const auto& b : r.plan.blocks)
    if (b.rank == r.pipeline_rank && b.device != "cpu" && !cuda) {
      cuda = true;
      kit::compat::set_cuda_device(parse_device(b.device).index);
    }
  const auto timeout = std::chrono::seconds(session.config.timeout_s);
  // The pipeline as every rank resolved it, digested (FNV-1a): part of the run's identity.
  Rendezvous joining = *rendezvous;
  std::uint64_t digest = 14695981039346656037ull;
  for (const unsigned char c : session.spec.resolved().dump()) digest = (digest ^ c) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(digest));
  joining.run += (joining.run.empty() ? "" : "/") + std::string(hex);
  r.parallel = connect(joining, mesh_plan.mesh, cuda, timeout, std::nullopt, mesh_plan.expert);
  spdlog::debug("rank {} of {} ({}) connected; local rank {}", rank, rendezvous->world, mesh_plan.mesh.str(), rendezvous->local_rank);
  return r;
}

void share_cores(const Session& session, int local_world) {
  const auto threads = session.config.threads;
  if (threads > 0) kit::compat::set_cpu_threads(static_cast<int>(threads));
  else if (local_world > 1) kit::compat::set_cpu_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / local_world));
}

}  // namespace loom::core
