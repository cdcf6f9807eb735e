#include "config/run_config.hpp"

#include <algorithm>

#include "loom/kit/json.hpp"
#include "loom/kit/kernels.hpp"

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

RunConfig read_run_config(const PipelineSpec& spec, Diagnostics& diagnostics) {
  RunConfig c;
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
  c.recompute_every = recompute_every(train_section, diagnostics);
  c.threads = t.get_int("threads");
  c.lr = t.get_float("lr");
  c.warmup_steps = t.get_int("warmup_steps");
  c.scheduler = t.get_string("scheduler");
  c.weight_decay = t.get_float("weight_decay");
  c.adam_beta1 = t.get_float("adam_beta1");
  c.adam_beta2 = t.get_float("adam_beta2");
  c.adam_epsilon = t.get_float("adam_epsilon");
  c.max_grad_norm = t.get_float("max_grad_norm");

  const auto& d = spec.section("data").options;
  if (d.has("train")) c.train_file = d.get_string("train");
  if (d.has("eval")) c.eval_file = d.get_string("eval");
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
  return c;
}

}  // namespace loom::core
