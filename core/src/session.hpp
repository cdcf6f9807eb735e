#pragma once
#include <map>
#include <memory>
#include <string>

#include "loom/adapter.hpp"
#include "loom/collator.hpp"
#include "loom/devices.hpp"
#include "loom/model.hpp"
#include "loom/placement.hpp"
#include "loom/tokenizer.hpp"
#include "diagnostics.hpp"
#include "distributed.hpp"
#include "pipeline.hpp"
#include "plugin_registry.hpp"

namespace loom::core {

// A validated pipeline with its plugin objects created. Plugin factories are cheap by contract
// (options and metadata only), so building a Session is still "before anything heavy".
struct Session {
  PipelineSpec spec;
  std::map<std::string, const LoadedPlugin*> plugins;  // section -> plugin that serves it
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Adapter> adapter;
  std::unique_ptr<Collator> collator;
  std::unique_ptr<Placement> placement;
  ModelStructure structure;  // the model's block list, read once (weights as the adapter stores them)
  std::uint64_t base_transient_bytes = 0;  // the adapter's full-precision copy of a base weight at a time
  bool base_quantized = false;             // the adapter stores the base its own way (4-bit)
  std::string base_stored_by_adapter;      // which linears, for the plan: "224 of 225 linears (q_proj, ...)"
};

// Creates every plugin the pipeline names and checks that they fit together (tokenizer ids fit
// the model's vocabulary, the adapter applies to the model). Throws PipelineError pointing at
// the section that is wrong.
Session open_session(PipelineSpec spec, const PluginRegistry& registry);

// [train] activation_checkpointing as "every Nth decoder layer" (1: every layer, 0: none). Throws
// PipelineError at the key when it is none of "none", "every-layer", "every-N".
std::int64_t checkpoint_every(const PipelineSpec& spec);

// The collator's settings from [data] (max_length, truncation).
CollateSettings collate_settings(const PipelineSpec& spec);

// What a training run would trip over before its first step, found without loading weights: the
// first records of the training data collated into at least one sample with labels, sequence
// lengths within the model's positions, CPU threads within the machine's cores. Throws
// PipelineError pointing at the keys to change.
void check_inputs(const Session& session);

// What any command that computes (run, generate) would trip over on this machine: fp16 without a
// CUDA device, more [train] threads than cores. Throws PipelineError; the first form adds to `d`.
void check_machine(const Session& session);
void check_machine(const Session& session, Diagnostics& d);

// The devices process `local_rank` of `local_world` on a host may use: its share of the GPUs (an
// even, contiguous slice) and of host RAM. Throws UserError when the GPUs do not divide evenly.
Inventory rank_inventory(const Inventory& host, int local_rank, int local_world);

// The placement request the session implies for data replica `replica` of `mesh`: dtype, batch and
// sequence length, adapter footprint, the devices of the replica's pipeline ranks (`local_world`
// processes per host, every host like this one; with tensor parallelism the least any tensor rank
// of that pipeline rank has).
PlacementRequest placement_request(const Session& session, const Inventory& inventory, const Mesh& mesh = {}, int local_world = 1,
                                   int replica = 0);

// Runs the placement plugin and checks its plan: every block once and in order, devices known,
// tied weights together, nothing over capacity. Throws UserError otherwise.
Plan make_plan(const Session& session, const PlacementRequest& request);
void check_plan(const PlacementRequest& request, const Plan& plan, const std::string& strategy);

// A plan for every data replica of the mesh (each replica's ranks plan over their own devices).
struct MeshPlan {
  Mesh mesh;
  std::vector<PlacementRequest> requests;  // one per data replica
  std::vector<Plan> replicas;
  const PlacementRequest& request() const { return requests.front(); }
  const Plan& plan() const { return replicas.front(); }
  int local_world = 1;    // processes per host
  int gpus_per_rank = 0;  // each process's contiguous share of its host's GPUs
  std::vector<std::string> host_gpus;  // the host's GPU names, in inventory order
  std::string adapter_storage;         // a plan line: the linears the adapter stores its own way (empty: none)
  // The replica of a world rank, and its pipeline rank there (what BlockPlacement::rank names;
  // the tensor ranks of one pipeline rank hold the same blocks, each its shards).
  int replica_of(int rank) const { return rank / mesh.replica_size(); }
  int pipeline_rank_of(int rank) const { return mesh.coord(rank).pipeline; }
  // A device as the host names it: plans name a rank's GPUs cuda:0.. as the rank sees them.
  std::string physical_device(int rank, const std::string& device) const;
};
MeshPlan make_mesh_plan(const Session& session, const Inventory& inventory, const Mesh& mesh, int local_world);

// The devices of this machine: every CUDA device (free memory) and host RAM (MemAvailable).
Inventory detect_inventory();
// "cuda:0=16GiB,cuda:1=16GiB,cpu=64GiB" (loom plan --devices) -> simulated inventory. Throws UserError.
Inventory parse_inventory(const std::string& text);

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
