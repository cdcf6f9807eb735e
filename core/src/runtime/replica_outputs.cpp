#include "runtime/replica_outputs.hpp"

#include <cstdio>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/safetensors.hpp"
#include "distributed/distributed.hpp"

namespace loom::core {
namespace fs = std::filesystem;

std::vector<double> sum_over(Communicator& group, std::vector<double> values, c10::Device device) {
  return reduce_over(group, std::move(values), device, ReduceOp::kSum);
}

std::vector<double> reduce_over(Communicator& group, std::vector<double> values, c10::Device device, ReduceOp op) {
  if (group.size() == 1) return values;
  at::Tensor t = at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(device);
  group.all_reduce_now({t}, op);
  const at::Tensor host = t.to(at::kCPU);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = host[static_cast<std::int64_t>(i)].item<double>();
  return values;
}

// Runs `part` on every rank of `group`; all learn whether any failed (one collective each rank
// always reaches, so a full disk on one rank is an error on all, never a rank left waiting).
void ReplicaOutputs::together(Communicator& group, const std::string& what, const std::function<void()>& part) {
  std::string failure;
  try {
    part();
  } catch (const CommunicationError&) {
    throw;
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (sum_over(group, {failure.empty() ? 0.0 : 1.0}, device_)[0] > 0)
    throw UserError(failure.empty() ? "another pipeline rank failed on its part of " + what : failure);
}

// Rank 0 of the pipeline group gets every rank's tensors (the first of a name wins), through files
// beside `dir` (a run folder every rank writes to already holds their checkpoints).
std::vector<std::pair<std::string, at::Tensor>> ReplicaOutputs::gather(std::vector<std::pair<std::string, at::Tensor>> tensors, const fs::path& dir) {
  Communicator& group = parallel_.pipeline();
  const fs::path parts = dir.parent_path() / ("." + dir.filename().string() + ".parts");
  together(group, dir.string(), [&] {
    if (group.rank() == 0) return;
    fs::create_directories(parts);
    kit::write_safetensors(parts / ("rank-" + std::to_string(group.rank()) + ".safetensors"), tensors);
  });
  together(group, dir.string(), [&] {
    if (group.rank() != 0) return;
    std::set<std::string> names;
    for (const auto& [name, t] : tensors) names.insert(name);
    for (int r = 1; r < group.size(); ++r) {
      const kit::SafetensorsFile file(parts / ("rank-" + std::to_string(r) + ".safetensors"));
      for (const auto& info : file.tensors())
        if (names.insert(info.name).second) tensors.emplace_back(info.name, file.tensor(info.name).clone());
    }
    kit::remove_tree(parts);
  });
  return tensors;
}

void ReplicaOutputs::save_adapter(const Adapter& adapter, LoadedModel& model, const fs::path& dir) {
  auto tensors = adapter.saved_tensors(model);  // whole tensors on every tensor rank (gathered)
  if (pipelined_) {
    if (parallel_.coord().data != 0 || parallel_.coord().tensor != 0) return;
    tensors = gather(std::move(tensors), dir);
    if (parallel_.pipeline().rank() != 0) return;
  } else if (parallel_.rank() != 0) {
    return;
  }
  adapter.write(tensors, dir);
  // The adapter plugin does not know the base; where its config leaves the base unnamed, the host
  // names it as the pipeline does.
  const fs::path config_file = dir / "adapter_config.json";
  if (base_name_.empty() || !fs::is_regular_file(config_file)) return;
  auto config = kit::json::read_file(config_file, 1u << 20, "adapter config");
  if (!config.is_object()) return;
  const auto unnamed = [&](const char* key) { return config.contains(key) && config[key].is_null(); };
  if (!unnamed("base_model_name_or_path")) return;
  config["base_model_name_or_path"] = base_name_;
  if (!base_revision_.empty() && unnamed("revision")) config["revision"] = base_revision_;
  kit::write_file_atomically(config_file, config.dump(2) + "\n");
}

void ReplicaOutputs::save_model(LoadedModel& model, const fs::path& dir) {
  // Every tensor rank takes part in save_pretrained (its shards are gathered), and every rank of the
  // first expert group (its experts too); its rank 0 writes.
  if (parallel_.coord().data >= expert_ranks(parallel_)) return;
  if (!pipelined_) {
    model.save_pretrained(dir);
    return;
  }
  Communicator& group = parallel_.pipeline();
  const fs::path parts = dir.parent_path() / ("." + dir.filename().string() + ".parts");
  const auto part = [&](int r) { return parts / ("rank-" + std::to_string(r)); };
  together(group, dir.string(), [&] { model.save_pretrained(part(group.rank())); });
  if (parallel_.coord().tensor != 0) return;
  together(group, dir.string(), [&] {
    if (group.rank() != 0) return;
    kit::remove_tree(dir);
    fs::create_directories(dir);
    nlohmann::json map = nlohmann::json::object();
    std::uint64_t total = 0;
    std::set<std::string> seen;
    for (int r = 0; r < group.size(); ++r) {
      char shard[64];
      std::snprintf(shard, sizeof shard, "model-%05d-of-%05d.safetensors", r + 1, group.size());
      const fs::path file = part(r) / "model.safetensors";
      bool duplicate = false;
      {
        std::vector<std::pair<std::string, at::Tensor>> kept;
        const kit::SafetensorsFile f(file);
        for (const auto& info : f.tensors()) {
          if (!seen.insert(info.name).second) {
            duplicate = true;
            continue;
          }
          const at::Tensor t = f.tensor(info.name);
          map[info.name] = shard;
          total += static_cast<std::uint64_t>(t.numel()) * t.element_size();
          kept.emplace_back(info.name, t);
        }
        if (duplicate) kit::write_safetensors(dir / shard, kept, {{"format", "pt"}});
      }
      if (!duplicate) fs::rename(file, dir / shard);
    }
    for (const auto& entry : fs::directory_iterator(part(0)))
      if (entry.path().filename() != "model.safetensors") fs::rename(entry.path(), dir / entry.path().filename());
    const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
    kit::write_file_atomically(dir / "model.safetensors.index.json", index.dump(2) + "\n");
    kit::remove_tree(parts);
  });
}

}  // namespace loom::core
