#pragma once
// The memory model every placement counts with (loom::kit::block_memory), so plans from different
// strategies are comparable and the host checks them the same way.
#include <cstdint>
#include <vector>

#include "loom/export.hpp"
#include "loom/placement.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// loom's foreach optimizers (AdamW, Lion, SGD) update slices of at most this many values at a
// time, each needing float32 temporaries beside the state.
inline constexpr std::int64_t kOptimizerSliceValues = std::int64_t{1} << 24;

// What the run's optimizer keeps beside each trainable value and what its step needs for a while
// (kit 3.2). Every optimizer also keeps a float32 master copy of a bf16/fp16 value, and a float32
// copy of a narrower gradient while it updates it; block_memory counts those on top.
struct OptimizerMemory {
  double state_bytes = 8;  // per trainable value: AdamW's two float32 moments
  double step_bytes = 4;   // float32 temporaries per value updated at once: AdamW's denominators
  // Values updated at once; 0: a whole tensor at a time (Adafactor's factored statistics need
  // every row), counted as the block's largest trainable tensor.
  std::int64_t step_values = kOptimizerSliceValues;
};
// The optimizer block_memory counts with, for this process: the host sets the one its run trains
// with ([train] optimizer) before asking a placement for a plan, which counts it the same way;
// AdamW's until then.
LOOM_API void count_optimizer_as(const OptimizerMemory& memory);
LOOM_API OptimizerMemory counted_optimizer();
// Whether a recomputed layer's saved input waits for backward in host memory ([train]
// activation_checkpointing = "offload"; kit 4.2), set by the host as the optimizer is:
// block_memory then counts it on no device but the copy being brought back beside the one in use,
// and device_usage counts the inputs on their rank's "cpu".
LOOM_API void count_checkpoints_offloaded(bool offloaded);
LOOM_API bool counted_checkpoints_offloaded();

// Memory one block needs where it is placed. Every strategy counts with block_memory() so plans
// from different strategies are comparable.
struct BlockMemory {
  std::uint64_t weights = 0;
  std::uint64_t trainable_state = 0;  // trainable weights' gradients + the optimizer's state and master copies (+ adapter weights)
  std::uint64_t activations = 0;      // saved for backward at batch_size x seq_len x micro-batches in flight
  std::uint64_t working = 0;          // transient peak inside the block (or of the optimizer's step over its values)
};
// Counts the block's weights in full; device_usage() counts a tied group once per device.
// `in_flight` overrides the request's micro_batches_in_flight (0: keep it).
LOOM_API BlockMemory block_memory(const PlacementRequest& request, std::size_t block_index, std::int64_t in_flight = 0);
// Whether [train] activation_checkpointing recomputes block `block_index` (a decoder layer).
LOOM_API bool block_checkpointed(const PlacementRequest& request, std::size_t block_index);

// Sums block_memory() for the blocks `plan.blocks` puts on each rank's device; `in_flight`, when
// given, holds the micro-batches in flight of each block (a pipeline stage's, from its schedule).
LOOM_API std::vector<DeviceUsage> device_usage(const PlacementRequest& request,
                                               const std::vector<BlockPlacement>& blocks,
                                               const std::vector<std::int64_t>& in_flight = {});

}  // namespace loom::kit
