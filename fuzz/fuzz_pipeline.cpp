// Pipeline TOML with a --set override: the first line of the input is the override, the rest the
// pipeline; validated, its plugins created and planned on a simulated machine.
#include "fuzz_support.hpp"
#include "loom/devices.hpp"
#include "config/pipeline.hpp"
#include "planner/planner.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto parts = fuzz::split(data, size, "\n", 2);
  const auto dir = fuzz::scratch();
  fuzz::write(dir / "p.toml", parts[1]);
  core::PluginRegistry registry;
  fuzz::load_builtin(registry);
  try {
    std::vector<std::string> overrides;
    if (!parts[0].empty()) overrides.push_back(parts[0]);
    auto session = core::open_session(core::load_pipeline(dir / "p.toml", overrides, registry, core::Purpose::kPlan), registry);
    core::make_plan(session, core::placement_request(session, core::parse_inventory("cuda:0=80GiB,cuda:1=80GiB,cpu=512GiB")));
  } catch (const UserError&) {
  }
  return 0;
}
