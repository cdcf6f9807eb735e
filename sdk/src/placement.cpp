#include "loom/placement.hpp"

#include <algorithm>
#include <set>
#include <stdexcept>

namespace loom {
namespace {
// AdamW keeps two fp32 moments per trainable value.
constexpr std::uint64_t kAdamStateBytes = 8;
}  // namespace

bool block_checkpointed(const PlacementRequest& request, std::size_t block_index) {
  const auto& blocks = request.model.blocks;
  if (request.checkpoint_every <= 0 || blocks.at(block_index).kind != BlockKind::kDecoderLayer) return false;
  std::int64_t layer = 0;  // the block's index among the decoder layers
  for (std::size_t i = 0; i < block_index; ++i) layer += blocks[i].kind == BlockKind::kDecoderLayer ? 1 : 0;
  return layer % request.checkpoint_every == 0;
}

BlockMemory block_memory(const PlacementRequest& request, std::size_t block_index, std::int64_t in_flight_override) {
  const auto& block = request.model.blocks.at(block_index);
  const std::uint64_t bytes = dtype_bytes(request.dtype);
  const auto tokens = static_cast<std::uint64_t>(request.batch_size) * static_cast<std::uint64_t>(request.seq_len);
  BlockMemory m;
  m.weights = block.weight_bytes > 0 ? block.weight_bytes : block.parameters * bytes;
  if (request.adapter_trainable.empty()) {
    m.trainable_state = block.parameters * (bytes + kAdamStateBytes);  // gradient + moments
  } else {
    if (request.adapter_trainable.size() != request.model.blocks.size())
      throw std::logic_error("adapter_trainable has " + std::to_string(request.adapter_trainable.size()) +
                             " entries for " + std::to_string(request.model.blocks.size()) + " blocks");
    m.trainable_state = request.adapter_trainable[block_index] * (2 * bytes + kAdamStateBytes);  // weight + gradient + moments
  }
  const auto in_flight =
      static_cast<std::uint64_t>(std::max<std::int64_t>(1, in_flight_override > 0 ? in_flight_override : request.micro_batches_in_flight));
  m.working = block.working_values_per_token * tokens * bytes;
  if (block_checkpointed(request, block_index)) {
    // Keeps its input per micro-batch in flight; backward recomputes the rest, one at a time.
    m.activations = static_cast<std::uint64_t>(request.model.hidden_size) * tokens * bytes * in_flight;
    m.working += block.activation_values_per_token * tokens * bytes;
  } else {
    m.activations = block.activation_values_per_token * tokens * bytes * in_flight;
  }
  return m;
}

std::vector<DeviceUsage> device_usage(const PlacementRequest& request, const std::vector<BlockPlacement>& blocks,
                                      const std::vector<std::int64_t>& in_flight) {
  if (blocks.size() != request.model.blocks.size())
    throw std::logic_error("plan places " + std::to_string(blocks.size()) + " blocks of " +
                           std::to_string(request.model.blocks.size()));
  std::vector<DeviceUsage> usage;
  std::set<std::pair<std::string, std::string>> tied_on_device;  // (rank/device, group) already counted
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
      it = usage.end() - 1;
    }
    const BlockMemory m = block_memory(request, i, i < in_flight.size() ? in_flight[i] : 0);
    const auto& group = request.model.blocks[i].tied_group;
    const bool counted = !group.empty() && !tied_on_device.insert({std::to_string(rank) + "/" + it->device, group}).second;
    if (!counted) {
      it->weights += m.weights;
      it->trainable_state += m.trainable_state;
    } else if (!request.adapter_trainable.empty()) {
      it->trainable_state += m.trainable_state;  // adapters on tied blocks are separate weights
    }
    it->activations += m.activations;
    it->working = std::max(it->working, m.working);
  }
  return usage;
}

}  // namespace loom
