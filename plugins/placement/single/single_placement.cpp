// Placement plugin `single`: the whole model on one device.
#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/placement.hpp"
#include "loom/plugin.hpp"

namespace loom::single_placement {
namespace {

std::vector<OptionSpec> options() {
  return {OptionSpec::string("device", "cpu", "where the model goes: \"cpu\" or \"cuda:N\"")};
}

class SinglePlacement final : public Placement {
 public:
  explicit SinglePlacement(std::string device) : device_(std::move(device)) {}

  Plan plan(const PlacementRequest& request) const override {
    const DeviceCapacity* target = request.ranks.at(0).find(device_);
    if (target == nullptr) {
      std::string available;
      for (const auto& d : request.ranks.at(0).devices) available += (available.empty() ? "" : ", ") + d.device;
      throw UserError("device " + device_ + " is not available here (devices: " + available + ")");
    }
    Plan plan;
    plan.strategy = "single";
    for (const auto& b : request.model.blocks) plan.blocks.push_back({b.name, device_});
    plan.devices = kit::device_usage(request, plan.blocks);
    const DeviceUsage& use = plan.devices.front();
    if (use.total() > target->capacity_bytes)
      throw UserError("the model needs " + format_bytes(use.total()) + " on " + device_ + " (weights " + format_bytes(use.weights) +
                      ", grads+optimizer " + format_bytes(use.trainable_state) + ", activations " + format_bytes(use.activations) +
                      ", working " + format_bytes(use.working) + ") but " + device_ + " has " + format_bytes(target->capacity_bytes) +
                      "; lower [train] batch_size or [data] max_length, use bf16, train an adapter instead of every weight, "
                      "or spread the model over more devices");
    plan.notes.push_back("all " + std::to_string(plan.blocks.size()) + " blocks on " + device_ + " (single-device placement)");
    return plan;
  }

 private:
  std::string device_;
};

std::unique_ptr<Plugin> create(const Options& o) {
  return std::make_unique<SinglePlacement>(parse_device(o.get_string("device")).str());
}

}  // namespace
}  // namespace loom::single_placement

LOOM_PLUGIN(loom::kKindPlacement, "single", "0.1.0", "the whole model on one device", loom::single_placement::options,
            loom::single_placement::create)
