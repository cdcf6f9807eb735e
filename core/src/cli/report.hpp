#pragma once
// What loom prints and records: plans, plugin tables, option references, versions.
#include <string>

#include <nlohmann/json.hpp>

#include "loom/placement.hpp"
#include "plugins/plugin_registry.hpp"
#include "planner/planner.hpp"

namespace loom::core {

// The plan of every rank: per rank and device, the blocks and the memory they need there.
nlohmann::json plan_json(const MeshPlan& plan);
std::string plan_text(const MeshPlan& plan);

// The plan as a [placement] section for `placement`, a plugin taking a block -> device `map`
// (`loom plan --freeze`): a run pinned to it keeps its placement across upgrades of the strategy
// that made it.
std::string freeze_plan(const Plan& plan, const std::string& placement);

nlohmann::json inventory_json(const Inventory& inventory);

nlohmann::json plugins_json(const PluginRegistry& registry);
std::string plugins_text(const PluginRegistry& registry);

nlohmann::json schema_json(const std::vector<OptionSpec>& schema);
std::string schema_text(const std::vector<OptionSpec>& schema);
// The pipeline reference (docs/pipeline.md's generated part): host sections and every plugin.
std::string pipeline_reference_markdown(const PluginRegistry& registry);

// loom, SDK, LibTorch, CUDA and NCCL versions.
nlohmann::json versions_json();
std::string versions_text();

// Fixed-width table: a header row and rows; numbers right-aligned when `right` marks the column.
std::string table(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows,
                  const std::vector<bool>& right = {});

}  // namespace loom::core
