#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/devices.hpp"
#include "loom/export.hpp"
#include "loom/mesh.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"
#include "loom/schedule.hpp"

namespace loom {

struct PlacementRequest {
  ModelStructure model;
  // Trainable parameters per block added by the adapter; empty means full fine-tuning.
  std::vector<std::uint64_t> adapter_trainable;
  DType dtype = DType::kFloat32;
  std::int64_t batch_size = 1;  // per micro-batch, per data rank
  std::int64_t seq_len = 1;
  // Micro-batches whose activations a block keeps at once (a pipeline schedule keeps several).
  std::int64_t micro_batches_in_flight = 1;
  // Micro-batches per optimizer step ([train] grad_accum): what a pipeline schedule runs.
  std::int64_t micro_batches = 1;
  // Decoder layers whose activations are recomputed in backward instead of kept: every Nth one
  // (1: every layer; 0: none). Such a layer keeps only its input.
  std::int64_t checkpoint_every = 0;
  // The process mesh. A placement plans one data replica: its pipeline x tensor ranks; the host
  // repeats that plan for every data rank.
  Mesh mesh;
  // The devices each pipeline rank of one replica may use, in rank order (mesh.pipeline entries;
  // with tensor parallelism, the least any tensor rank of that pipeline rank has).
  std::vector<Inventory> ranks;
  // Transient bytes a decoder layer's products add to its working set (a 4-bit base's
  // dequantized matrix, one at a time); from the adapter's BaseStorage.
  std::uint64_t transient_bytes = 0;
};

struct BlockPlacement {
  std::string block;
  std::string device;
  int rank = 0;  // which rank of the replica runs it
  int stage = 0;  // its pipeline stage (0 without a pipeline schedule)
};

struct DeviceUsage {
  std::string device;
  int rank = 0;  // of the replica
  std::uint64_t capacity = 0;
  std::uint64_t weights = 0;
  std::uint64_t trainable_state = 0;
  std::uint64_t activations = 0;
  std::uint64_t working = 0;  // the largest block's working set on this device (not a sum)
  std::uint64_t total() const { return weights + trainable_state + activations + working; }
};

// Placement is data: printable, serialisable, applied only after it has been checked.
struct Plan {
  std::string strategy;
  Mesh mesh;                           // set by the host from the request
  std::vector<BlockPlacement> blocks;  // in model order, for one data replica
  std::vector<DeviceUsage> devices;    // (rank, device) pairs used, in first-use order
  std::vector<std::string> notes;      // why each decision was taken
  // How the replica's ranks run the stages of `blocks` (empty: every rank runs its blocks in
  // order for each micro-batch, as one process does). Blocks of one stage are contiguous, on one
  // rank and device; tied blocks on different ranks keep a copy each, their gradients summed.
  PipelineSchedule schedule;
};

class LOOM_API Placement : public Plugin {
 public:
  ~Placement() override;  // defined in the SDK library: one typeinfo for host and plugins
  // Throws UserError when the model cannot be placed, saying what is missing where.
  virtual Plan plan(const PlacementRequest& request) const = 0;
};

}  // namespace loom
