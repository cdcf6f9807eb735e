// Placement plugin `last-device`: every block on the last device of the inventory, unless the
// pipeline names one. Small, but it uses the SDK and the kit as any third-party plugin would.
#include <loom/error.hpp>
#include <loom/kit/memory.hpp>
#include <loom/placement.hpp>
#include <loom/plugin.hpp>

namespace {

std::vector<loom::OptionSpec> options() {
  return {loom::OptionSpec::string("prefer", std::nullopt, "use this device instead of the last one")};
}

class LastDevice final : public loom::Placement {
 public:
  explicit LastDevice(std::string prefer) : prefer_(std::move(prefer)) {}
  loom::Plan plan(const loom::PlacementRequest& request) const override {
    if (request.ranks.at(0).devices.empty()) throw loom::UserError("no devices to place on");
    const std::string device = prefer_.empty() ? request.ranks.at(0).devices.back().device : prefer_;
    loom::Plan plan;
    plan.strategy = "last-device";
    for (const auto& b : request.model.blocks) plan.blocks.push_back({b.name, device});
    plan.devices = loom::kit::device_usage(request, plan.blocks);
    plan.notes.push_back("everything on " + device);
    return plan;
  }

 private:
  std::string prefer_;
};

std::unique_ptr<loom::Plugin> create(const loom::Options& o) {
  return std::make_unique<LastDevice>(o.has("prefer") ? loom::parse_device(o.get_string("prefer")).str() : "");
}

}  // namespace

LOOM_PLUGIN(loom::kKindPlacement, "last-device", "1.2.3", "every block on the last device", options, create)
