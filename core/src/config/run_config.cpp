#include "config/run_config.hpp"

#include "config/host_keys.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "loom/kit/json.hpp"
#include "loom/kit/kernels.hpp"
#include "loom/kit/torch_compat.hpp"

namespace loom::core {
namespace {

// A [train] key written for an optimizer or schedule the run does not use would change nothing:
// said at the key, with what uses it.
void check_train_keys_apply(const SectionSpec& train, const RunConfig& c, Diagnostics& diagnostics) {
  const auto given = [&](const std::string& key) { return train.locations.count(key) > 0; };
  const auto only = [&](const std::string& key, bool applies, const std::string& users, const std::string& now) {
    if (given(key) && !applies) diagnostics.add(train.location_of(key), "[train] " + key + " is used by " + users + " only; this run " + now + ": remove it");
  };
  const std::string optimizer = "trains with optimizer = \"" + c.optimizer + "\"", scheduler = "has scheduler = \"" + c.scheduler + "\"";
  const bool adam = c.optimizer == "adamw" || c.optimizer == "adamw_8bit";
  only("adam_beta1", adam || c.optimizer == "lion", "adamw, adamw_8bit and lion", optimizer);
  only("adam_beta2", adam || c.optimizer == "lion", "adamw, adamw_8bit and lion", optimizer);
  only("adam_epsilon", adam, "adamw and adamw_8bit", optimizer);
  only("momentum", c.optimizer == "sgd", "optimizer = \"sgd\"", optimizer);
  only("nesterov", c.optimizer == "sgd", "optimizer = \"sgd\"", optimizer);
  only("cycles", c.scheduler == "cosine_with_restarts", "scheduler = \"cosine_with_restarts\"", scheduler);
  only("decay_ratio", c.scheduler == "wsd", "scheduler = \"wsd\"", scheduler);
  only("decay_shape", c.scheduler == "wsd", "scheduler = \"wsd\"", scheduler);
  only("min_lr_ratio", c.scheduler != "constant", "the decaying schedules", scheduler);
  if (given("warmup_ratio") && given("warmup_steps"))
    diagnostics.add(train.location_of("warmup_ratio"), "[train] warmup_ratio and warmup_steps both set the warm-up; keep one");
  // The best checkpoint is chosen by the evaluation at its step: every checkpoint needs one.
  if (!c.best_metric.empty()) {
    if (!c.has_eval())
      diagnostics.add(train.location_of("best_metric"),
                      "[train] best_metric compares evaluations on [data] eval, which this pipeline lacks: add it (or [data] eval_split)");
    else if (c.checkpoint_every <= 0 || c.eval_every <= 0 || c.checkpoint_every % c.eval_every != 0)
      diagnostics.add(train.location_of("best_metric"), "[train] best_metric compares checkpoints by the evaluation at their step: set checkpoint_every "
                                                        "(now " + std::to_string(c.checkpoint_every) + ") to a multiple of eval_every (now " +
                                                        std::to_string(c.eval_every) + "), both above 0");
  }
  if (c.early_stopping_patience > 0 && c.best_metric.empty())
    diagnostics.add(train.location_of("early_stopping_patience"), "[train] early_stopping_patience counts evaluations without best_metric improving: set "
                                                                  "best_metric = \"eval_loss\" (or \"exact_match\")");
  only("early_stopping_threshold", c.early_stopping_patience > 0, "early stopping (early_stopping_patience above 0)", "stops at no patience");
  if (c.optimizer == "sgd" && c.nesterov && c.momentum <= 0)
    diagnostics.add(train.location_of("nesterov"), "[train] nesterov needs momentum above 0 (torch.optim.SGD refuses it too)");
}

}  // namespace

void choose_dtype(RunConfig& c, const GpuCapabilities& gpus, const SectionSpec& run, Diagnostics& diagnostics) {
  // The GPU of the lowest capability decides (a known one before an unknown one).
  const auto lowest = std::min_element(gpus.begin(), gpus.end(), [](const auto& a, const auto& b) {
    return (a.second == 0 ? 1000 : a.second) < (b.second == 0 ? 1000 : b.second);
  });
  const bool without_bf16 = lowest != gpus.end() && lowest->second > 0 && lowest->second < 80;
  const std::string lacks = without_bf16 ? lowest->first + " has compute capability " + kit::capability_name(lowest->second) +
                                               ", which computes no bfloat16 (that needs 8.0)"
                                         : std::string();
  if (!c.dtype_auto) {
    if (c.dtype == DType::kBFloat16 && without_bf16)
      diagnostics.add(run.location_of("dtype"), "[run] dtype = \"bf16\": " + lacks + "; use \"fp16\" (trained with loss scaling) or \"auto\"");
    return;
  }
  if (gpus.empty()) {
    c.dtype = DType::kFloat32;
    c.dtype_choice = "fp32: no GPU, and the CPU computes in float32";
  } else if (without_bf16) {
    c.dtype = DType::kFloat16;
    c.dtype_choice = "fp16 with loss scaling: " + lacks;
  } else {
    c.dtype = DType::kBFloat16;
    c.dtype_choice = lowest->second == 0 ? "bf16: the simulated GPUs name no compute capability (--devices \"cuda:0=15GiB@7.5\" plans a 7.x card, in fp16)"
                                         : "bf16: every GPU has compute capability 8.0 or more";
  }
}

GpuCapabilities detect_gpu_capabilities() {
  GpuCapabilities gpus;
  for (int i = 0; i < kit::compat::cuda_device_count(); ++i) gpus["cuda:" + std::to_string(i)] = kit::compat::cuda_device_capability(i);
  return gpus;
}

RunConfig read_run_config(const PipelineSpec& spec, Diagnostics& diagnostics) {
  RunConfig c;
  // Every host key, each stored where its table entry says (config/host_keys.cpp).
  for (const auto& name : host_sections()) {
    const SectionSpec& section = spec.section(name);
    for (const auto& key : host_keys(name))
      if (key.store && section.options.has(key.spec.name)) key.store(c, section.options.get(key.spec.name), KeyPlace{section.location_of(key.spec.name), diagnostics});
  }
  c.parallel.where = spec.section("parallel").where;

  // What one key's schema cannot say: keys that must agree.
  const auto& data = spec.section("data");
  if (data.options.has("weights")) {
    const auto where = data.location_of("weights");
    if (c.train_weights.size() != c.train_files.size())
      diagnostics.add(where, "[data] weights has " + std::to_string(c.train_weights.size()) + " entries for " + std::to_string(c.train_files.size()) +
                                 " train files; give one a file");
    else if (std::any_of(c.train_weights.begin(), c.train_weights.end(), [](std::int64_t w) { return w < 1 || w > 1000000; }))
      diagnostics.add(where, "[data] weights are whole numbers from 1 to 1000000 (each file's share of an epoch's samples)");
  }
  if (c.eval_split > 0 && c.eval_file) diagnostics.add(data.location_of("eval_split"), "[data] eval_split and eval both give the evaluation data; keep one");
  if (c.eval_split >= 1 && c.train_files.size() > 1)
    diagnostics.add(data.location_of("eval_split"), "[data] eval_split with several train files is a fraction below 1 (held out of each file), not a count");
  else if (c.eval_split >= 1 && c.eval_split != std::floor(c.eval_split))
    diagnostics.add(data.location_of("eval_split"),
                    "[data] eval_split is a whole number of records (from 1) or a fraction of them (below 1), not " + std::to_string(c.eval_split));

  const auto adapter = spec.sections.find("adapter");
  c.merge_adapter = adapter != spec.sections.end() && adapter->second.options.has("merge") && adapter->second.options.get_bool("merge");
  if (adapter != spec.sections.end() && adapter->second.options.has("start_from")) c.adapter_start = adapter->second.options.get_string("start_from");
  check_train_keys_apply(spec.section("train"), c, diagnostics);
  return c;
}

RunData load_run_data(const RunConfig& c) {
  if (!c.train_file) throw std::logic_error("a run without [data] train passed validation");
  RunData data;
  std::vector<Dataset> files;
  for (const auto& f : c.train_files) files.push_back(load_data(f, c.format, c.skip_bad_lines, static_cast<std::size_t>(-1), true, c.samples_with_records));
  if (c.eval_file) {
    data.eval = load_data(*c.eval_file, c.format, c.skip_bad_lines, static_cast<std::size_t>(-1), true, c.samples_with_records);
  } else if (c.eval_split > 0) {
    // Held out of each file before the mix weighs them, so no held-out record is trained on.
    for (std::size_t i = 0; i < files.size(); ++i) {
      Dataset held = split_off(files[i], c.eval_split, c.seed + i);
      if (i == 0) data.eval = std::move(held);
      else {
        data.eval.file += ", " + held.file;
        data.eval.samples.insert(data.eval.samples.end(), held.samples.begin(), held.samples.end());
        data.eval.lines.insert(data.eval.lines.end(), held.lines.begin(), held.lines.end());
        data.eval.records += held.records;
      }
    }
  }
  data.train = mix_datasets(std::move(files), c.train_weights, c.seed);
  return data;
}

}  // namespace loom::core
