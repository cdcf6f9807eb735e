// Placement plugin `auto`: spreads the model's blocks over the GPUs by memory, counting weights,
// the adapter's weights, gradients and optimizer state, saved activations at the run's batch and
// sequence length, and each device's largest transient working set — not weights alone. Blocks
// stay in model order (contiguous runs per device) so activations cross each boundary once; tied
// weights stay on one device.
#include <algorithm>
#include <map>

#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/placement.hpp"
#include "loom/plugin.hpp"

namespace loom::auto_placement {
namespace {

std::vector<OptionSpec> options() {
  return {
      OptionSpec::string("strategy", "balanced",
                         "\"balanced\": even out memory over the GPUs; \"sequential\": fill each GPU in turn; \"cpu_offload\": fill the "
                         "GPUs in turn and compute the blocks that do not fit on the CPU")
          .one_of({"balanced", "sequential", "cpu_offload"}),
      OptionSpec::string_map("max_memory", "cap per device, e.g. { \"cuda:0\" = \"14GiB\", \"cpu\" = \"64GiB\" }"),
      OptionSpec::string("reserve", "1GiB", "headroom kept free on every GPU (CUDA context, allocator fragmentation)"),
  };
}

struct Target {
  std::string device;
  std::uint64_t capacity = 0;  // usable bytes after max_memory and reserve
};

class AutoPlacement final : public Placement {
 public:
  AutoPlacement(std::string strategy, std::map<std::string, std::uint64_t> max_memory, std::uint64_t reserve)
      : strategy_(std::move(strategy)), max_memory_(std::move(max_memory)), reserve_(reserve) {}

  Plan plan(const PlacementRequest& request) const override {
    std::vector<Target> gpus;
    const DeviceCapacity* cpu = request.ranks.at(0).find("cpu");
    for (const auto& d : request.ranks.at(0).devices)
      if (d.device != "cpu") gpus.push_back({d.device, usable(d)});
    for (const auto& [device, cap] : max_memory_)
      if (!request.ranks.at(0).find(device)) throw UserError("max_memory names " + device + ", which is not among the devices");
    const auto& blocks = request.model.blocks;
    const std::size_t n = blocks.size();
    std::vector<kit::BlockMemory> cost(n);
    for (std::size_t i = 0; i < n; ++i) cost[i] = kit::block_memory(request, i);
    // A block tied to an earlier one (the head sharing the embedding) goes where that one goes and
    // adds no weights there.
    std::vector<std::ptrdiff_t> tied_to(n, -1);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < i && tied_to[i] < 0; ++j)
        if (!blocks[i].tied_group.empty() && blocks[i].tied_group == blocks[j].tied_group) tied_to[i] = static_cast<std::ptrdiff_t>(j);

    Plan plan;
    plan.strategy = "auto/" + strategy_;
    std::vector<std::string> where(n);
    if (gpus.empty()) {
      if (!cpu) throw UserError("no device to place the model on");
      for (auto& w : where) w = "cpu";
      plan.notes.push_back("no GPU among the devices: every block on the cpu");
    } else {
      std::vector<std::size_t> order;  // blocks placed in sequence (tied followers go with their leader)
      for (std::size_t i = 0; i < n; ++i)
        if (tied_to[i] < 0) order.push_back(i);
      const auto assign = [&](const std::vector<std::uint64_t>& limits, std::vector<std::string>& out) -> std::size_t {
        // Greedy in order: the next block goes to the current device while the device's load
        // (with the largest working set among its blocks) stays under its limit.
        std::size_t device = 0, placed = 0;
        std::uint64_t load = 0, working = 0;
        for (auto i : order) {
          std::uint64_t add = cost[i].weights + cost[i].trainable_state + cost[i].activations, w = cost[i].working;
          for (std::size_t f = 0; f < n; ++f)
            if (tied_to[f] == static_cast<std::ptrdiff_t>(i)) add += cost[f].trainable_state + cost[f].activations, w = std::max(w, cost[f].working);
          while (device < limits.size() && load + add + std::max(working, w) > limits[device]) {
            ++device;
            load = 0;
            working = 0;
          }
          if (device == limits.size()) return placed;
          out[i] = gpus[device].device;
          load += add;
          working = std::max(working, w);
          ++placed;
        }
        return placed;
      };
      std::vector<std::uint64_t> limits;
      for (const auto& g : gpus) limits.push_back(g.capacity);
      std::size_t placed = assign(limits, where);
      if (strategy_ == "balanced" && placed == order.size() && gpus.size() > 1) {
        // Smallest per-device ceiling under which the greedy fill still places everything: the
        // most even contiguous split the capacities allow.
        std::uint64_t lo = 0, hi = *std::max_element(limits.begin(), limits.end());
        while (lo + (1u << 20) < hi) {
          const std::uint64_t mid = lo + (hi - lo) / 2;
          std::vector<std::uint64_t> capped;
          for (auto l : limits) capped.push_back(std::min(l, mid));
          std::vector<std::string> trial(n);
          (assign(capped, trial) == order.size() ? hi : lo) = mid;
        }
        std::vector<std::uint64_t> capped;
        for (auto l : limits) capped.push_back(std::min(l, hi));
        assign(capped, where);
        plan.notes.push_back("balanced: no GPU holds more than " + format_bytes(hi) + " (the most even split of the blocks in order)");
      } else if (placed < order.size()) {
        if (strategy_ != "cpu_offload" || !cpu) throw shortfall(request, cost, gpus, placed, order);
        for (std::size_t k = placed; k < order.size(); ++k) where[order[k]] = "cpu";
        plan.notes.push_back("cpu_offload: " + std::to_string(order.size() - placed) + " blocks from " + blocks[order[placed]].name +
                             " on are computed on the cpu (weights stay in host memory; nothing is streamed to a GPU)");
      } else {
        plan.notes.push_back(strategy_ + ": each GPU filled in turn up to its usable memory");
      }
      for (std::size_t i = 0; i < n; ++i)
        if (tied_to[i] >= 0) {
          where[i] = where[static_cast<std::size_t>(tied_to[i])];
          plan.notes.push_back(blocks[i].name + " shares its weights with " + blocks[static_cast<std::size_t>(tied_to[i])].name +
                               ", so it is placed on " + where[i] + " too");
        }
    }
    for (std::size_t i = 0; i < n; ++i) plan.blocks.push_back({blocks[i].name, where[i]});
    plan.devices = kit::device_usage(request, plan.blocks);
    for (const auto& g : gpus)
      if (max_memory_.count(g.device) || reserve_ > 0)
        plan.notes.push_back(g.device + " usable: " + format_bytes(g.capacity) + (max_memory_.count(g.device) ? " (max_memory" : " (free") +
                             " less the " + format_bytes(reserve_) + " reserve)");
    for (std::size_t i = 1; i < n; ++i)
      if (where[i] != where[i - 1])
        plan.notes.push_back("cut before " + blocks[i].name + ": " + where[i - 1] + " -> " + where[i]);
    return plan;
  }

 private:
  std::uint64_t usable(const DeviceCapacity& d) const {
    std::uint64_t cap = d.capacity_bytes;
    if (auto it = max_memory_.find(d.device); it != max_memory_.end()) cap = std::min(cap, it->second);
    return cap > reserve_ ? cap - reserve_ : 0;
  }

  UserError shortfall(const PlacementRequest& request, const std::vector<kit::BlockMemory>& cost, const std::vector<Target>& gpus,
                      std::size_t placed, const std::vector<std::size_t>& order) const {
    std::uint64_t need = 0, have = 0;
    for (std::size_t k = placed; k < order.size(); ++k) need += cost[order[k]].weights + cost[order[k]].trainable_state + cost[order[k]].activations;
    for (const auto& g : gpus) have += g.capacity;
    std::uint64_t weights = 0, activations = 0;
    for (const auto& c : cost) weights += c.weights, activations += c.activations;
    std::string devices;
    for (const auto& g : gpus) devices += (devices.empty() ? "" : ", ") + g.device + " " + format_bytes(g.capacity);
    return UserError("the model does not fit the GPUs (usable: " + devices + "): blocks from " + request.model.blocks[order[placed]].name +
                     " on, about " + format_bytes(need) + ", have no room (weights " + format_bytes(weights) + ", activations at batch " +
                     std::to_string(request.batch_size) + " x " + std::to_string(request.seq_len) + ": " + format_bytes(activations) +
                     "); lower [train] batch_size or [data] max_length, train an adapter instead of every weight, use bf16, add a GPU, "
                     "or set strategy = \"cpu_offload\"");
  }

  std::string strategy_;
  std::map<std::string, std::uint64_t> max_memory_;
  std::uint64_t reserve_;
};

std::unique_ptr<Plugin> create(const Options& o) {
  std::map<std::string, std::uint64_t> max_memory;
  if (o.has("max_memory"))
    for (const auto& [device, size] : o.get_string_map("max_memory")) max_memory[parse_device(device).str()] = parse_bytes(size);
  return std::make_unique<AutoPlacement>(o.get_string("strategy"), std::move(max_memory), parse_bytes(o.get_string("reserve")));
}

}  // namespace
}  // namespace loom::auto_placement

LOOM_PLUGIN(loom::kKindPlacement, "auto", "0.1.0", "spreads blocks over the GPUs by memory (weights, adapter state, activations)",
            loom::auto_placement::options, loom::auto_placement::create)
