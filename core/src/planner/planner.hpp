#pragma once
// The planner: from a session and the devices, a plan for every data replica of the mesh. The
// placement plugin decides where blocks go; the planner asks it with the request the pipeline
// implies, checks what it returns and repeats it over the replicas and hosts.
#include <optional>
#include <map>
#include <string>
#include <vector>

#include "loom/devices.hpp"
#include "loom/mesh.hpp"
#include "loom/placement.hpp"
#include "config/session.hpp"
#include "runtime/micro_batches.hpp"

namespace loom::core {

// The devices process `local_rank` of `local_world` on a host may use: its share of the GPUs (an
// even, contiguous slice) and of host RAM. Throws UserError when the GPUs do not divide evenly.
Inventory rank_inventory(const Inventory& host, int local_rank, int local_world);

// The placement request the session implies for data replica `replica` of `mesh`: dtype, batch and
// sequence length, adapter footprint, the devices of the replica's pipeline ranks (`local_world`
// processes per host, every host like this one; with tensor parallelism the least any tensor rank
// of that pipeline rank has). With `largest` (largest_micro_batch()), batch and sequence length are
// that micro-batch's rows and tokens a row, not [train] batch_size rows of [data] max_length.
PlacementRequest placement_request(const Session& session, const Inventory& inventory, const Mesh& mesh = {}, int local_world = 1,
                                   int replica = 0, const MicroBatchShape* largest = nullptr);

// The largest micro-batch of the run's draws from its training data (runtime/micro_batches.hpp),
// for every data rank of `mesh`, or the evaluator's largest batch where that has more tokens.
// nullopt without training data, a collator and a tokenizer, or when the collator keeps no sample
// (the check before training reports that); `why_not` then says why where the plan should note it
// (the data file not there yet, or not readable: the run itself reports that).
std::optional<MicroBatchShape> data_micro_batch(const Session& session, const Mesh& mesh, std::string& why_not);

// Runs the placement plugin and checks its plan: every block once and in order, devices known,
// tied weights together, nothing over capacity. Throws UserError otherwise.
Plan make_plan(const Session& session, const PlacementRequest& request);
void check_plan(const PlacementRequest& request, const Plan& plan, const std::string& strategy);

// A plan for every data replica of the mesh (each replica's ranks plan over their own devices).
struct MeshPlan {
  Mesh mesh;
  int expert = 1;  // [parallel] expert: data ranks sharing out each layer's experts
  std::vector<PlacementRequest> requests;  // one per data replica
  std::vector<Plan> replicas;
  const PlacementRequest& request() const { return requests.front(); }
  const Plan& plan() const { return replicas.front(); }
  int local_world = 1;    // processes per host
  int gpus_per_rank = 0;  // each process's contiguous share of its host's GPUs
  std::vector<std::string> host_gpus;  // the host's GPU names, in inventory order
  std::string adapter_storage;         // a plan line: the linears the adapter stores its own way (empty: none)
  std::string optimizer;               // [train] optimizer, as the plan counted its state
  // Generation's cache per device of the first replica's plan: bytes per position of one row
  // (empty when the model does not say: it lacks StaticCacheSizing).
  struct CacheUse {
    int rank = 0;
    std::string device;
    std::uint64_t bytes_per_position = 0;  // of the blocks that keep every position of a row
    // Blocks that keep at most a window of a row's positions (sliding layers, StaticCacheWindow):
    // their bytes a position, by window.
    std::map<std::int64_t, std::uint64_t> windowed;
    // A cache of `rows` rows made for `capacity` positions.
    std::uint64_t bytes(std::int64_t rows, std::int64_t capacity) const;
  };
  std::vector<CacheUse> generation_cache;
  std::int64_t evaluation_positions = 0;  // [data] max_length + [train] max_new_tokens: what evaluation's rows may reach
  // How far the settings stretch on these devices (fit_limits), where the plan's maker asked.
  struct Fit {
    std::int64_t batch_size = 0, max_length = 0;  // the settings each search held: [train] batch_size, [data] max_length
    std::int64_t longest = 0, longest_limit = 0;  // the longest max_length a micro-batch of batch_size rows fits at (0: none), searched to
    std::int64_t most_rows = 0, most_rows_limit = 0;  // the largest batch_size of max_length tokens a row that fits, searched to
    bool fits_with_recompute = false;  // the settings' micro-batch fits with every layer recomputed (asked where it does not fit as set)
    bool fits_with_offload = false;    // ... with every layer recomputed and its input in host memory (asked where recomputing does not fit)
  };
  std::optional<Fit> fit;
  // The replica of a world rank, and its pipeline rank there (what BlockPlacement::rank names;
  // the tensor ranks of one pipeline rank hold the same blocks, each its shards).
  int replica_of(int rank) const { return rank / mesh.replica_size(); }
  int pipeline_rank_of(int rank) const { return mesh.coord(rank).pipeline; }
  // A device as the host names it: plans name a rank's GPUs cuda:0.. as the rank sees them.
  std::string physical_device(int rank, const std::string& device) const;
};
// The longest [data] max_length that [train] batch_size rows fit at on `devices`, and the largest
// batch_size at [data] max_length (each to the model's positions and 65,536 rows), found by
// planning trial micro-batches as make_mesh_plan plans the real one (every data replica); and,
// where the settings' own micro-batch does not fit and not every layer is recomputed, whether
// recomputing every layer makes it fit, and if not, whether offloading their inputs does. Memory
// is taken to grow with rows and tokens.
MeshPlan::Fit fit_limits(const Session& session, const Inventory& devices, const Mesh& mesh, int local_world);
// The fit's sentence for an error or the plan: what fits with these settings.
std::string fit_text(const MeshPlan::Fit& fit);

// With `from_data` (`loom plan` and `loom run`), activations are planned for the run's largest
// micro-batch of its data (data_micro_batch()), else for [train] batch_size rows of [data]
// max_length (validation, generation: nothing of the training data is read).
MeshPlan make_mesh_plan(const Session& session, const Inventory& inventory, const Mesh& mesh, int local_world, bool from_data = false);
// Logs what generation's cache of `rows` rows of `capacity` positions takes on each device of
// pipeline rank `rank`, and refuses (UserError) where a GPU cannot hold it beside what it holds.
void check_generation_cache(const MeshPlan& plan, int rank, std::int64_t rows, std::int64_t capacity);
// The most of `rows` rows (at least 1) whose cache fits in nine tenths of what each device of
// pipeline rank `rank` has left (evaluation takes fewer rows rather than stopping a run); refuses
// (UserError) where not even one row fits.
std::int64_t generation_rows_that_fit(const MeshPlan& plan, int rank, std::int64_t rows, std::int64_t capacity);

// The devices of this machine: every CUDA device (free memory) and host RAM (MemAvailable).
Inventory detect_inventory();
// "cuda:0=16GiB,cuda:1=16GiB@7.5,cpu=64GiB" (loom plan --devices) -> simulated inventory; a GPU's
// "@MAJOR.MINOR" is its compute capability, into `capabilities` (0 where not named). Throws UserError.
Inventory parse_inventory(const std::string& text, GpuCapabilities* capabilities = nullptr);

}  // namespace loom::core
