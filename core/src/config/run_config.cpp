#include "config/run_config.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "loom/kit/json.hpp"
#include "loom/kit/kernels.hpp"
#include "loom/kit/torch_compat.hpp"

namespace loom::core {
namespace {

// [train] activation_checkpointing as "every Nth decoder layer" (1: every layer, 0: none).
std::int64_t recompute_every(const SectionSpec& train, Diagnostics& diagnostics) {
  const std::string value = train.options.get_string("activation_checkpointing");
  if (value == "none") return 0;
  if (value == "every-layer") return 1;
  const std::string prefix = "every-";
  if (value.size() > prefix.size() && value.size() <= prefix.size() + 6 && value.compare(0, prefix.size(), prefix) == 0 &&
      value.find_first_not_of("0123456789", prefix.size()) == std::string::npos) {
    const auto n = std::stoll(value.substr(prefix.size()));
    if (n >= 1) return n;
  }
  diagnostics.add(train.location_of("activation_checkpointing"), "[train] activation_checkpointing = " + kit::json::quote(value, 40) +
                                                                     ": use \"none\", \"every-layer\" or \"every-N\" with N a whole number from 1 (e.g. \"every-2\")");
  return 0;
}

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
  const auto& parallel = spec.section("parallel");
  c.parallel.data = static_cast<int>(parallel.options.get_int("data"));
  c.parallel.pipeline = static_cast<int>(parallel.options.get_int("pipeline"));
  c.parallel.tensor = static_cast<int>(parallel.options.get_int("tensor"));
  c.parallel.expert = static_cast<int>(parallel.options.get_int("expert"));
  c.parallel.where = parallel.where;
  c.parallel.data_at = parallel.location_of("data");
  c.parallel.tensor_at = parallel.location_of("tensor");
  c.parallel.expert_at = parallel.location_of("expert");
  const auto& run = spec.section("run").options;
  c.dtype_auto = run.get_string("dtype") == "auto";
  c.dtype = c.dtype_auto ? DType::kFloat32 : parse_dtype(run.get_string("dtype"));  // auto: choose_dtype decides
  c.seed = static_cast<std::uint64_t>(run.get_int("seed"));
  c.output_dir = run.get_string("output_dir");
  if (run.has("gpu_memory")) {
    try {
      c.gpu_memory = parse_bytes(run.get_string("gpu_memory"));
      if (c.gpu_memory < (std::uint64_t{1} << 28)) throw UserError("less than 256 MiB leaves no room for a model");
    } catch (const UserError& e) {
      diagnostics.add(spec.section("run").location_of("gpu_memory"), std::string("[run] gpu_memory: ") + e.what() + "; write e.g. \"15GiB\"");
    }
  }
  c.check_devices = run.get_bool("check_devices");
  c.check_replicas = run.get_bool("check_replicas");
  c.check_replicas_every = run.get_int("check_replicas_every");
  c.timeout_s = run.get_int("timeout");

  const auto& train_section = spec.section("train");
  const auto& t = train_section.options;
  c.batch_size = t.get_int("batch_size");
  c.grad_accum = t.get_int("grad_accum");
  c.max_steps = t.get_int("max_steps");
  c.epochs = t.get_int("epochs");
  c.log_every = t.get_int("log_every");
  c.eval_every = t.get_int("eval_every");
  c.eval_samples = t.get_int("eval_samples");
  c.max_new_tokens = t.get_int("max_new_tokens");
  c.checkpoint_every = t.get_int("checkpoint_every");
  c.keep_checkpoints = t.get_int("keep_checkpoints");
  c.best_metric = t.get_string("best_metric");
  c.early_stopping_patience = t.get_int("early_stopping_patience");
  c.early_stopping_threshold = t.get_float("early_stopping_threshold");
  c.recompute_every = recompute_every(train_section, diagnostics);
  c.threads = t.get_int("threads");
  c.lr = t.get_float("lr");
  c.warmup_steps = t.get_int("warmup_steps");
  c.warmup_ratio = t.get_float("warmup_ratio");
  c.scheduler = t.get_string("scheduler");
  c.min_lr_ratio = t.get_float("min_lr_ratio");
  c.cycles = t.get_int("cycles");
  c.decay_ratio = t.get_float("decay_ratio");
  c.decay_shape = t.get_string("decay_shape");
  c.optimizer = t.get_string("optimizer");
  c.weight_decay = t.get_float("weight_decay");
  c.adam_beta1 = t.get_float("adam_beta1");
  c.adam_beta2 = t.get_float("adam_beta2");
  c.adam_epsilon = t.get_float("adam_epsilon");
  c.momentum = t.get_float("momentum");
  c.nesterov = t.get_bool("nesterov");
  c.max_grad_norm = t.get_float("max_grad_norm");

  const auto& d = spec.section("data").options;
  if (d.has("train")) {
    const auto& train = d.get("train");
    if (const auto* one = std::get_if<std::string>(&train)) c.train_files = {*one};
    else for (const auto& f : std::get<StringList>(train)) c.train_files.emplace_back(f);
    if (c.train_files.empty()) diagnostics.add(spec.section("data").location_of("train"), "[data] train: an empty list; name one file or more");
    else c.train_file = c.train_files.front();
  }
  if (d.has("weights")) {
    c.train_weights = d.get_int_list("weights");
    const auto where = spec.section("data").location_of("weights");
    if (c.train_weights.size() != c.train_files.size())
      diagnostics.add(where, "[data] weights has " + std::to_string(c.train_weights.size()) + " entries for " + std::to_string(c.train_files.size()) +
                                 " train files; give one a file");
    else if (std::any_of(c.train_weights.begin(), c.train_weights.end(), [](std::int64_t w) { return w < 1 || w > 1000000; }))
      diagnostics.add(where, "[data] weights are whole numbers from 1 to 1000000 (each file's share of an epoch's samples)");
  }
  if (d.has("eval")) c.eval_file = d.get_string("eval");
  c.eval_split = d.get_float("eval_split");
  if (c.eval_split > 0 && c.eval_file)
    diagnostics.add(spec.section("data").location_of("eval_split"), "[data] eval_split and eval both give the evaluation data; keep one");
  if (c.eval_split >= 1 && c.train_files.size() > 1)
    diagnostics.add(spec.section("data").location_of("eval_split"),
                    "[data] eval_split with several train files is a fraction below 1 (held out of each file), not a count");
  else if (c.eval_split >= 1 && c.eval_split != std::floor(c.eval_split))
    diagnostics.add(spec.section("data").location_of("eval_split"),
                    "[data] eval_split is a whole number of records (from 1) or a fraction of them (below 1), not " + std::to_string(c.eval_split));
  c.format = d.get_string("format");
  c.chat_template = d.get_string("chat_template");
  if (d.has("chat_template_file")) c.chat_template_file = d.get_string("chat_template_file");
  if (d.has("template_variables")) c.template_variables = d.get_string_map("template_variables");
  c.skip_bad_lines = d.get_string("on_bad_line") == "skip";
  c.shuffle = d.get_bool("shuffle");
  c.packing = d.get_bool("packing");
  c.packer = d.get_string("packer");
  c.collate.max_length = d.get_int("max_length");
  const auto& trunc = d.get_string("truncation");
  c.collate.truncation = trunc == "left" ? Truncation::kLeft : trunc == "drop" ? Truncation::kDrop : Truncation::kRight;

  const auto adapter = spec.sections.find("adapter");
  c.merge_adapter = adapter != spec.sections.end() && adapter->second.options.has("merge") && adapter->second.options.get_bool("merge");
  if (adapter != spec.sections.end() && adapter->second.options.has("start_from")) c.adapter_start = adapter->second.options.get_string("start_from");
  check_train_keys_apply(train_section, c, diagnostics);
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
