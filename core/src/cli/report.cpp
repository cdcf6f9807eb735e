#include "cli/report.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "loom/kit/kernels.hpp"
#include "loom/kit/memory.hpp"
#include "loom/kit/schedule.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/version.hpp"
#include "config/pipeline.hpp"
#include "generation/generate.hpp"

namespace loom::core {
namespace {

std::string percent(std::uint64_t part, std::uint64_t whole) {
  if (whole == 0) return "-";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
  return buf;
}

std::string count(std::uint64_t n) {
  char buf[32];
  if (n >= 1000000000ull) std::snprintf(buf, sizeof buf, "%.2f B", n / 1e9);
  else if (n >= 1000000ull) std::snprintf(buf, sizeof buf, "%.2f M", n / 1e6);
  else if (n >= 1000ull) std::snprintf(buf, sizeof buf, "%.1f K", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(n));
  return buf;
}

// The whole model's weights as stored, and its decoder layers' (where a 4-bit base shows), each
// with its parameter count; tied blocks count once.
struct WeightDensity {
  std::uint64_t bytes = 0, parameters = 0, layer_bytes = 0, layer_parameters = 0;
  static double per_parameter(std::uint64_t bytes, std::uint64_t parameters) {
    return parameters ? static_cast<double>(bytes) / static_cast<double>(parameters) : 0.0;
  }
};
WeightDensity weight_density(const PlacementRequest& request) {
  WeightDensity d;
  for (const auto i : request.model.distinct_blocks()) {
    const auto& b = request.model.blocks[i];
    const std::uint64_t bytes = b.weight_bytes > 0 ? b.weight_bytes : b.parameters * dtype_bytes(request.dtype);
    d.bytes += bytes;
    d.parameters += b.parameters;
    if (b.kind == BlockKind::kDecoderLayer) {
      d.layer_bytes += bytes;
      d.layer_parameters += b.parameters;
    }
  }
  return d;
}

std::string fixed(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// "layers.0..layers.31 (32)" for a device's contiguous run of blocks.
std::string block_ranges(const Plan& plan, const std::string& device, int rank) {
  std::vector<std::string> runs;
  const auto here = [&](std::size_t k) { return plan.blocks[k].device == device && plan.blocks[k].rank == rank; };
  std::size_t i = 0;
  while (i < plan.blocks.size()) {
    if (!here(i)) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j + 1 < plan.blocks.size() && here(j + 1)) ++j;
    runs.push_back(i == j ? plan.blocks[i].block
                          : plan.blocks[i].block + ".." + plan.blocks[j].block + " (" + std::to_string(j - i + 1) + ")");
    i = j + 1;
  }
  std::string out;
  for (std::size_t k = 0; k < runs.size(); ++k) out += (k ? ", " : "") + runs[k];
  return out;
}

std::string default_text(const OptionSpec& s) {
  if (s.required) return "(required)";
  return s.default_value ? format_option_value(*s.default_value) : "(unset)";
}

std::string constraint_text(const OptionSpec& s) {
  std::string out;
  const auto num = [](double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  };
  const bool list = s.types & (kStringList | kIntList);
  if (s.min) out += std::string(list ? "length >= " : ">= ") + num(*s.min);
  if (s.max) out += (out.empty() ? "" : ", ") + std::string(list ? "length <= " : "<= ") + num(*s.max);
  if (!s.choices.empty()) {
    out += out.empty() ? "one of " : ", one of ";
    for (std::size_t i = 0; i < s.choices.size(); ++i) out += (i ? ", " : "") + ("\"" + s.choices[i] + "\"");
  }
  return out;
}

}  // namespace

std::string table(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows,
                  const std::vector<bool>& right) {
  std::vector<std::size_t> width(header.size());
  for (std::size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  for (const auto& r : rows)
    for (std::size_t c = 0; c < r.size() && c < width.size(); ++c) width[c] = std::max(width[c], r[c].size());
  const auto line = [&](const std::vector<std::string>& cells) {
    std::string out;
    for (std::size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      const std::string pad(width[c] - cell.size(), ' ');
      const bool r = c < right.size() && right[c];
      out += (c ? "  " : "") + (r ? pad + cell : (c + 1 == width.size() ? cell : cell + pad));
    }
    return out + "\n";
  };
  std::string out = line(header);
  for (const auto& r : rows) out += line(r);
  return out;
}

std::string freeze_plan(const Plan& plan, const std::string& placement) {
  // "layers.4" -> ("layers", 4); anything else has no number.
  const auto split = [](const std::string& name) -> std::pair<std::string, long> {
    const auto dot = name.rfind('.');
    if (dot == std::string::npos || name.find_first_not_of("0123456789", dot + 1) != std::string::npos || dot + 1 == name.size())
      return {name, -1};
    return {name.substr(0, dot), std::stol(name.substr(dot + 1))};
  };
  std::string entries;
  std::size_t i = 0;
  while (i < plan.blocks.size()) {
    const auto [prefix, first] = split(plan.blocks[i].block);
    std::size_t j = i;
    while (first >= 0 && j + 1 < plan.blocks.size() && plan.blocks[j + 1].device == plan.blocks[i].device &&
           split(plan.blocks[j + 1].block) == std::make_pair(prefix, first + static_cast<long>(j + 1 - i)))
      ++j;
    const std::string key = j > i ? prefix + "." + std::to_string(first) + "-" + std::to_string(first + static_cast<long>(j - i)) : plan.blocks[i].block;
    entries += (entries.empty() ? "" : ", ") + ("\"" + key + "\" = \"" + plan.blocks[i].device + "\"");
    i = j + 1;
  }
  return "# frozen from a " + plan.strategy + " plan by `loom plan --freeze`\n[placement]\nplugin = \"" + placement + "\"\nmap = { " + entries + " }\n";
}

nlohmann::json inventory_json(const Inventory& inventory) {
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& d : inventory.devices)
    devices.push_back({{"device", d.device}, {"capacity_bytes", d.capacity_bytes}, {"description", d.description}});
  return {{"simulated", inventory.simulated}, {"devices", devices}};
}

namespace {

nlohmann::json usage_json(const DeviceUsage& d, int rank) {
  return {{"rank", rank},
          {"device", d.device},
          {"capacity_bytes", d.capacity},
          {"weights_bytes", d.weights},
          {"trainable_state_bytes", d.trainable_state},
          {"activations_bytes", d.activations},
          {"working_bytes", d.working},
          {"total_bytes", d.total()}};
}

}  // namespace

namespace {

// The rows evaluation decodes together (generate()'s default).
constexpr std::int64_t kEvaluationRows = kDefaultGenerationRows;

// The blocks of a device that keep a window of positions: [{window, bytes_per_position}].
nlohmann::json windowed_json(const MeshPlan::CacheUse& c) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [window, bytes] : c.windowed) out.push_back({{"window", window}, {"bytes_per_position", bytes}});
  return out;
}

// Generation's cache per device (see MeshPlan::generation_cache), and what evaluation's rows take.
nlohmann::json generation_json(const MeshPlan& m) {
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& c : m.generation_cache)
    devices.push_back({{"rank", c.rank},
                       {"device", c.device},
                       {"cache_bytes_per_position", c.bytes_per_position},
                       {"cache_windowed", windowed_json(c)},
                       {"evaluation_cache_bytes", c.bytes(kEvaluationRows, m.evaluation_positions)}});
  return {{"evaluation_rows", kEvaluationRows}, {"evaluation_positions", m.evaluation_positions}, {"devices", devices}};
}

}  // namespace

nlohmann::json plan_json(const MeshPlan& mesh_plan) {
  const PlacementRequest& request = mesh_plan.request();
  const Plan& plan = mesh_plan.plan();
  nlohmann::json blocks = nlohmann::json::array();
  const auto in_flight = plan.schedule.empty() ? std::vector<int>{} : kit::in_flight_per_stage(plan.schedule);
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    const int stage = plan.blocks[i].stage;
    const auto m = kit::block_memory(request, i, stage < static_cast<int>(in_flight.size()) ? in_flight[static_cast<std::size_t>(stage)] : 0);
    const auto& b = request.model.blocks[i];
    blocks.push_back({{"block", plan.blocks[i].block},
                      {"kind", block_kind_name(b.kind)},
                      {"rank", plan.blocks[i].rank},
                      {"device", plan.blocks[i].device},
                      {"stage", stage},
                      {"checkpointed", kit::block_checkpointed(request, i)},
                      {"parameters", b.parameters},
                      {"tied_group", b.tied_group},
                      {"weights_bytes", m.weights},
                      {"trainable_state_bytes", m.trainable_state},
                      {"activations_bytes", m.activations},
                      {"working_bytes", m.working}});
  }
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& d : plan.devices) devices.push_back(usage_json(d, d.rank));
  // Every rank of the mesh with its coordinates, devices and blocks.
  const Mesh& mesh = mesh_plan.mesh;
  nlohmann::json ranks = nlohmann::json::array();
  for (int rank = 0; rank < mesh.world(); ++rank) {
    const Plan& p = mesh_plan.replicas[static_cast<std::size_t>(mesh_plan.replica_of(rank))];
    const int q = mesh_plan.pipeline_rank_of(rank);
    const MeshCoord c = mesh.coord(rank);
    nlohmann::json used = nlohmann::json::array(), held = nlohmann::json::array();
    for (const auto& d : p.devices)
      if (d.rank == q) {
        auto u = usage_json(d, rank);
        u["device"] = mesh_plan.physical_device(rank, d.device);
        used.push_back(u);
      }
    for (const auto& b : p.blocks)
      if (b.rank == q) held.push_back({{"block", b.block}, {"device", mesh_plan.physical_device(rank, b.device)}});
    ranks.push_back({{"rank", rank}, {"data", c.data}, {"pipeline", c.pipeline}, {"tensor", c.tensor}, {"devices", used}, {"blocks", held}});
  }
  nlohmann::json inventories = nlohmann::json::array();
  for (const auto& inv : request.ranks) inventories.push_back(inventory_json(inv));
  const WeightDensity density = weight_density(request);
  nlohmann::json schedule = nullptr;
  if (!plan.schedule.empty()) {
    nlohmann::json actions = nlohmann::json::array();
    for (const auto& list : plan.schedule.actions) {
      nlohmann::json row = nlohmann::json::array();
      for (const auto& a : list) row.push_back({{"op", stage_op_name(a.op)}, {"stage", a.stage}, {"micro_batch", a.micro_batch}});
      actions.push_back(row);
    }
    schedule = {{"name", plan.schedule.name},
                {"stages", plan.schedule.stages},
                {"micro_batches", plan.schedule.micro_batches},
                {"stage_rank", plan.schedule.stage_rank},
                {"in_flight", in_flight},
                {"actions", actions}};
  }
  nlohmann::json fit;  // null where the plan's maker did not search
  if (const auto& f = mesh_plan.fit)
    fit = {{"batch_size", f->batch_size},        {"longest_max_length", f->longest},     {"max_length_searched_to", f->longest_limit},
           {"max_length", f->max_length},        {"largest_batch_size", f->most_rows},   {"batch_size_searched_to", f->most_rows_limit},
           {"fits_with_every_layer_recomputed", f->fits_with_recompute},
           {"fits_with_inputs_offloaded", f->fits_with_offload}};
  return {{"strategy", plan.strategy},
          {"fit", fit},
          {"mesh", {{"data", mesh.data}, {"pipeline", mesh.pipeline}, {"tensor", mesh.tensor}, {"world", mesh.world()}}},
          {"model",
           {{"architecture", request.model.architecture},
            {"parameters", request.model.total_parameters()},
            {"blocks", request.model.blocks.size()},
            {"weights_bytes", density.bytes},
            {"bytes_per_parameter", WeightDensity::per_parameter(density.bytes, density.parameters)},
            {"layer_bytes_per_parameter", WeightDensity::per_parameter(density.layer_bytes, density.layer_parameters)}}},
          {"dtype", dtype_name(request.dtype)},
          {"optimizer", mesh_plan.optimizer},
          {"batch_size", request.batch_size},
          {"seq_len", request.seq_len},
          {"micro_batches_in_flight", request.micro_batches_in_flight},
          {"micro_batches", request.micro_batches},
          {"checkpoint_every", request.checkpoint_every},
          {"schedule", schedule},
          {"full_finetune", request.adapter_trainable.empty()},
          {"inventory", inventory_json(request.ranks.at(0))},
          {"replica_inventories", inventories},
          {"devices", devices},
          {"blocks", blocks},
          {"ranks", ranks},
          {"generation", generation_json(mesh_plan)},
          {"notes", plan.notes}};
}

std::string plan_text(const MeshPlan& mesh_plan) {
  const PlacementRequest& request = mesh_plan.request();
  const Mesh& mesh = mesh_plan.mesh;
  std::uint64_t trainable = 0;
  for (auto n : request.adapter_trainable) trainable += n;
  std::ostringstream out;
  out << "plan: " << mesh_plan.plan().strategy << " | " << request.model.architecture << ", " << request.model.blocks.size()
      << " blocks, " << count(request.model.total_parameters()) << " parameters | " << dtype_name(request.dtype)
      << " | batch " << request.batch_size << " x " << request.seq_len << " tokens"
      << (mesh.data > 1 ? " per data rank (" + std::to_string(mesh.data * request.batch_size) + " in all)" : std::string()) << " | "
      << (request.adapter_trainable.empty() ? "full fine-tune" : "adapter: " + count(trainable) + " trainable") << " | "
      << (request.ranks.at(0).simulated ? "simulated devices" : "devices of this machine") << "\n";
  const WeightDensity density = weight_density(request);
  out << "weights: " << format_bytes(density.bytes) << " as stored, " << fixed(WeightDensity::per_parameter(density.bytes, density.parameters), 3)
      << " bytes/parameter (decoder layers " << fixed(WeightDensity::per_parameter(density.layer_bytes, density.layer_parameters), 3) << ")\n";
  if (!mesh_plan.adapter_storage.empty()) out << mesh_plan.adapter_storage << "\n";
  if (!mesh_plan.optimizer.empty())
    out << "optimizer: " << mesh_plan.optimizer << " (its state is in each device's trainable state below; docs/training.md)\n";
  if (mesh.world() > 1) out << "mesh: " << mesh.str() << " = " << mesh.world() << " ranks\n";
  out << "\n";
  std::vector<std::vector<std::string>> rows;
  for (int rank = 0; rank < mesh.world(); ++rank) {
    const Plan& p = mesh_plan.replicas[static_cast<std::size_t>(mesh_plan.replica_of(rank))];
    const int q = mesh_plan.pipeline_rank_of(rank);
    const MeshCoord c = mesh.coord(rank);
    for (const auto& d : p.devices) {
      if (d.rank != q) continue;
      std::vector<std::string> row;
      if (mesh.world() > 1)
        row = {std::to_string(rank), std::to_string(c.data) + "/" + std::to_string(c.pipeline) + "/" + std::to_string(c.tensor)};
      for (auto cell : {mesh_plan.physical_device(rank, d.device), block_ranges(p, d.device, q), format_bytes(d.weights), format_bytes(d.trainable_state), format_bytes(d.activations),
                        format_bytes(d.working), format_bytes(d.total()), d.capacity ? format_bytes(d.capacity) : std::string("-"),
                        percent(d.total(), d.capacity)})
        row.push_back(cell);
      rows.push_back(row);
    }
  }
  std::vector<std::string> header = {"device", "blocks", "weights", "grads+optim", "activations", "working", "total", "capacity", "used"};
  std::vector<bool> right = {false, false, true, true, true, true, true, true, true};
  if (mesh.world() > 1) {
    header.insert(header.begin(), {"rank", "data/pipe/tensor"});
    right.insert(right.begin(), {true, false});
  }
  out << table(header, rows, right);
  if (mesh_plan.fit) out << "\nfits: " << fit_text(*mesh_plan.fit) << "\n";
  if (!mesh_plan.generation_cache.empty()) {
    // Made when a run evaluates (after a step has freed its activations) or generates: beside the
    // weights, not beside a step's activations.
    out << "\ngeneration cache (keys and values, made once per request): ";
    std::string sep;
    for (const auto& c : mesh_plan.generation_cache) {
      out << sep << (mesh.world() > 1 ? "pipeline rank " + std::to_string(c.rank) + " " : std::string()) << c.device << " "
          << format_bytes(c.bytes_per_position) << " a position of a row";
      for (const auto& [window, bytes] : c.windowed) out << " + " << format_bytes(bytes) << " a position of its latest " << window << " (sliding layers)";
      out << ", evaluation's " << kEvaluationRows << " rows of " << mesh_plan.evaluation_positions
          << " ([data] max_length + [train] max_new_tokens) " << format_bytes(c.bytes(kEvaluationRows, mesh_plan.evaluation_positions));
      sep = "; ";
    }
    out << "\n";
  }
  const auto& schedule = mesh_plan.plan().schedule;
  if (!schedule.empty()) {
    out << "\nschedule: " << schedule.name << ", " << schedule.stages << " stages, " << schedule.micro_batches
        << " micro-batches per step (F/B stage.micro-batch; one column per compute slot)\n"
        << kit::schedule_timeline(schedule);
  }
  const auto& notes = mesh_plan.plan().notes;
  if (!notes.empty()) {
    out << "\nnotes:\n";
    for (const auto& n : notes) out << "  - " << n << "\n";
  }
  return out.str();
}

nlohmann::json plugins_json(const PluginRegistry& registry) {
  nlohmann::json plugins = nlohmann::json::array();
  for (const auto& p : registry.plugins())
    plugins.push_back({{"name", p.name},
                       {"kind", p.kind},
                       {"version", p.version},
                       {"sdk", std::to_string(p.sdk.major) + "." + std::to_string(p.sdk.minor)},
                       {"torch", p.torch.str()},
                       {"summary", p.summary},
                       {"file", p.file.string()},
                       {"model_types", p.model_types}});
  nlohmann::json refused = nlohmann::json::array();
  for (const auto& r : registry.refusals()) refused.push_back({{"file", r.file.string()}, {"reason", r.reason}});
  return {{"plugins", plugins}, {"refused", refused}};
}

std::string plugins_text(const PluginRegistry& registry) {
  std::vector<const LoadedPlugin*> sorted;
  for (const auto& p : registry.plugins()) sorted.push_back(&p);
  const auto& kinds = plugin_kinds();
  const auto kind_rank = [&](const LoadedPlugin* p) { return std::find(kinds.begin(), kinds.end(), p->kind) - kinds.begin(); };
  std::sort(sorted.begin(), sorted.end(), [&](auto* a, auto* b) {
    return std::make_pair(kind_rank(a), a->name) < std::make_pair(kind_rank(b), b->name);
  });
  std::vector<std::vector<std::string>> rows;
  for (const auto* p : sorted) {
    // A model plugin's summary says which config.json model_types pick it.
    std::string types;
    for (const auto& t : p->model_types) types += (types.empty() ? " (model_type: " : ", ") + t;
    rows.push_back({p->name, p->kind, p->version, std::to_string(p->sdk.major) + "." + std::to_string(p->sdk.minor),
                    p->summary + (types.empty() ? "" : types + ")"), p->file.string()});
  }
  std::string out = table({"name", "kind", "version", "sdk", "summary", "file"}, rows);
  for (const auto& r : registry.refusals()) out += r.str() + "\n";
  return out;
}

nlohmann::json schema_json(const std::vector<OptionSpec>& schema) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& s : schema) {
    nlohmann::json o = {{"name", s.name}, {"type", option_type_name(s.types)}, {"required", s.required}, {"doc", s.doc}};
    if (s.default_value) std::visit([&](const auto& v) { o["default"] = v; }, *s.default_value);
    if (s.min) o["min"] = *s.min;
    if (s.max) o["max"] = *s.max;
    if (!s.choices.empty()) o["choices"] = s.choices;
    out.push_back(std::move(o));
  }
  return out;
}

std::string schema_text(const std::vector<OptionSpec>& schema) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& s : schema) rows.push_back({s.name, option_type_name(s.types), default_text(s), constraint_text(s), s.doc});
  return table({"option", "type", "default", "allowed", "description"}, rows);
}

std::string pipeline_reference_markdown(const PluginRegistry& registry) {
  std::ostringstream out;
  const auto md_table = [&](const std::vector<OptionSpec>& schema, bool with_plugin) {
    out << "| key | type | default | allowed | description |\n|---|---|---|---|---|\n";
    if (with_plugin) out << "| `plugin` | string | (required) | | which plugin serves this section |\n";
    for (const auto& s : schema) {
      std::string doc = s.doc;
      std::string def = default_text(s);
      for (auto* text : {&doc, &def}) {
        std::string escaped;
        for (char c : *text) escaped += c == '|' ? std::string("\\|") : std::string(1, c);
        *text = escaped;
      }
      out << "| `" << s.name << "` | " << option_type_name(s.types) << " | `" << def << "` | " << constraint_text(s)
          << " | " << doc << " |\n";
    }
  };
  for (const auto& section : section_names()) {
    out << "### [" << section << "]\n\n";
    if (!is_plugin_section(section)) {
      md_table(host_section_schema(section), false);
      out << "\n";
      continue;
    }
    if (section == kKindReward)
      out << "Each `[reward.NAME]` section is one reward of a sampling objective (`grpo`; docs/objectives.md), served by a reward plugin named with "
             "`plugin = \"NAME\"`; the other keys are that plugin's options and `weight`. A completion's reward is the weighted sum.";
    else
      out << "Served by " << (section == kKindObjective ? "an " : "a ") << section << " plugin, named with `plugin = \"NAME\"`; the other keys are that plugin's options.";
    if (section == kKindObjective) out << " Without this section a run is supervised fine-tuning (`sft`); docs/objectives.md.";
    if (section == kKindModel)
      out << " With `path` and no `plugin`, the plugin that reads the folder's config.json `model_type` is taken (its `model_type` list below).";
    out << "\n\n";
    auto plugins = registry.of_kind(section);
    std::sort(plugins.begin(), plugins.end(), [](auto* a, auto* b) { return a->name < b->name; });
    if (plugins.empty()) out << "No built-in " << section << " plugin yet.\n\n";
    for (const auto* p : plugins) {
      out << "#### " << section << " plugin `" << p->name << "` (" << p->version << ")\n\n" << p->summary << "\n\n";
      if (!p->model_types.empty()) {
        std::string types;
        for (const auto& t : p->model_types) types += (types.empty() ? "`" : ", `") + t + "`";
        out << "Reads config.json `model_type`: " << types << ".\n\n";
      }
      md_table(p->schema, true);
      out << "\n";
    }
  }
  return out.str();
}

nlohmann::json versions_json() {
  const auto sdk = sdk_version();
  nlohmann::json v = {{"loom", loom_version()},
                      {"sdk", std::to_string(sdk.major) + "." + std::to_string(sdk.minor)},
                      {"torch", kit::compat::torch_version()},
                      {"cuda", nullptr},
                      {"cuda_architectures", nullptr},
                      {"nccl", nullptr}};
  if (auto cuda = kit::compat::cuda_runtime_version()) v["cuda"] = *cuda;
  if (const auto archs = kit::cuda_architectures(); !archs.empty()) v["cuda_architectures"] = archs;
  if (auto nccl = kit::compat::nccl_version()) v["nccl"] = *nccl;
  return v;
}

std::string versions_text() {
  const auto v = versions_json();
  std::string out = "loom " + v["loom"].get<std::string>() + "\nSDK " + v["sdk"].get<std::string>() + "\nLibTorch " +
                    v["torch"].get<std::string>() + "\n";
  out += v["cuda"].is_null() ? "CUDA not available (CPU build of LibTorch)\n" : "CUDA " + v["cuda"].get<std::string>() + "\n";
  if (!v["cuda_architectures"].is_null()) out += "CUDA kernels built for " + v["cuda_architectures"].get<std::string>() + "\n";
  if (!v["nccl"].is_null()) out += "NCCL " + v["nccl"].get<std::string>() + "\n";
  return out;
}

}  // namespace loom::core
