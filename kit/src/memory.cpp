#include "loom/kit/memory.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>

namespace loom::kit {
namespace {
std::mutex counted_mutex;
OptimizerMemory counted;  // under counted_mutex
bool offloaded_checkpoints = false;  // under counted_mutex

// The optimizer's state per trainable value, and a float32 master copy of a value stored narrower.
std::uint64_t state_bytes(const OptimizerMemory& o, std::uint64_t values, std::uint64_t value_bytes) {
  return static_cast<std::uint64_t>(std::ceil(o.state_bytes * static_cast<double>(values))) + values * (value_bytes < 4 ? 4 : 0);
}
// Its step's temporaries over `values` updated at once, with a float32 copy of a narrower gradient.
std::uint64_t step_bytes(const OptimizerMemory& o, std::uint64_t values, std::uint64_t value_bytes) {
  return static_cast<std::uint64_t>(std::ceil((o.step_bytes + (value_bytes < 4 ? 4 : 0)) * static_cast<double>(values)));
}
}  // namespace

void count_optimizer_as(const OptimizerMemory& memory) {
  std::lock_guard<std::mutex> lock(counted_mutex);
  counted = memory;
}

OptimizerMemory counted_optimizer() {
  std::lock_guard<std::mutex> lock(counted_mutex);
  return counted;
}

void count_checkpoints_offloaded(bool offloaded) {
  std::lock_guard<std::mutex> lock(counted_mutex);
  offloaded_checkpoints = offloaded;
}

bool counted_checkpoints_offloaded() {
  std::lock_guard<std::mutex> lock(counted_mutex);
  return offloaded_checkpoints;
}

bool block_checkpointed(const PlacementRequest& request, std::size_t block_index) {
  const auto& blocks = request.model.blocks;
  if (request.checkpoint_every <= 0 || blocks.at(block_index).kind != BlockKind::kDecoderLayer) return false;
  std::int64_t layer = 0;  // the block's index among the decoder layers
  for (std::size_t i = 0; i < block_index; ++i) layer += blocks[i].kind == BlockKind::kDecoderLayer ? 1 : 0;
  return layer % request.checkpoint_every == 0;
}

namespace {
std::uint64_t split_over(std::uint64_t values, int ranks) { return (values + static_cast<std::uint64_t>(ranks) - 1) / static_cast<std::uint64_t>(ranks); }

// What one tensor rank holds of a block split over `tp` ranks: the embedding and the head by
// vocabulary rows, a decoder layer's column- and row-parallel linears by their parts (norms and
// replicated linears whole). Activations: the residual stream and the norms' outputs (4 x hidden
// values per token in a decoder layer, all of an embedding, norm or head input) stay whole, the
// rest (heads, MLP units, logits) splits.
struct TensorPart {
  std::uint64_t parameters, activation_values, working_values;
};
TensorPart tensor_part(const PlacementRequest& request, const BlockInfo& block) {
  const int tp = request.mesh.tensor;
  if (tp <= 1) return {block.parameters, block.activation_values_per_token, block.working_values_per_token};
  const auto hidden = static_cast<std::uint64_t>(request.model.hidden_size);
  switch (block.kind) {
    case BlockKind::kEmbedding: return {split_over(block.parameters, tp), block.activation_values_per_token, block.working_values_per_token};
    case BlockKind::kHead: return {split_over(block.parameters, tp), block.activation_values_per_token, split_over(block.working_values_per_token, tp)};
    case BlockKind::kNorm: return {block.parameters, block.activation_values_per_token, block.working_values_per_token};
    case BlockKind::kDecoderLayer: break;
  }
  std::uint64_t split = 0;
  for (const auto& l : block.linears)
    if (l.parallel != ParallelStyle::kReplicated) split += static_cast<std::uint64_t>(l.in_features) * static_cast<std::uint64_t>(l.out_features);
  split = std::min(split, block.parameters);
  const auto whole_act = std::min(block.activation_values_per_token, 4 * hidden), whole_work = std::min(block.working_values_per_token, 2 * hidden);
  return {block.parameters - split + split_over(split, tp), whole_act + split_over(block.activation_values_per_token - whole_act, tp),
          whole_work + split_over(block.working_values_per_token - whole_work, tp)};
}
}  // namespace

namespace {
// The values AdamW updates for a block: its adapter's, or (a full fine-tune) its own part.
std::uint64_t trainable_values(const PlacementRequest& request, std::size_t block_index, std::uint64_t own_part) {
  if (request.adapter_trainable.empty()) return own_part;
  if (request.adapter_trainable.size() != request.model.blocks.size())
    throw std::logic_error("adapter_trainable has " + std::to_string(request.adapter_trainable.size()) + " entries for " +
                           std::to_string(request.model.blocks.size()) + " blocks");
  return request.adapter_trainable[block_index];
}
}  // namespace

namespace {
// The values the optimizer's step goes through at once in a block: a slice of its trainable
// values, or (whole tensors at a time) the largest it trains: an adapter's trainable values are
// small matrices, counted together; a full fine-tune's largest is a linear's matrix, or the whole
// part of a block without linears (an embedding, a head).
std::uint64_t step_values(const PlacementRequest& request, const BlockInfo& block, std::uint64_t own_part, std::uint64_t trainable,
                          const OptimizerMemory& optimizer) {
  if (optimizer.step_values > 0) return std::min<std::uint64_t>(trainable, static_cast<std::uint64_t>(optimizer.step_values));
  if (!request.adapter_trainable.empty() || block.linears.empty()) return trainable;
  std::uint64_t largest = 0;
  for (const auto& l : block.linears) largest = std::max<std::uint64_t>(largest, static_cast<std::uint64_t>(l.in_features) * static_cast<std::uint64_t>(l.out_features));
  return std::min(largest, own_part);
}

// Micro-batches whose activations a block keeps at once: `in_flight_override` where above 0, else
// the request's.
std::uint64_t micro_batches_kept(const PlacementRequest& request, std::int64_t in_flight_override) {
  return static_cast<std::uint64_t>(std::max<std::int64_t>(1, in_flight_override > 0 ? in_flight_override : request.micro_batches_in_flight));
}
// A recomputed layer's input for one micro-batch: all it keeps (on its device, or offloaded).
std::uint64_t checkpoint_input_bytes(const PlacementRequest& request) {
  return static_cast<std::uint64_t>(request.model.hidden_size) * static_cast<std::uint64_t>(request.batch_size) *
         static_cast<std::uint64_t>(request.seq_len) * dtype_bytes(request.dtype);
}
}  // namespace

BlockMemory block_memory(const PlacementRequest& request, std::size_t block_index, std::int64_t in_flight_override) {
  const auto& block = request.model.blocks.at(block_index);
  const std::uint64_t bytes = dtype_bytes(request.dtype);
  const auto tokens = static_cast<std::uint64_t>(request.batch_size) * static_cast<std::uint64_t>(request.seq_len);
  const TensorPart part = tensor_part(request, block);
  BlockMemory m;
  // Stored weights (4-bit codes and scales) split in the proportion the parameters do.
  m.weights = block.weight_bytes == 0 ? part.parameters * bytes
              : part.parameters == block.parameters
                  ? block.weight_bytes
                  : static_cast<std::uint64_t>(static_cast<long double>(block.weight_bytes) * part.parameters / std::max<std::uint64_t>(block.parameters, 1));
  const std::uint64_t trainable = trainable_values(request, block_index, part.parameters);
  const OptimizerMemory optimizer = counted_optimizer();
  // A full fine-tune's gradients and optimizer state; an adapter's weights besides.
  m.trainable_state = trainable * (request.adapter_trainable.empty() ? 1 : 2) * bytes + state_bytes(optimizer, trainable, bytes);
  const std::uint64_t in_flight = micro_batches_kept(request, in_flight_override);
  m.working = std::max(part.working_values * tokens * bytes + (block.kind == BlockKind::kDecoderLayer ? request.transient_bytes : 0),
                       step_bytes(optimizer, step_values(request, block, part.parameters, trainable, optimizer), bytes));
  if (block_checkpointed(request, block_index)) {
    // Keeps its input per micro-batch in flight; backward recomputes the rest, one at a time. An
    // offloaded input is on the host, but for the one in use and the one being brought back.
    const std::uint64_t input = checkpoint_input_bytes(request);
    const bool offloaded = counted_checkpoints_offloaded();
    m.activations = offloaded ? 0 : input * in_flight;
    m.working += part.activation_values * tokens * bytes + (offloaded ? 2 * input : 0);
  } else {
    m.activations = part.activation_values * tokens * bytes * in_flight;
  }
  return m;
}

std::vector<DeviceUsage> device_usage(const PlacementRequest& request, const std::vector<BlockPlacement>& blocks,
                                      const std::vector<std::int64_t>& in_flight) {
  if (blocks.size() != request.model.blocks.size())
    throw std::logic_error("plan places " + std::to_string(blocks.size()) + " blocks of " +
                           std::to_string(request.model.blocks.size()));
  std::vector<DeviceUsage> usage;
  std::vector<std::uint64_t> trainable;  // per entry of usage: the values AdamW's step goes through there
  std::set<std::pair<std::string, std::string>> tied_on_device;  // (rank/device, group) already counted
  std::map<int, std::uint64_t> host_inputs;  // per rank: offloaded checkpoint inputs
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const int rank = blocks[i].rank;
    auto it = std::find_if(usage.begin(), usage.end(), [&](const DeviceUsage& u) { return u.device == blocks[i].device && u.rank == rank; });
    if (it == usage.end()) {
      DeviceUsage u;
      u.device = blocks[i].device;
      u.rank = rank;
      if (rank >= 0 && static_cast<std::size_t>(rank) < request.ranks.size())
        if (const auto* cap = request.ranks[static_cast<std::size_t>(rank)].find(u.device)) u.capacity = cap->capacity_bytes;
      usage.push_back(u);
      trainable.push_back(0);
      it = usage.end() - 1;
    }
    auto& values = trainable[static_cast<std::size_t>(it - usage.begin())];
    const std::uint64_t block_values = trainable_values(request, i, tensor_part(request, request.model.blocks[i]).parameters);
    const std::int64_t kept = i < in_flight.size() ? in_flight[i] : 0;
    const BlockMemory m = block_memory(request, i, kept);
    const auto& group = request.model.blocks[i].tied_group;
    const bool counted = !group.empty() && !tied_on_device.insert({std::to_string(rank) + "/" + it->device, group}).second;
    if (!counted) {
      it->weights += m.weights;
      it->trainable_state += m.trainable_state;
      values += block_values;
    } else if (!request.adapter_trainable.empty()) {
      it->trainable_state += m.trainable_state;  // adapters on tied blocks are separate weights
      values += block_values;
    }
    it->activations += m.activations;
    it->working = std::max(it->working, m.working);
    if (block_checkpointed(request, i) && counted_checkpoints_offloaded()) host_inputs[rank] += checkpoint_input_bytes(request) * micro_batches_kept(request, kept);
  }
  for (const auto& entry : host_inputs) {
    const int rank = entry.first;
    auto host = std::find_if(usage.begin(), usage.end(), [rank](const DeviceUsage& u) { return u.device == "cpu" && u.rank == rank; });
    if (host == usage.end()) {
      DeviceUsage u;
      u.device = "cpu";
      u.rank = rank;
      if (rank >= 0 && static_cast<std::size_t>(rank) < request.ranks.size())
        if (const auto* cap = request.ranks[static_cast<std::size_t>(rank)].find("cpu")) u.capacity = cap->capacity_bytes;
      usage.push_back(u);
      trainable.push_back(0);
      host = usage.end() - 1;
    }
    host->activations += entry.second;
  }
  // The optimizer's step slices across the blocks of a device (one that takes a whole tensor at a
  // time counted it in its block).
  const OptimizerMemory optimizer = counted_optimizer();
  if (optimizer.step_values > 0)
    for (std::size_t k = 0; k < usage.size(); ++k)
      usage[k].working = std::max(usage[k].working, step_bytes(optimizer, std::min<std::uint64_t>(trainable[k], static_cast<std::uint64_t>(optimizer.step_values)),
                                                               dtype_bytes(request.dtype)));
  return usage;
}

}  // namespace loom::kit
