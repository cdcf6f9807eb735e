#include "config/run_config.hpp"

#include "loom/kit/json.hpp"

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

RunConfig read_run_config(const PipelineSpec& spec, Diagnostics& diagnostics) {
  RunConfig c;
  const auto& run = spec.section("run").options;
  c.dtype = parse_dtype(run.get_string("dtype"));
  c.seed = static_cast<std::uint64_t>(run.get_int("seed"));
  c.output_dir = run.get_string("output_dir");
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
