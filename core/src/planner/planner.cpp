#include "planner/planner.hpp"

#include "config/objective_data.hpp"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>

#include <spdlog/spdlog.h>

#include "loom/error.hpp"
#include "loom/kit/kernels.hpp"
#include "loom/kit/schedule.hpp"
#include "loom/kit/torch_compat.hpp"
#include "config/data.hpp"
#include "distributed/distributed.hpp"
#include "plugins/plugin_guard.hpp"
#include "runtime/host_split.hpp"
#include "runtime/optimizer.hpp"

namespace loom::core {
namespace fs = std::filesystem;

namespace {

// Why `local_world` processes on this host get no GPU: they do not divide its GPUs (empty: they do).
std::string uneven_gpus(const Inventory& host, int local_world) {
  std::size_t gpus = 0;
  for (const auto& d : host.devices) gpus += d.device != "cpu" ? 1 : 0;
  if (gpus == 0 || local_world <= 1 || gpus % static_cast<std::size_t>(local_world) == 0) return "";
  return std::to_string(local_world) + " processes on this host cannot share its " + std::to_string(gpus) +
         " GPU(s) evenly, so they use none; start as many processes per host as it has GPUs, or a divisor of that number";
}

}  // namespace

Inventory rank_inventory(const Inventory& host, int local_rank, int local_world) {
  Inventory out;
  out.simulated = host.simulated;
  std::vector<const DeviceCapacity*> gpus;
  for (const auto& d : host.devices)
    if (d.device != "cpu") gpus.push_back(&d);
  // GPUs that do not divide among the processes are left out (CPU ranks still run); a plan that
  // wanted them says why (uneven_gpus).
  const std::size_t per = !uneven_gpus(host, local_world).empty() || gpus.empty() ? 0 : gpus.size() / static_cast<std::size_t>(std::max(1, local_world));
  const std::size_t first = static_cast<std::size_t>(local_rank) * per;
  std::size_t gpu = 0;  // index among the host's GPUs
  for (const auto& device : host.devices) {  // in the inventory's order: "last device" keeps its meaning
    DeviceCapacity d = device;
    if (d.device == "cpu") {
      d.capacity_bytes /= static_cast<std::uint64_t>(std::max(1, local_world));
      if (local_world > 1) d.description += ", 1/" + std::to_string(local_world) + " per process";
      out.devices.push_back(d);
      continue;
    }
    const std::size_t index = gpu++;
    if (local_world == 1) {  // one process: the host's names as they are
      out.devices.push_back(d);
      continue;
    }
    if (index < first || index >= first + per) continue;
    // Named as the rank sees them (its first GPU is cuda:0), so a pipeline's device names mean the
    // same at any number of processes; MeshPlan::physical_device() gives the host's name back.
    d.description += " [" + d.device + " of the host]";
    d.device = "cuda:" + std::to_string(index - first);
    out.devices.push_back(d);
  }
  return out;
}

namespace {
// Whether block `index`'s weights train nothing: an adapter's run where neither it nor a block
// tied to it has trainable values (a trained embedding trains its tied head).
bool trains_nothing(const PlacementRequest& r, std::size_t index) {
  if (r.adapter_trainable.size() != r.model.blocks.size()) return false;  // a full fine-tune
  const std::string& group = r.model.blocks[index].tied_group;
  for (std::size_t i = 0; i < r.model.blocks.size(); ++i)
    if ((i == index || (!group.empty() && r.model.blocks[i].tied_group == group)) && r.adapter_trainable[i] > 0) return false;
  return true;
}
}  // namespace

namespace {
// The largest micro-batch of a preference objective (batch_size pairs: two rows each, as long as
// the longest pair's longer row) or a sampling one (batch_size prompts x their completions, as
// long as the longest prompt and a whole completion).
MicroBatchShape objective_micro_batch(const Session& session, const Dataset& train) {
  const RunConfig& c = session.config;
  const ObjectiveNeeds& needs = session.needs;
  std::int64_t longest = 0;
  const ObjectiveSamples read(session.chat);
  // Every record is read here before the first step, so one the objective cannot read is named now.
  for (std::size_t i = 0; i < train.samples.size(); ++i) try {
      const auto& sample = train.samples[i];
      if (needs.data == ObjectiveData::kPreferences) longest = std::max(longest, collate_pairs({sample}, needs, read, *session.tokenizer, c.collate).batch.cols);
      else longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(read.prompt_ids(split_sample(sample), *session.tokenizer).size()));
    } catch (const UserError& e) {
      throw UserError(train.where(i) + ": " + e.what());
    }
  MicroBatchShape shape;
  if (needs.data == ObjectiveData::kPreferences) {
    shape.rows = 2 * c.batch_size;
    shape.cols = longest;
  } else {
    shape.rows = c.batch_size * needs.sampling.group_size;
    shape.cols = longest + needs.sampling.max_tokens;
  }
  return shape;
}
}  // namespace

std::optional<MicroBatchShape> data_micro_batch(const Session& session, const Mesh& mesh, std::string& why_not) {
  const RunConfig& c = session.config;
  if (!c.train_file || !session.collator || !session.tokenizer) return std::nullopt;
  std::error_code ec;
  if (!fs::is_regular_file(*c.train_file, ec)) {
    why_not = "no training data at " + c.train_file->string() + " yet";
    return std::nullopt;
  }
  const int ranks = std::max(1, mesh.data);
  try {
    const RunData data = load_run_data(c);
    if (session.needs.data != ObjectiveData::kText) return objective_micro_batch(session, data.train);
    MicroBatchShape largest = largest_micro_batch(data.train, *session.collator, *session.tokenizer, c, ranks);
    if (!data.eval.samples.empty()) {
      const MicroBatchShape eval = largest_eval_batch(data.eval, *session.collator, *session.tokenizer, c, ranks);
      if (eval.rows * eval.cols > largest.rows * largest.cols) largest = eval;
    }
    if (largest.rows == 0 || largest.cols == 0) return std::nullopt;
    return largest;
  } catch (const UserError& e) {
    why_not = std::string("the data could not be read (") + e.what() + ")";
    return std::nullopt;
  }
}

PlacementRequest placement_request(const Session& session, const Inventory& inventory, const Mesh& mesh, int local_world, int replica,
                                   const MicroBatchShape* largest) {
  PlacementRequest r;
  r.mesh = mesh;
  const int per_host = std::max(1, local_world);
  for (int p = 0; p < mesh.pipeline; ++p) {
    Inventory least;
    for (int t = 0; t < mesh.tensor; ++t) {
      const int rank = mesh.rank({replica, p, t});
      const Inventory own = rank_inventory(inventory, rank % per_host, per_host);
      if (t == 0) {
        least = own;
        continue;
      }
      for (auto& d : least.devices)
        if (const auto* other = own.find(d.device)) d.capacity_bytes = std::min(d.capacity_bytes, other->capacity_bytes);
    }
    r.ranks.push_back(least);
  }
  r.model = session.structure;
  if (session.adapter) r.adapter_trainable = adapter_trainable(*session.model, *session.adapter, session.structure);
  // An objective's reference model is the trainable tensors' starting values, kept beside them
  // (objectives/reference_weights): counted as weights of their block, where they live.
  if (session.needs.reference)
    for (std::size_t i = 0; i < r.model.blocks.size(); ++i) {
      auto& block = r.model.blocks[i];
      const std::uint64_t values = session.adapter ? (i < r.adapter_trainable.size() ? r.adapter_trainable[i] : 0) : block.parameters;
      const std::uint64_t stored = block.weight_bytes > 0 ? block.weight_bytes : block.parameters * dtype_bytes(session.config.dtype);
      block.weight_bytes = stored + values * dtype_bytes(session.config.dtype);
    }
  r.transient_bytes = session.base_transient_bytes;
  const RunConfig& c = session.config;
  // The placement counts the run's optimizer (kit::block_memory), as the checks below do.
  kit::count_optimizer_as(optimizer_memory(optimizer_settings(c)));
  kit::count_checkpoints_offloaded(c.offload_checkpoints);
  r.dtype = c.dtype;
  r.batch_size = c.batch_size;
  r.micro_batches = c.grad_accum;
  r.checkpoint_every = c.recompute_every;
  r.seq_len = c.collate.max_length;
  if (largest != nullptr) {
    r.batch_size = largest->rows;
    r.seq_len = largest->cols;
  }
  // Blocks whose values a token depend on the micro-batch's tokens (a long row's MLP in slices).
  const auto tokens = static_cast<std::uint64_t>(r.batch_size) * static_cast<std::uint64_t>(r.seq_len);
  if (const auto* counted = session.model ? capability<TokenCountedMemory>(*session.model) : nullptr)
    for (std::size_t i = 0; i < r.model.blocks.size(); ++i) {
      const TokenCountedMemory::Values v = counted->block_values_per_token(i, tokens, r.dtype);
      r.model.blocks[i].activation_values_per_token = v.activation_values_per_token;
      r.model.blocks[i].working_values_per_token = v.working_values_per_token;
    }
  // A model whose loss comes from a frozen whole head's input (FrozenHeadWorkingSet) holds a slice
  // of logits there, not all of them.
  const auto* frozen = session.model ? capability<FrozenHeadWorkingSet>(*session.model) : nullptr;
  if (frozen != nullptr && mesh.tensor == 1)
    for (std::size_t i = 0; i < r.model.blocks.size(); ++i)
      if (r.model.blocks[i].kind == BlockKind::kHead && trains_nothing(r, i))
        r.model.blocks[i].working_values_per_token =
            frozen->frozen_head_working_values_per_token(static_cast<std::uint64_t>(r.batch_size) * static_cast<std::uint64_t>(r.seq_len), r.dtype);
  return r;
}

namespace {
// A plugin's schedule against its own blocks: every stage a contiguous run on one rank and device,
// the lists well formed and free of deadlock.
void check_schedule_fits(const PlacementRequest& request, const Plan& plan, const std::string& who) {
  const auto& s = plan.schedule;
  if (request.mesh.pipeline > 1 && s.empty())
    throw UserError("[parallel] pipeline = " + std::to_string(request.mesh.pipeline) + " needs a placement that runs a pipeline schedule, and " + who +
                    " made none; use [placement] plugin = \"pipeline\"");
  if (s.empty()) return;
  if (s.actions.size() != request.ranks.size())
    throw UserError(who + " made a schedule for " + std::to_string(s.actions.size()) + " ranks, the replica has " + std::to_string(request.ranks.size()) +
                    " (plugin bug)");
  if (const std::string wrong = kit::check_schedule(s); !wrong.empty()) throw UserError(who + " made a broken schedule: " + wrong + " (plugin bug)");
  if (s.micro_batches != request.micro_batches)
    throw UserError(who + " scheduled " + std::to_string(s.micro_batches) + " micro-batches per step, the run has " +
                    std::to_string(request.micro_batches) + " (plugin bug)");
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    const auto& b = plan.blocks[i];
    const bool ok_stage = b.stage >= 0 && b.stage < s.stages && (i == 0 ? b.stage == 0 : b.stage == plan.blocks[i - 1].stage || b.stage == plan.blocks[i - 1].stage + 1);
    const bool same_place = i == 0 || b.stage != plan.blocks[i - 1].stage || (b.rank == plan.blocks[i - 1].rank && b.device == plan.blocks[i - 1].device);
    if (!ok_stage || !same_place || s.stage_rank[static_cast<std::size_t>(b.stage)] != b.rank)
      throw UserError(who + " put block '" + b.block + "' in stage " + std::to_string(b.stage) +
                      ", which breaks the stages' order or their rank and device (plugin bug)");
  }
  if (plan.blocks.back().stage + 1 != s.stages)
    throw UserError(who + " scheduled " + std::to_string(s.stages) + " stages for " + std::to_string(plan.blocks.back().stage + 1) + " (plugin bug)");
}
}  // namespace

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
    if (placed.rank < 0 || static_cast<std::size_t>(placed.rank) >= request.ranks.size())
      throw UserError(who + " put block '" + placed.block + "' on rank " + std::to_string(placed.rank) + " of a replica of " +
                      std::to_string(request.ranks.size()) + " (plugin bug)");
    const Inventory& inventory = request.ranks[static_cast<std::size_t>(placed.rank)];
    if (!inventory.find(placed.device))
      throw UserError(who + " put block '" + placed.block + "' on " + placed.device + ", which is not among the devices (" +
                      [&] {
                        std::string names;
                        for (const auto& d : inventory.devices) names += (names.empty() ? "" : ", ") + d.device;
                        return names;
                      }() + ")");
    const auto& group = blocks[i].tied_group;
    if (group.empty()) continue;
    // Where a block is: its device, and the replica rank when the replica has several. Under a
    // pipeline schedule each rank keeps a copy (gradients summed), so a group need share a device
    // only within one rank.
    const bool copies = !plan.schedule.empty();
    const std::string where = request.ranks.size() > 1 ? "rank " + std::to_string(placed.rank) + " " + placed.device : placed.device;
    auto [it, inserted] = group_device.emplace(copies ? group + "@" + std::to_string(placed.rank) : group, where);
    if (!inserted && it->second != where)
      throw UserError(who + " split the tied weights '" + group + "' across " + it->second + " and " + where + "; tied blocks must share a device" +
                      (copies ? " within a rank" : ""));
  }
  check_schedule_fits(request, plan, who);
  // A tensor group talks on one device per rank: each rank's blocks share it.
  if (request.mesh.tensor > 1) {
    std::map<int, std::string> rank_device;
    for (const auto& b : plan.blocks) {
      const auto [it, first] = rank_device.emplace(b.rank, b.device);
      if (!first && it->second != b.device)
        throw UserError(who + " put blocks of one rank on " + it->second + " and " + b.device + "; under tensor parallelism ([parallel] tensor = " +
                        std::to_string(request.mesh.tensor) + ") each rank's blocks share one device; use the tensor-parallel or pipeline placement");
    }
  }
  for (const auto& d : plan.devices) {
    const auto* cap = static_cast<std::size_t>(d.rank) < request.ranks.size() ? request.ranks[static_cast<std::size_t>(d.rank)].find(d.device) : nullptr;
    if (cap && d.total() > cap->capacity_bytes)
      throw UserError("the plan needs " + format_bytes(d.total()) + " on " + d.device +
                      (request.ranks.size() > 1 ? " of replica rank " + std::to_string(d.rank) : std::string()) + ", which has " +
                      format_bytes(cap->capacity_bytes) + " (" + cap->description + ")");
  }
}

namespace {
// Whether the model (and the adapter) can be split over the mesh's tensor ranks, asked before any
// placement runs; how it splits, for the plan's notes.
std::vector<std::string> tensor_parallel_notes(const Session& session, const Mesh& mesh) {
  if (mesh.tensor <= 1) return {};
  const std::string where = session.config.parallel.tensor_at.str() + ": [parallel] tensor = " + std::to_string(mesh.tensor);
  const auto* splittable = capability<TensorParallelModel>(*session.model);
  std::vector<std::string> notes;
  if (!splittable) {
    // The host splits it from what its linears declare (runtime/host_split.hpp).
    const std::string refusal = host_split_refusal(session.model->structure(), mesh.tensor, notes);
    if (!refusal.empty())
      throw UserError(where + ": model plugin '" + session.plugins.at(kKindModel)->name + "' does not split over tensor ranks: " + refusal +
                      "; use data or pipeline parallelism");
  } else {
    const TensorParallelSupport support = splittable->tensor_parallel(mesh.tensor);
    if (!support.refusal.empty())
      throw UserError(where + ": model plugin '" + session.plugins.at(kKindModel)->name + "' cannot split this model: " + support.refusal);
    notes = support.notes;
  }
  if (session.base_quantized)
    notes.push_back("base stored by adapter '" + session.plugins.at(kKindAdapter)->name + "': each tensor rank stores its own part of every split linear");
  return notes;
}
}  // namespace

Plan make_plan(const Session& session, const PlacementRequest& request) {
  const std::string& strategy = session.spec.section(kKindPlacement).plugin;
  const auto tensor_notes = tensor_parallel_notes(session, request.mesh);
  Plan plan;
  const auto started = std::chrono::steady_clock::now();
  try {
    plan = session.placement->plan(request);
  } catch (const UserError& e) {
    throw UserError(session.spec.section(kKindPlacement).plugin_where.str() + ": placement '" + strategy + "': " + e.what());
  }
  plan.mesh = request.mesh;
  check_plan(request, plan, strategy);
  for (const auto& note : tensor_notes) plan.notes.push_back("tensor parallel, " + note);
  spdlog::debug("placement '{}' planned {} blocks in {:.2f} ms", strategy, plan.blocks.size(),
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count());
  if (session.config.dtype_auto) plan.notes.push_back("[run] dtype = \"auto\" took " + session.config.dtype_choice);
  if (!session.spec.section("data").present)
    plan.notes.push_back("no [data] section: sequences assumed " + std::to_string(request.seq_len) + " tokens long ([data] max_length's default)");
  if (!session.spec.section("train").present)
    plan.notes.push_back("no [train] section: batch size assumed " + std::to_string(request.batch_size));
  const RunConfig& c = session.config;
  if (session.needs.reference)
    plan.notes.push_back("the weights hold the reference model of objective '" + session.spec.section(kKindObjective).plugin +
                         "': a copy of the trainable values as the run starts (" + (session.adapter ? "the adapter's" : "every weight's") + ")");
  if (session.needs.data == ObjectiveData::kPrompts)
    plan.notes.push_back("activations for " + std::to_string(c.batch_size) + " prompts x " + std::to_string(session.needs.sampling.group_size) +
                         " sampled completions a micro-batch; sampling's cache is sized to fit beside them when the run starts");
  else if (request.batch_size != c.batch_size || request.seq_len != c.collate.max_length)
    plan.notes.push_back("activations for the run's largest micro-batch from its data: " + std::to_string(request.batch_size) +
                         (request.batch_size == 1 ? " row of " : " rows of ") + std::to_string(request.seq_len) + " tokens (" +
                         (c.packing ? "packed" : "padded to its longest sample") + "; [train] batch_size " + std::to_string(c.batch_size) +
                         ", [data] max_length " + std::to_string(c.collate.max_length) + ")");
  return plan;
}

std::string MeshPlan::physical_device(int rank, const std::string& device) const {
  const DeviceName d = parse_device(device);
  if (!d.is_cuda || local_world == 1) return device;
  const auto index = static_cast<std::size_t>((rank % local_world) * gpus_per_rank + d.index);
  return index < host_gpus.size() ? host_gpus[index] : device;
}

namespace {
// [parallel] expert over the model: every sparse layer's experts dealt out evenly, with the
// strategies expert parallelism combines with so far. Each replica's plan then counts one rank's
// share of every stacked experts weight (and of an adapter's A and B on them): the data ranks of a
// replica hold alike but for which experts. Notes say how it splits.
std::vector<std::string> expert_parallel(const Session& session, const Mesh& mesh, int expert, PlacementRequest& request) {
  if (expert <= 1) return {};
  const std::string where = session.config.parallel.expert_at.str() + ": [parallel] expert = " + std::to_string(expert);
  const auto* structure = capability<ExpertStructure>(*session.model);
  const std::vector<ExpertsInfo> experts = structure ? structure->experts_info() : std::vector<ExpertsInfo>{};
  if (experts.empty())
    throw UserError(where + ": model plugin '" + session.plugins.at(kKindModel)->name + "' has no experts in this config to share out; leave expert at 1");
  if (mesh.tensor > 1 || mesh.pipeline > 1)
    throw UserError(where + ": expert parallelism combines with data parallelism only so far; leave [parallel] tensor and pipeline at 1");
  for (const auto& e : experts)
    if (e.experts % expert != 0)
      throw UserError(where + ": " + e.name + " has " + std::to_string(e.experts) + " experts, which do not divide over " + std::to_string(expert) +
                      " ranks; pick a divisor of " + std::to_string(e.experts));
  const auto* sizing = session.adapter ? capability<ExpertAdapterSizing>(*session.adapter) : nullptr;
  const std::vector<std::uint64_t> adapter_experts = sizing ? sizing->expert_trainable_parameters(session.structure, experts) : std::vector<std::uint64_t>{};
  std::uint64_t held = 0, all = 0;
  for (const auto& e : experts) {
    const auto values = static_cast<std::uint64_t>(e.experts) * static_cast<std::uint64_t>(e.out_features) * static_cast<std::uint64_t>(e.in_features);
    const std::uint64_t others = values - values / static_cast<std::uint64_t>(expert);
    auto& block = request.model.blocks.at(e.block);
    const std::uint64_t before = block.parameters;
    block.parameters -= std::min(block.parameters, others);
    if (block.weight_bytes > 0) block.weight_bytes = static_cast<std::uint64_t>(static_cast<long double>(block.weight_bytes) * block.parameters / before);
    all += values;
    held += values / static_cast<std::uint64_t>(expert);
  }
  // An adapter's A and B on the experts, each rank its own experts' (the rest of its values stay whole).
  if (!adapter_experts.empty() && request.adapter_trainable.size() == adapter_experts.size())
    for (std::size_t i = 0; i < adapter_experts.size(); ++i)
      request.adapter_trainable[i] -= std::min(request.adapter_trainable[i], adapter_experts[i] - adapter_experts[i] / static_cast<std::uint64_t>(expert));
  return {"expert parallel over " + std::to_string(expert) + " data ranks: each holds " + std::to_string(experts.front().experts / expert) + " of every " +
              "sparse layer's " + std::to_string(experts.front().experts) + " experts (" + std::to_string(held) + " of " + std::to_string(all) +
              " expert weights); tokens travel to their experts' ranks and back by all-to-all, a rank's buffers about its routed rows " +
              "(planned as balanced routing: up to " + std::to_string(expert) + "x that when every token picks one rank's experts)"};
}
}  // namespace

namespace {
// The devices a plan may use: [run] gpu_memory caps each GPU (set_up_rank caps the allocator too).
Inventory planned_inventory(const Session& session, const Inventory& devices) {
  Inventory inventory = devices;
  if (const auto cap = session.config.gpu_memory; cap > 0)
    for (auto& d : inventory.devices)
      if (d.device != "cpu" && d.capacity_bytes > cap) {
        d.capacity_bytes = cap;
        d.description += ", capped by [run] gpu_memory";
      }
  return inventory;
}

// The largest n of 1..limit for which fits(n) holds, fits holding up to some n and failing past it;
// `start` the first probe. 0 where fits(1) fails.
std::int64_t largest_fitting(std::int64_t start, std::int64_t limit, const std::function<bool(std::int64_t)>& fits) {
  std::int64_t good = 0, bad = limit + 1, probe = std::clamp<std::int64_t>(start, 1, limit);
  while (good + 1 < bad) {
    (fits(probe) ? good : bad) = probe;
    probe = bad > limit ? std::min(limit, good * 2) : good + (bad - good) / 2;
  }
  return good;
}
}  // namespace

MeshPlan::Fit fit_limits(const Session& session, const Inventory& devices, const Mesh& mesh, int local_world) {
  const Inventory inventory = planned_inventory(session, devices);
  const int expert = resolve_expert_ranks(session.config, mesh);
  // Whether a micro-batch of `rows` x `cols` tokens is planned on every replica's devices.
  // With `recompute_every` (above 0) and `offload`, as the settings would be with those.
  const auto fits = [&](std::int64_t rows, std::int64_t cols, std::int64_t recompute_every, bool offload = false) {
    const MicroBatchShape shape{rows, cols};
    bool fitting = true;
    try {
      for (int replica = 0; replica < mesh.data && fitting; ++replica) {
        PlacementRequest r = placement_request(session, inventory, mesh, local_world, replica, &shape);
        if (recompute_every > 0) r.checkpoint_every = recompute_every;
        if (offload) kit::count_checkpoints_offloaded(true);
        expert_parallel(session, mesh, expert, r);
        make_plan(session, r);
      }
    } catch (const UserError&) {
      fitting = false;
    }
    kit::count_checkpoints_offloaded(session.config.offload_checkpoints);
    return fitting;
  };
  MeshPlan::Fit f;
  f.batch_size = session.config.batch_size;
  f.max_length = session.config.collate.max_length;
  f.longest_limit = session.structure.max_positions > 0 ? session.structure.max_positions : std::int64_t{1} << 22;
  f.most_rows_limit = std::int64_t{1} << 16;
  f.longest = largest_fitting(f.max_length, f.longest_limit, [&](std::int64_t cols) { return fits(f.batch_size, cols, 0); });
  f.most_rows = largest_fitting(f.batch_size, f.most_rows_limit, [&](std::int64_t rows) { return fits(rows, f.max_length, 0); });
  if (f.longest < f.max_length && session.config.recompute_every != 1) f.fits_with_recompute = fits(f.batch_size, f.max_length, 1);
  if (f.longest < f.max_length && !f.fits_with_recompute && !session.config.offload_checkpoints)
    f.fits_with_offload = fits(f.batch_size, f.max_length, 1, true);
  return f;
}

std::string fit_text(const MeshPlan::Fit& f) {
  const auto n = [](std::int64_t v) { return std::to_string(v); };
  std::string out = f.longest == 0 ? "no micro-batch of " + n(f.batch_size) + " rows ([train] batch_size) fits at any [data] max_length"
                                   : "[train] batch_size " + n(f.batch_size) + " fits [data] max_length up to " + n(f.longest) +
                                         (f.longest == f.longest_limit ? " (the model's positions; no longer row was tried)" : "");
  out += f.most_rows == 0 ? "; no row of " + n(f.max_length) + " tokens ([data] max_length) fits"
                          : "; [data] max_length " + n(f.max_length) + " fits [train] batch_size up to " + n(f.most_rows) +
                                (f.most_rows == f.most_rows_limit ? " (no larger batch was tried)" : "");
  if (f.fits_with_recompute) out += "; [train] activation_checkpointing = \"every-layer\" makes the settings fit";
  else if (f.fits_with_offload) out += "; [train] activation_checkpointing = \"offload\" (layers' inputs in host memory) makes the settings fit";
  return out;
}

namespace {
// What offloading recomputed layers' inputs asks of the host link: each layer's input crosses it
// once each way, while the layer computes (matmuls alone; attention adds more at long rows). The
// copies keep pace with the forward while the GPU does at most this many FLOP/s: past it, a
// faster card waits on the link.
std::string offload_note(const PlacementRequest& request) {
  constexpr double kHostLinkBytesPerSecond = 25e9;  // PCIe 4.0 x16 as measured, not its 32 GB/s label
  for (const auto& block : request.model.blocks) {
    if (block.kind != BlockKind::kDecoderLayer || block.flops_per_token == 0) continue;
    const double bytes_per_token = static_cast<double>(request.model.hidden_size) * static_cast<double>(dtype_bytes(request.dtype));
    const double pace = static_cast<double>(block.flops_per_token) * kHostLinkBytesPerSecond / bytes_per_token / 1e12;
    char tflops[32];
    std::snprintf(tflops, sizeof tflops, "%.0f", pace);
    const auto input = static_cast<std::uint64_t>(bytes_per_token) * static_cast<std::uint64_t>(request.batch_size * request.seq_len);
    return "[train] activation_checkpointing = \"offload\": each layer's input (" + format_bytes(input) + " a micro-batch) goes to host memory in the forward and back ahead of the layer's backward; over a 25 GB/s host link the copies keep "
           "pace with a GPU doing up to " + std::string(tflops) + " TFLOP/s on the layer's products (past it the step waits on the link)";
  }
  return "[train] activation_checkpointing = \"offload\": no decoder layer to offload";
}
}  // namespace

MeshPlan make_mesh_plan(const Session& session, const Inventory& devices, const Mesh& mesh, int local_world, bool from_data) {
  const Inventory inventory = planned_inventory(session, devices);
  MeshPlan m;
  m.mesh = mesh;
  m.expert = resolve_expert_ranks(session.config, mesh);
  m.optimizer = session.config.optimizer;
  if (session.base_quantized)
    m.adapter_storage = "base stored by adapter '" + session.spec.section(kKindAdapter).plugin + "': " + session.base_stored_by_adapter;
  m.local_world = std::max(1, local_world);
  for (const auto& d : inventory.devices)
    if (d.device != "cpu") m.host_gpus.push_back(d.device);
  m.gpus_per_rank = static_cast<int>(m.host_gpus.size()) / m.local_world;
  const std::string uneven = uneven_gpus(inventory, m.local_world);
  if (!uneven.empty()) m.gpus_per_rank = 0;
  std::string why_not;
  const auto largest = from_data ? data_micro_batch(session, mesh, why_not) : std::nullopt;
  for (int replica = 0; replica < mesh.data; ++replica) {
    m.requests.push_back(placement_request(session, inventory, mesh, local_world, replica, largest ? &*largest : nullptr));
    const auto expert_notes = expert_parallel(session, mesh, m.expert, m.requests.back());
    try {
      m.replicas.push_back(make_plan(session, m.requests.back()));
      for (const auto& note : expert_notes) m.replicas.back().notes.push_back(note);
      if (!why_not.empty()) m.replicas.back().notes.push_back(why_not + ": activations for [train] batch_size rows of [data] max_length");
    } catch (const UserError& e) {
      if (uneven.empty()) throw;
      throw UserError(std::string(e.what()) + " (" + uneven + ")");
    }
  }
  if (session.config.offload_checkpoints) m.replicas.front().notes.push_back(offload_note(m.request()));
  if (const auto* sizing = capability<StaticCacheSizing>(*session.model)) {
    const Plan& plan = m.plan();
    const auto value_bytes = dtype_bytes(m.request().dtype);
    const auto* windows = capability<StaticCacheWindow>(*session.model);
    for (const auto& d : plan.devices) {
      MeshPlan::CacheUse use{d.rank, d.device, 0, {}};
      for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
        if (plan.blocks[i].rank != d.rank || plan.blocks[i].device != d.device) continue;
        const std::uint64_t bytes = sizing->cache_values_per_position(i, mesh.tensor) * value_bytes;
        const std::int64_t window = windows && bytes > 0 ? windows->cache_window(i) : 0;
        if (window < 0) throw std::logic_error("the model's cache_window of block " + std::to_string(i) + " is negative");
        if (window > 0) use.windowed[window] += bytes;
        else use.bytes_per_position += bytes;
      }
      if (use.bytes_per_position > 0 || !use.windowed.empty()) m.generation_cache.push_back(std::move(use));
    }
    m.evaluation_positions = session.config.collate.max_length + session.config.max_new_tokens;
  }
  return m;
}

namespace {

// What a device has left for a cache: a GPU's free memory and what its allocator holds unused;
// host RAM's MemAvailable. Nullopt where that is not known.
std::optional<std::uint64_t> left_for_cache(const std::string& device) {
  const DeviceName name = parse_device(device);
  if (name.is_cuda) return kit::compat::cuda_available(name.index);
  const Inventory here = detect_inventory();
  if (const auto* host = here.find("cpu"); host && host->capacity_bytes > 0) return host->capacity_bytes;  // MemAvailable
  return std::nullopt;
}

std::string cache_shape(std::int64_t rows, std::int64_t capacity) {
  return std::to_string(rows) + " rows of " + std::to_string(capacity) + " positions";
}

}  // namespace

std::uint64_t MeshPlan::CacheUse::bytes(std::int64_t rows, std::int64_t capacity) const {
  std::uint64_t per_row = bytes_per_position * static_cast<std::uint64_t>(std::max<std::int64_t>(capacity, 0));
  for (const auto& [window, bytes] : windowed) per_row += bytes * static_cast<std::uint64_t>(std::clamp<std::int64_t>(capacity, 0, window));
  return per_row * static_cast<std::uint64_t>(std::max<std::int64_t>(rows, 0));
}

void check_generation_cache(const MeshPlan& plan, int rank, std::int64_t rows, std::int64_t capacity) {
  for (const auto& c : plan.generation_cache) {
    if (c.rank != rank) continue;
    const std::uint64_t need = c.bytes(rows, capacity);
    spdlog::info("generate: the KV cache of {} takes {} on {}", cache_shape(rows, capacity), format_bytes(need), c.device);
    const auto available = left_for_cache(c.device);
    if (available && need > *available)
      throw UserError("generation's KV cache of " + cache_shape(rows, capacity) + " needs " + format_bytes(need) + " on " + c.device + ", which has " +
                      format_bytes(*available) + " left beside the model; ask for fewer --rows or --max-new-tokens, or shorter prompts");
  }
}

std::int64_t generation_rows_that_fit(const MeshPlan& plan, int rank, std::int64_t rows, std::int64_t capacity) {
  std::int64_t fit = rows;
  for (const auto& c : plan.generation_cache) {
    const std::uint64_t per_row = c.bytes(1, capacity);
    if (c.rank != rank || per_row == 0) continue;
    const auto available = left_for_cache(c.device);
    if (!available) continue;
    // A tenth is left for what the prompt pass makes beside the cache (its logits, masks, a graph's pool).
    const auto here = static_cast<std::int64_t>(std::min<std::uint64_t>(*available / 10 * 9 / per_row, static_cast<std::uint64_t>(rows)));
    if (here < 1)
      throw UserError("evaluation's generation cache of " + cache_shape(1, capacity) + " needs " + format_bytes(per_row) + " on " + c.device +
                      ", which has " + format_bytes(*available) + " left beside the model and the optimizer; lower [data] max_length or [train] " +
                      "max_new_tokens, or leave [data] eval unset");
    fit = std::min(fit, here);
  }
  if (fit < rows)
    spdlog::warn("evaluation generates {} rows at a time, not {}: a KV cache of more does not fit beside what the devices hold", fit, rows);
  return fit;
}

Inventory parse_inventory(const std::string& text, GpuCapabilities* capabilities) {
  Inventory inv;
  inv.simulated = true;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    std::string item = text.substr(start, end - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    start = end + 1;
    if (item.empty()) {
      if (end == text.size()) break;
      continue;
    }
    const auto eq = item.find('=');
    if (eq == std::string::npos)
      throw UserError("bad device entry \"" + item + "\" in --devices: write DEVICE=SIZE, e.g. \"cuda:0=16GiB\"");
    const std::string device = parse_device(item.substr(0, eq)).str();
    if (inv.find(device)) throw UserError("device " + device + " is listed twice in --devices");
    std::string size = item.substr(eq + 1);
    int capability = 0;
    if (const auto at = size.find('@'); at != std::string::npos) {
      if (device == "cpu") throw UserError("--devices entry \"" + item + "\": a compute capability (@" + size.substr(at + 1) + ") is a GPU's; the cpu has none");
      try {
        capability = kit::parse_capability(size.substr(at + 1));
      } catch (const UserError& e) {
        throw UserError("--devices entry \"" + item + "\": " + e.what());
      }
      size.erase(at);
    }
    inv.devices.push_back({device, parse_bytes(size), capability > 0 ? "simulated, compute capability " + kit::capability_name(capability) : "simulated"});
    if (capabilities != nullptr && device != "cpu") (*capabilities)[device] = capability;
  }
  if (inv.devices.empty())
    throw UserError("--devices lists no device: write e.g. \"cuda:0=16GiB,cuda:1=16GiB,cpu=64GiB\"");
  return inv;
}

Inventory detect_inventory() {
  Inventory inv;
  for (int i = 0; i < kit::compat::cuda_device_count(); ++i) {
    const auto mem = kit::compat::cuda_device_memory(i);
    inv.devices.push_back({"cuda:" + std::to_string(i), mem.free_bytes,
                           mem.name + " (free of " + format_bytes(mem.total_bytes) + ", compute capability " +
                               kit::capability_name(kit::compat::cuda_device_capability(i)) + ")"});
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
