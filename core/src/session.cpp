#include "session.hpp"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <set>

#include <spdlog/spdlog.h>

#include "loom/error.hpp"
#include "loom/torch_compat.hpp"
#include "plugin_guard.hpp"

namespace loom::core {
namespace {

template <typename Interface>
std::unique_ptr<Interface> create_as(const PluginRegistry& registry, const LoadedPlugin& plugin, const Options& options,
                                     const SectionSpec& section, Diagnostics& diagnostics) {
  try {
    return create_guarded<Interface>(registry, plugin, options);
  } catch (const UserError& e) {
    diagnostics.add(section.plugin_where, e.what());
    return nullptr;
  }
}

}  // namespace

Session open_session(PipelineSpec spec, const PluginRegistry& registry) {
  Session s;
  s.spec = std::move(spec);
  Diagnostics diagnostics;
  for (const auto& [name, section] : s.spec.sections) {
    if (section.plugin.empty()) continue;
    const LoadedPlugin* plugin = registry.find(name, section.plugin);
    if (plugin == nullptr) throw std::logic_error("validated pipeline names unknown plugin " + section.plugin);
    s.plugins[name] = plugin;
    if (name == kKindModel) s.model = create_as<Model>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindTokenizer) s.tokenizer = create_as<Tokenizer>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindAdapter) s.adapter = create_as<Adapter>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindCollator) s.collator = create_as<Collator>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindPlacement) s.placement = create_as<Placement>(registry, *plugin, section.options, section, diagnostics);
  }
  diagnostics.throw_if_any();

  const auto& model_section = s.spec.section(kKindModel);
  try {
    s.structure = s.model->structure();
  } catch (const UserError& e) {
    diagnostics.add(model_section.plugin_where, "model plugin '" + model_section.plugin + "': " + e.what());
  }
  if (diagnostics.empty() && s.structure.blocks.empty())
    diagnostics.add(model_section.plugin_where, "model plugin '" + model_section.plugin + "' describes a model with no blocks (plugin bug)");
  if (diagnostics.empty() && s.tokenizer && s.tokenizer->vocab_size() > s.structure.vocab_size) {
    diagnostics.add(s.spec.section(kKindTokenizer).plugin_where,
                    "tokenizer '" + s.spec.section(kKindTokenizer).plugin + "' has " + std::to_string(s.tokenizer->vocab_size()) +
                        " tokens but the model's vocab_size is " + std::to_string(s.structure.vocab_size) +
                        ": its ids would index past the embedding; use a model with vocab_size >= " +
                        std::to_string(s.tokenizer->vocab_size()));
  }
  if (diagnostics.empty() && s.adapter) {
    try {
      const auto trainable = s.adapter->trainable_parameters(s.structure);
      if (trainable.size() != s.structure.blocks.size())
        diagnostics.add(s.spec.section(kKindAdapter).plugin_where,
                        "adapter plugin '" + s.spec.section(kKindAdapter).plugin + "' reported " + std::to_string(trainable.size()) +
                            " blocks for a model of " + std::to_string(s.structure.blocks.size()) + " (plugin bug)");
    } catch (const UserError& e) {
      diagnostics.add(s.spec.section(kKindAdapter).plugin_where, "adapter plugin '" + s.spec.section(kKindAdapter).plugin + "': " + e.what());
    }
  }
  diagnostics.throw_if_any();
  return s;
}

PlacementRequest placement_request(const Session& session, const Inventory& inventory) {
  PlacementRequest r;
  r.model = session.structure;
  if (session.adapter) r.adapter_trainable = session.adapter->trainable_parameters(session.structure);
  const auto& spec = session.spec;
  r.dtype = parse_dtype(spec.section("run").options.get_string("dtype"));
  r.batch_size = spec.section("train").options.get_int("batch_size");
  r.seq_len = spec.section("data").options.get_int("max_length");
  r.inventory = inventory;
  return r;
}

void check_plan(const PlacementRequest& request, const Plan& plan, const std::string& strategy) {
  const std::string who = "placement plugin '" + strategy + "'";
  const auto& blocks = request.model.blocks;
  if (plan.blocks.size() != blocks.size())
    throw UserError(who + " placed " + std::to_string(plan.blocks.size()) + " blocks of the model's " +
                    std::to_string(blocks.size()) + " (plugin bug)");
  std::map<std::string, std::string> group_device;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const auto& placed = plan.blocks[i];
    if (placed.block != blocks[i].name)
      throw UserError(who + " placed '" + placed.block + "' where block '" + blocks[i].name + "' comes (plugin bug)");
    if (!request.inventory.find(placed.device))
      throw UserError(who + " put block '" + placed.block + "' on " + placed.device + ", which is not among the devices (" +
                      [&] {
                        std::string names;
                        for (const auto& d : request.inventory.devices) names += (names.empty() ? "" : ", ") + d.device;
                        return names;
                      }() + ")");
    const auto& group = blocks[i].tied_group;
    if (group.empty()) continue;
    auto [it, inserted] = group_device.emplace(group, placed.device);
    if (!inserted && it->second != placed.device)
      throw UserError(who + " split the tied weights '" + group + "' across " + it->second + " and " + placed.device +
                      "; tied blocks must share a device");
  }
  for (const auto& d : plan.devices) {
    const auto* cap = request.inventory.find(d.device);
    if (cap && d.total() > cap->capacity_bytes)
      throw UserError("the plan needs " + format_bytes(d.total()) + " on " + d.device + ", which has " +
                      format_bytes(cap->capacity_bytes) + " (" + cap->description + ")");
  }
}

Plan make_plan(const Session& session, const PlacementRequest& request) {
  const std::string& strategy = session.spec.section(kKindPlacement).plugin;
  Plan plan;
  const auto started = std::chrono::steady_clock::now();
  try {
    plan = session.placement->plan(request);
  } catch (const UserError& e) {
    throw UserError(session.spec.section(kKindPlacement).plugin_where.str() + ": placement '" + strategy + "': " + e.what());
  }
  check_plan(request, plan, strategy);
  spdlog::debug("placement '{}' planned {} blocks in {:.2f} ms", strategy, plan.blocks.size(),
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count());
  if (!session.spec.section("data").present)
    plan.notes.push_back("no [data] section: sequences assumed " + std::to_string(request.seq_len) + " tokens long ([data] max_length's default)");
  if (!session.spec.section("train").present)
    plan.notes.push_back("no [train] section: batch size assumed " + std::to_string(request.batch_size));
  return plan;
}

Inventory detect_inventory() {
  Inventory inv;
  for (int i = 0; i < compat::cuda_device_count(); ++i) {
    const auto mem = compat::cuda_device_memory(i);
    inv.devices.push_back({"cuda:" + std::to_string(i), mem.free_bytes, mem.name + " (free of " + format_bytes(mem.total_bytes) + ")"});
  }
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      inv.devices.push_back({"cpu", kib * 1024, "host RAM (MemAvailable)"});
      break;
    }
  }
  if (!inv.find("cpu")) inv.devices.push_back({"cpu", 0, "host RAM (unknown: no /proc/meminfo)"});
  return inv;
}

}  // namespace loom::core
