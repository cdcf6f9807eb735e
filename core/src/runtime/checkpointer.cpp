#include "runtime/checkpointer.hpp"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/safetensors.hpp"
#include "distributed/distributed.hpp"
#include "runtime/output_folder.hpp"
#include "runtime/replica_outputs.hpp"

namespace loom::core {
namespace fs = std::filesystem;

namespace {
// A name a run gives its checkpoints (step-NNNNNNNN), which keeps a path made from it inside the run.
bool checkpoint_name(const std::string& name) {
  return name.size() == 13 && name.compare(0, 5, "step-") == 0 && name.find_first_not_of("0123456789", 5) == std::string::npos;
}
}  // namespace

CheckpointState read_checkpoint_state(const fs::path& checkpoints, const RunShape& run) {
  const fs::path latest = checkpoints / "latest";
  std::string name = kit::read_regular_file(latest, 4096, "checkpoint pointer");
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (!checkpoint_name(name))
    throw UserError(latest.string() + " holds " + kit::json::quote(name, 40) + ", not the name of a checkpoint (step-NNNNNNNN); the run folder is damaged");
  std::error_code ec;
  const fs::path dir = checkpoints / name;
  if (!fs::is_directory(dir, ec)) throw UserError(latest.string() + " names " + name + ", which is not a checkpoint folder in " + checkpoints.string());
  const fs::path state_file = dir / "trainer.json";
  const auto root = kit::json::read_file(state_file, 1u << 20, "checkpoint state");
  const kit::json::Value state(root, state_file.string());
  CheckpointState c;
  c.name = name;
  c.step = state["step"].integer(0);
  if (c.step != std::stoll(name.substr(5))) state["step"].fail(std::to_string(c.step) + " is not the step of " + name);
  if (c.step > run.total_steps)
    throw UserError("--resume: " + (checkpoints / name).string() + " is at step " + std::to_string(c.step) + ", past this run's " +
                    std::to_string(run.total_steps) + " steps ([train] max_steps or epochs): raise them to go on from it, or start a new run");
  c.optimizer_steps = state["optimizer_steps"].integer(0, c.step);
  const auto per_epoch = static_cast<std::int64_t>(run.samples);
  c.epoch = static_cast<std::uint64_t>(state["epoch"].integer(0, c.step * run.samples_per_step / std::max<std::int64_t>(per_epoch, 1) + 1));
  c.index = static_cast<std::size_t>(state["index"].integer(0, per_epoch));
  c.loss_scale = state["loss_scale"].number();
  if (!(c.loss_scale > 0 && std::isfinite(c.loss_scale))) state["loss_scale"].fail("must be a positive finite number");
  c.good_steps = state["good_steps"].integer(0, c.step);
  c.skipped_samples = static_cast<std::size_t>(state["skipped_samples"].integer(0));
  c.last_loss = state["last_loss"].number_or(0.0);
  c.total_steps = run.total_steps;
  const auto optional_number = [&](const char* key) -> std::optional<double> {
    if (!root.contains(key) || root[key].is_null()) return std::nullopt;
    const double v = state[key].number();
    if (!std::isfinite(v)) state[key].fail("must be a finite number");
    return v;
  };
  c.eval_loss = optional_number("eval_loss");
  c.exact_match = optional_number("exact_match");
  c.best_value = optional_number("best_value");
  c.best_eval = optional_number("best_eval");
  if (root.contains("best") && !root["best"].is_null()) {
    c.best = state["best"].string();
    if (!checkpoint_name(c.best) || std::stoll(c.best.substr(5)) > c.step)
      state["best"].fail("is not the name of a checkpoint up to " + name);
    if (!c.best_value) state["best"].fail("comes without best_value, the metric it was chosen by");
  }
  c.evals_without_improvement = root.contains("evals_without_improvement") ? state["evals_without_improvement"].integer(0, c.step) : 0;
  if (root.contains("mesh")) {
    const auto mesh = state["mesh"];
    c.mesh.data = static_cast<int>(mesh["data"].integer(1, 1 << 16));
    c.mesh.pipeline = static_cast<int>(mesh["pipeline"].integer(1, 1 << 10));
    c.mesh.tensor = static_cast<int>(mesh["tensor"].integer(1, 1 << 10));
    if (root["mesh"].contains("expert")) c.expert = static_cast<int>(mesh["expert"].integer(1, c.mesh.data));
  }
  return c;
}

Checkpointer::Checkpointer(fs::path checkpoints, Parallel& parallel, std::vector<c10::Device> cuda_devices, c10::Device comm_device)
    : dir_(std::move(checkpoints)), parallel_(parallel), cuda_(std::move(cuda_devices)), comm_device_(comm_device) {}

std::string Checkpointer::rng_file() const { return "rng-rank" + std::to_string(parallel_.rank()) + ".safetensors"; }
std::string Checkpointer::optimizer_file() const {
  const MeshCoord c = parallel_.coord();
  const int experts = expert_ranks(parallel_);
  return "optimizer-pipeline" + std::to_string(c.pipeline) + "-tensor" + std::to_string(c.tensor) +
         (experts > 1 ? "-expert" + std::to_string(c.data % experts) : std::string()) + ".safetensors";
}

void Checkpointer::save(CheckpointState state, const Optimizer& optimizer, const std::function<void(const fs::path&)>& write_weights) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(state.step));
  state.name = name;
  const bool main = parallel_.rank() == 0;
  const fs::path dir = dir_ / name, tmp = dir_ / (std::string(".") + name + ".tmp");
  std::string failure;
  try {
    if (main) {
      kit::remove_tree(tmp);
      fs::create_directories(tmp);
    }
    parallel_.world().barrier();
    std::vector<std::pair<std::string, at::Tensor>> rng;
    rng.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
    // Each GPU's generator too: dropout there draws from it, and a resumed run must draw the same.
    for (const auto& device : cuda_) rng.emplace_back("rng." + device.str(), at::globalContext().defaultGenerator(device).get_state());
    kit::write_safetensors(tmp / rng_file(), rng);
    if (parallel_.coord().data < expert_ranks(parallel_)) {  // each share of the experts has its own
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      optimizer.save(tensors);
      kit::write_safetensors(tmp / optimizer_file(), tensors);
    }
    if (write_weights) write_weights(tmp);
    if (main) {
      const Mesh& m = parallel_.mesh();
      nlohmann::json json = {{"step", state.step},
                                   {"optimizer_steps", state.optimizer_steps},
                                   {"epoch", state.epoch},
                                   {"index", state.index},
                                   {"loss_scale", state.loss_scale},
                                   {"good_steps", state.good_steps},
                                   {"skipped_samples", state.skipped_samples},
                                   {"total_steps", state.total_steps},
                                   {"last_loss", state.last_loss},
                                   {"mesh", {{"data", m.data}, {"pipeline", m.pipeline}, {"tensor", m.tensor}, {"expert", expert_ranks(parallel_)}}},
                                   {"evals_without_improvement", state.evals_without_improvement}};
      nlohmann::json& j = json;
      const auto put = [&](const char* key, const std::optional<double>& v) {
        if (v) j[key] = *v;
      };
      put("eval_loss", state.eval_loss);
      put("exact_match", state.exact_match);
      put("best_value", state.best_value);
      put("best_eval", state.best_eval);
      if (!state.best.empty()) j["best"] = state.best;
      kit::write_file_atomically(tmp / "trainer.json", json.dump(2) + "\n");
    }
  } catch (const CommunicationError&) {
    throw;
  } catch (const std::exception& e) {  // a full disk, a quota, a file size limit, permissions
    failure = describe_error(e);
  }
  // Every rank learns whether all wrote their part before rank 0 names the checkpoint.
  const auto failed = sum_over(parallel_.world(), {failure.empty() ? 0.0 : 1.0}, comm_device_);
  if (failed[0] > 0) {
    if (main) kit::remove_tree(tmp);
    const std::string previous = last_.empty() ? "there is no earlier checkpoint" : "the checkpoint " + last_ + " is intact";
    throw UserError("cannot write the checkpoint at step " + std::to_string(state.step) + " (" +
                    (failure.empty() ? "another rank failed to write its part" : failure) + "); " + previous +
                    ": free space and continue with --resume");
  }
  if (main) {
    kit::remove_tree(dir);
    fs::rename(tmp, dir);
    kit::write_file_atomically(dir_ / "latest", std::string(name) + "\n");
    spdlog::info("checkpoint {}", dir.string());
  }
  parallel_.world().barrier();
  last_ = name;
}

std::optional<CheckpointState> Checkpointer::restore(const RunShape& run, Optimizer& optimizer) {
  std::error_code ec;
  if (!fs::exists(dir_ / "latest", ec)) return std::nullopt;
  const CheckpointState state = read_checkpoint_state(dir_, run);
  if (state.mesh != parallel_.mesh())
    throw UserError("--resume: " + (dir_ / state.name).string() + " was written by a run on the mesh " + state.mesh.str() + " (" +
                    std::to_string(state.mesh.world()) + " processes); this run is " + parallel_.mesh().str() + " (" +
                    std::to_string(parallel_.mesh().world()) + "); resume on the same mesh");
  if (state.expert != expert_ranks(parallel_))
    throw UserError("--resume: " + (dir_ / state.name).string() + " was written with [parallel] expert = " + std::to_string(state.expert) +
                    "; this run has " + std::to_string(expert_ranks(parallel_)) + "; resume with the same expert ranks");
  const fs::path dir = dir_ / state.name;
  for (const auto& file : {optimizer_file(), rng_file()})
    if (!fs::exists(dir / file, ec))
      throw UserError("--resume: " + (dir / file).string() + " is missing (written by an older loom, or the checkpoint is damaged); start a new run");
  optimizer.load(kit::SafetensorsFile(dir / optimizer_file()), state.optimizer_steps);
  const kit::SafetensorsFile rng(dir / rng_file());
  auto generator = at::detail::getDefaultCPUGenerator();
  generator.set_state(rng.tensor("rng.cpu").clone());
  for (const auto& device : cuda_) {
    if (!rng.find("rng." + device.str())) {
      spdlog::warn("--resume: the checkpoint has no random state for {}; dropout there will not repeat the interrupted run", device.str());
      continue;
    }
    auto cuda_generator = at::globalContext().defaultGenerator(device);
    cuda_generator.set_state(rng.tensor("rng." + device.str()).clone());
  }
  last_ = state.name;
  return state;
}

void Checkpointer::prune(std::int64_t keep, const std::string& protect) {
  if (keep <= 0 || parallel_.rank() != 0) return;
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec))
    if (entry.is_directory(ec) && checkpoint_name(entry.path().filename().string())) names.push_back(entry.path().filename().string());
  std::sort(names.rbegin(), names.rend());  // newest first (the names' steps have 8 digits)
  for (std::size_t i = static_cast<std::size_t>(keep); i < names.size(); ++i)
    if (names[i] != protect && names[i] != last_) kit::remove_tree(dir_ / names[i]);
}

void Checkpointer::name_best(const std::string& name) {
  if (parallel_.rank() == 0) kit::write_file_atomically(dir_ / "best", name + "\n");
}

void Checkpointer::load_weights(const std::string& name, Optimizer& optimizer) {
  const fs::path file = dir_ / name / optimizer_file();
  std::error_code ec;
  if (!fs::exists(file, ec)) throw UserError(file.string() + " is missing: the best checkpoint was removed while the run went on; its weights cannot be the outputs");
  optimizer.load(kit::SafetensorsFile(file), optimizer.steps_taken());
}

}  // namespace loom::core
