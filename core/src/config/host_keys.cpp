#include "config/host_keys.hpp"

#include <map>

#include "config/pipeline.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "loom/kit/json.hpp"

namespace loom::core {
namespace {

using Store = std::function<void(RunConfig&, const OptionValue&, const KeyPlace&)>;

// The value into a member of the same type.
template <class T>
Store into(T RunConfig::*member) {
  return [member](RunConfig& c, const OptionValue& v, const KeyPlace&) { c.*member = std::get<T>(v); };
}

// A [parallel] axis, and where it was set where the mesh's messages name it.
Store axis(int RunConfig::Parallelism::*size, Location RunConfig::Parallelism::*at) {
  return [size, at](RunConfig& c, const OptionValue& v, const KeyPlace& place) {
    c.parallel.*size = static_cast<int>(std::get<std::int64_t>(v));
    if (at != nullptr) c.parallel.*at = place.at;
  };
}

void store_dtype(RunConfig& c, const OptionValue& v, const KeyPlace&) {
  const auto& dtype = std::get<std::string>(v);
  c.dtype_auto = dtype == "auto";
  c.dtype = c.dtype_auto ? DType::kFloat32 : parse_dtype(dtype);  // auto: choose_dtype decides
}

void store_gpu_memory(RunConfig& c, const OptionValue& v, const KeyPlace& place) {
  try {
    c.gpu_memory = parse_bytes(std::get<std::string>(v));
    if (c.gpu_memory < (std::uint64_t{1} << 28)) throw UserError("less than 256 MiB leaves no room for a model");
  } catch (const UserError& e) {
    place.diagnostics.add(place.at, std::string("[run] gpu_memory: ") + e.what() + "; write e.g. \"15GiB\"");
  }
}

void store_train_files(RunConfig& c, const OptionValue& v, const KeyPlace& place) {
  if (const auto* one = std::get_if<std::string>(&v)) c.train_files = {*one};
  else for (const auto& f : std::get<StringList>(v)) c.train_files.emplace_back(f);
  if (c.train_files.empty()) place.diagnostics.add(place.at, "[data] train: an empty list; name one file or more");
  else c.train_file = c.train_files.front();
}

// [train] activation_checkpointing as "every Nth decoder layer" (1: every layer, 0: none).
void store_recompute_every(RunConfig& c, const OptionValue& v, const KeyPlace& place) {
  const auto& value = std::get<std::string>(v);
  c.recompute_every = 0;
  c.offload_checkpoints = false;
  if (value == "none") return;
  if (value == "every-layer" || value == "offload") {
    c.recompute_every = 1;
    c.offload_checkpoints = value == "offload";
    return;
  }
  const std::string prefix = "every-";
  if (value.size() > prefix.size() && value.size() <= prefix.size() + 6 && value.compare(0, prefix.size(), prefix) == 0 &&
      value.find_first_not_of("0123456789", prefix.size()) == std::string::npos) {
    const auto n = std::stoll(value.substr(prefix.size()));
    if (n >= 1) {
      c.recompute_every = n;
      return;
    }
  }
  place.diagnostics.add(place.at, "[train] activation_checkpointing = " + kit::json::quote(value, 40) +
                                      ": use \"none\", \"every-layer\", \"offload\" or \"every-N\" with N a whole number from 1 (e.g. \"every-2\")");
}

// Above 0: an update divides the first moment by sqrt(v) + epsilon, 0/0 where a gradient is 0.
void store_adam_epsilon(RunConfig& c, const OptionValue& v, const KeyPlace& place) {
  c.adam_epsilon = std::get<double>(v);
  if (!(c.adam_epsilon > 0))
    place.diagnostics.add(place.at, "[train] adam_epsilon = 0 must be above 0: the update divides by sqrt(v) + epsilon, which is 0/0 "
                                    "wherever a gradient is 0 (1e-8 is the usual value)");
}

}  // namespace

const std::vector<std::string>& host_sections() {
  static const std::vector<std::string> names{"run", "parallel", "data", "train", "plugins"};
  return names;
}

const std::vector<HostKey>& host_keys(const std::string& section) {
  static const std::map<std::string, std::vector<HostKey>> keys = {
      {"run",
      {
       {OptionSpec::string("output_dir", std::nullopt,
                            "where the run writes run.json, checkpoints and metrics (default runs/<pipeline name> in the current folder)")
             .path(),
        [](RunConfig& c, const OptionValue& v, const KeyPlace&) { c.output_dir = std::get<std::string>(v); }},
       {OptionSpec::integer("seed", 42, "seed for initialisation, shuffling and dropout").at_least(0),
        [](RunConfig& c, const OptionValue& v, const KeyPlace&) { c.seed = static_cast<std::uint64_t>(std::get<std::int64_t>(v)); }},
       {OptionSpec::string("dtype", "fp32", "compute and weight dtype; \"auto\": bf16 on GPUs of compute capability 8.0 on, fp16 on 7.x (T4, V100), fp32 without a GPU")
             .one_of({"fp32", "bf16", "fp16", "auto"}),
        store_dtype},
       {OptionSpec::string("gpu_memory", std::nullopt,
                            "the most this run uses of each GPU, e.g. \"15GiB\": the plan's capacity and LibTorch's allocator limit, to share a "
                            "GPU or to plan and run as on a smaller card (unset: what each GPU has free)"),
        store_gpu_memory},
       {OptionSpec::boolean("check_devices", false, "assert after every block that its output is on its device, naming the block otherwise"),
        into(&RunConfig::check_devices)},
       {OptionSpec::boolean("check_replicas", false,
                             "after every step, compare the copies of each trained weight that several ranks hold whole (data ranks; tensor ranks, "
                             "for what they do not split) and stop, naming the first that differs"),
        into(&RunConfig::check_replicas)},
       {OptionSpec::integer("check_replicas_every", 100,
                             "after step 1 and every this many steps, compare the tensor ranks' copies of each trained weight they all hold whole "
                             "(a model plugin must sum its gradient where each rank uses its part) and stop, naming the first that differs; 0: never "
                             "(check_replicas compares after every step)")
             .at_least(0),
        into(&RunConfig::check_replicas_every)},
       {OptionSpec::integer("timeout", 600, "seconds a rank waits for the others (rendezvous, a collective) before it stops, naming the rank it waited for")
             .at_least(1).at_most(86400),
        into(&RunConfig::timeout_s)}}},
      {"parallel",
      {
       {OptionSpec::integer("data", 0, "data-parallel ranks; 0: every process not used by the pipeline and tensor axes").at_least(0).at_most(1 << 16),
        axis(&RunConfig::Parallelism::data, &RunConfig::Parallelism::data_at)},
       {OptionSpec::integer("pipeline", 1, "pipeline-parallel ranks per model replica").at_least(1).at_most(1 << 10),
        axis(&RunConfig::Parallelism::pipeline, nullptr)},
       {OptionSpec::integer("tensor", 1, "tensor-parallel ranks per pipeline stage").at_least(1).at_most(1 << 10),
        axis(&RunConfig::Parallelism::tensor, &RunConfig::Parallelism::tensor_at)},
       {OptionSpec::integer("expert", 1,
                             "expert-parallel ranks: this many data ranks share out each mixture-of-experts layer's experts, each token's rows "
                             "sent to its experts' rank and back (all-to-all); divides data and the experts")
             .at_least(1).at_most(1 << 10),
        axis(&RunConfig::Parallelism::expert, &RunConfig::Parallelism::expert_at)}}},
      {"data",
      {
       {OptionSpec::any_of("train", kString | kStringList, std::nullopt,
                            "training data: JSON lines, a JSON array of records, CSV/TSV with a header row (.csv, .tsv), Parquet (.parquet), "
                            "Arrow IPC (.arrow) or a datasets save_to_disk folder; a list of files trains on all of them, mixed by `weights`")
             .require()
             .path(),
        store_train_files},
       {OptionSpec::any_of("weights", kIntList, std::nullopt,
                            "with several train files, each one's share of an epoch's samples (e.g. [3, 1]: three quarters from the first, "
                            "repeated or drawn with [run] seed); none: every sample of every file once"),
        into(&RunConfig::train_weights)},
       {OptionSpec::string("eval", std::nullopt, "evaluation data, in any of train's forms").path(),
        [](RunConfig& c, const OptionValue& v, const KeyPlace&) { c.eval_file = std::get<std::string>(v); }},
       {OptionSpec::real("eval_split", 0.0,
                          "instead of `eval`: hold out this many training records (a whole number from 1) or this fraction of them (below 1), "
                          "drawn with [run] seed")
             .at_least(0),
        into(&RunConfig::eval_split)},
       {OptionSpec::string("format", "{text}",
                            "template over each record's fields, e.g. \"### PROMPT: {instruction}\\n### OUTPUT: {output}\"; or a chat format, "
                            "rendered with the model's chat template and trained on the assistant's turns: \"messages\", \"sharegpt\", \"alpaca\""),
        into(&RunConfig::format)},
       {OptionSpec::string("chat_template", "", "chat formats: the tokenizer's template of this name (\"\": its default)"),
        into(&RunConfig::chat_template)},
       {OptionSpec::string("chat_template_file", std::nullopt, "chat formats: a Jinja template file to use instead of the tokenizer's").path(),
        [](RunConfig& c, const OptionValue& v, const KeyPlace&) { c.chat_template_file = std::get<std::string>(v); }},
       {OptionSpec::string_map("template_variables", "chat formats: more variables the template sees, e.g. { date_string = \"26 Jul 2024\" }"),
        [](RunConfig& c, const OptionValue& v, const KeyPlace&) { const auto& m = std::get<StringMap>(v); c.template_variables = {m.begin(), m.end()}; }},
       {OptionSpec::integer("max_length", 1024, "longest sample in tokens (longer ones are truncated or dropped)").at_least(1).at_most(1 << 20),
        [](RunConfig& c, const OptionValue& v, const KeyPlace&) { c.collate.max_length = std::get<std::int64_t>(v); }},
       {OptionSpec::string("truncation", "right", "a longer sample: cut its \"right\" end, its \"left\" start, or \"drop\" it (counted)")
             .one_of({"right", "left", "drop"}),
        [](RunConfig& c, const OptionValue& v, const KeyPlace&) { const auto& t = std::get<std::string>(v); c.collate.truncation = t == "left" ? Truncation::kLeft : t == "drop" ? Truncation::kDrop : Truncation::kRight; }},
       {OptionSpec::string("on_bad_line", "error", "a line that is not a JSON object with the format's fields: \"error\" (file:line) or \"skip\" (counted)")
             .one_of({"error", "skip"}),
        [](RunConfig& c, const OptionValue& v, const KeyPlace&) { c.skip_bad_lines = std::get<std::string>(v) == "skip"; }},
       {OptionSpec::boolean("shuffle", true, "shuffle the training samples every epoch, with the run seed"),
        into(&RunConfig::shuffle)},
       {OptionSpec::boolean("packing", false,
                             "lay each micro-batch's samples end to end in rows of max_length tokens, attention kept within each sample, "
                             "instead of padding each to the longest"),
        into(&RunConfig::packing)},
       {OptionSpec::string("packer", "first_fit_decreasing", "packing: \"first_fit_decreasing\" (the fewest rows) or \"greedy\" (in the drawn order)")
             .one_of({"first_fit_decreasing", "greedy"}),
        into(&RunConfig::packer)}}},
      {"train",
      {
       {OptionSpec::integer("batch_size", 1, "samples per micro-batch").at_least(1).at_most(1 << 16),
        into(&RunConfig::batch_size)},
       {OptionSpec::integer("grad_accum", 1, "micro-batches per optimizer step").at_least(1).at_most(1 << 16),
        into(&RunConfig::grad_accum)},
       {OptionSpec::real("lr", 2e-4, "peak learning rate").at_least(0).at_most(1),
        into(&RunConfig::lr)},
       {OptionSpec::integer("warmup_steps", 0, "steps of linear warm-up").at_least(0),
        into(&RunConfig::warmup_steps)},
       {OptionSpec::real("warmup_ratio", 0.0, "warm-up as a fraction of the run's steps (rounded up), instead of warmup_steps").at_least(0).at_most(0.999),
        into(&RunConfig::warmup_ratio)},
       {OptionSpec::integer("max_steps", 0, "optimizer steps to run; 0: as many as `epochs` take").at_least(0),
        into(&RunConfig::max_steps)},
       {OptionSpec::integer("epochs", 1, "passes over the training data when max_steps is 0").at_least(1),
        into(&RunConfig::epochs)},
       {OptionSpec::string("scheduler", "cosine",
                            "learning rate after warm-up: \"cosine\", \"linear\", \"constant\", \"cosine_with_restarts\" (`cycles` cosines), "
                            "\"wsd\" (warm-up, stable, then decay over the last `decay_ratio`)")
             .one_of({"cosine", "linear", "constant", "cosine_with_restarts", "wsd"}),
        into(&RunConfig::scheduler)},
       {OptionSpec::real("min_lr_ratio", 0.0, "the decaying schedules end at this fraction of lr instead of 0").at_least(0).at_most(1),
        into(&RunConfig::min_lr_ratio)},
       {OptionSpec::integer("cycles", 1, "cosine_with_restarts: cosines over the steps after warm-up, each from lr down").at_least(1).at_most(1 << 20),
        into(&RunConfig::cycles)},
       {OptionSpec::real("decay_ratio", 0.1, "wsd: the fraction of the steps after warm-up that decay").at_least(0).at_most(1),
        into(&RunConfig::decay_ratio)},
       {OptionSpec::string("decay_shape", "cosine", "wsd: the decay's shape").one_of({"cosine", "linear", "1-sqrt"}),
        into(&RunConfig::decay_shape)},
       {OptionSpec::string("optimizer", "adamw",
                            "\"adamw\", \"adamw_8bit\" (moments as blockwise 8-bit codes, bitsandbytes' semantics), \"lion\", "
                            "\"adafactor\" (factored second moments, transformers' Trainer semantics) or \"sgd\" (docs/training.md)")
             .one_of({"adamw", "adamw_8bit", "lion", "adafactor", "sgd"}),
        into(&RunConfig::optimizer)},
       {OptionSpec::real("weight_decay", 0.0, "weight decay: decoupled (AdamW, Lion, Adafactor), added to the gradient (SGD)").at_least(0),
        into(&RunConfig::weight_decay)},
       {OptionSpec::real("adam_beta1", 0.9, "AdamW's and Lion's beta1").at_least(0).at_most(0.9999),
        into(&RunConfig::adam_beta1)},
       {OptionSpec::real("adam_beta2", 0.999, "AdamW's and Lion's beta2 (Lion's authors suggest 0.99)").at_least(0).at_most(0.99999),
        into(&RunConfig::adam_beta2)},
       {OptionSpec::real("adam_epsilon", 1e-8, "AdamW's epsilon (also adamw_8bit's): added to the root of the second moment; above 0").at_least(0),
        store_adam_epsilon},
       {OptionSpec::real("momentum", 0.9, "SGD's momentum (0: plain SGD)").at_least(0).at_most(0.9999),
        into(&RunConfig::momentum)},
       {OptionSpec::boolean("nesterov", false, "SGD: Nesterov momentum"),
        into(&RunConfig::nesterov)},
       {OptionSpec::real("max_grad_norm", 1.0, "clip the global gradient norm to this; 0 disables").at_least(0),
        into(&RunConfig::max_grad_norm)},
       {OptionSpec::integer("log_every", 10, "steps between progress lines and metrics.jsonl rows").at_least(1),
        into(&RunConfig::log_every)},
       {OptionSpec::integer("eval_every", 0, "steps between evaluations on [data] eval; 0: only at the end").at_least(0),
        into(&RunConfig::eval_every)},
       {OptionSpec::integer("eval_samples", 0, "the first this many eval samples for loss and greedy exact-match; 0: all of them (as transformers evaluates)").at_least(0),
        into(&RunConfig::eval_samples)},
       {OptionSpec::integer("max_new_tokens", 32, "longest answer generated for exact-match (chat data: the end-of-turn marker beyond it)").at_least(1).at_most(1 << 16),
        into(&RunConfig::max_new_tokens)},
       {OptionSpec::integer("checkpoint_every", 0, "steps between checkpoints (adapter, optimizer, scheduler, data cursor, RNG); 0: none")
             .at_least(0),
        into(&RunConfig::checkpoint_every)},
       {OptionSpec::integer("keep_checkpoints", 0, "keep only the newest N checkpoints (and the best one); 0: all").at_least(0).at_most(1 << 20),
        into(&RunConfig::keep_checkpoints)},
       {OptionSpec::string("best_metric", "",
                            "\"eval_loss\" or \"exact_match\": keep the checkpoint evaluated best, and end the run with its weights "
                            "(needs [data] eval and checkpoint_every a multiple of eval_every); \"\": the last weights")
             .one_of({"", "eval_loss", "exact_match"}),
        into(&RunConfig::best_metric)},
       {OptionSpec::integer("early_stopping_patience", 0, "stop after this many evaluations in a row without best_metric improving; 0: never")
             .at_least(0).at_most(1 << 20),
        into(&RunConfig::early_stopping_patience)},
       {OptionSpec::real("early_stopping_threshold", 0.0, "the least change of best_metric that counts as improving").at_least(0),
        into(&RunConfig::early_stopping_threshold)},
       {OptionSpec::string("activation_checkpointing", "none",
                            "recompute decoder layers' activations in backward instead of keeping them: \"none\", \"every-layer\", "
                            "\"every-N\" (every Nth layer, e.g. \"every-2\"), or \"offload\" (every layer, its input kept in host "
                            "memory until backward)"),
        store_recompute_every},
       {OptionSpec::integer("threads", 0, "CPU threads for LibTorch; 0: its default").at_least(0).at_most(1024),
        into(&RunConfig::threads)}}},
      {"plugins",
      {
       {OptionSpec::string_list("paths", StringList{}, "extra plugin folders").path(),
        nullptr},
       {OptionSpec::string_map("versions", "plugin versions the pipeline needs, by NAME or KIND/NAME: \"1.2.3\" (exactly), \"1.2\" or \"1\" (any version starting so)"),
        nullptr}}}
  };
  static const std::vector<HostKey> none;
  const auto it = keys.find(section);
  return it == keys.end() ? none : it->second;
}

const std::vector<OptionSpec>& host_section_schema(const std::string& section) {
  static const std::map<std::string, std::vector<OptionSpec>> schemas = [] {
    std::map<std::string, std::vector<OptionSpec>> out;
    for (const auto& name : host_sections())
      for (const auto& key : host_keys(name)) out[name].push_back(key.spec);
    return out;
  }();
  static const std::vector<OptionSpec> none;
  const auto it = schemas.find(section);
  return it == schemas.end() ? none : it->second;
}

}  // namespace loom::core
