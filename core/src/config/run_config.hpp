#pragma once
// The pipeline's typed configuration: every [run], [train], [data] and [parallel] key the host reads, taken from
// the validated spec and checked once, when the session opens (open_session). The planner, the
// runtime and the commands read this, never the spec's options.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "loom/collator.hpp"
#include "loom/devices.hpp"
#include "config/diagnostics.hpp"
#include "config/pipeline.hpp"

namespace loom::core {

// GPUs' compute capabilities (major * 10 + minor) by device name ("cuda:0"); 0 where not known (a
// simulated GPU that `loom plan --devices` names without one).
using GpuCapabilities = std::map<std::string, int>;
// This machine's GPUs' compute capabilities, as loom chooses by them (LOOM_DEVICE_CAPABILITY).
GpuCapabilities detect_gpu_capabilities();

struct RunConfig {
  // [run]
  DType dtype = DType::kFloat32;
  bool dtype_auto = false;   // [run] dtype = "auto": `dtype` is the devices' choice (choose_dtype)
  std::string dtype_choice;  // what auto took and why, for the plan
  std::uint64_t gpu_memory = 0;  // [run] gpu_memory: the bytes a run may use of each GPU (0: all it has free)
  std::uint64_t seed = 0;
  std::filesystem::path output_dir;
  bool check_devices = false;
  bool check_replicas = false;
  std::int64_t check_replicas_every = 100;  // the tensor group's whole weights, after step 1 and every N (0: never)
  std::int64_t timeout_s = 0;
  // [train]
  std::int64_t batch_size = 1, grad_accum = 1, max_steps = 0, epochs = 0;
  std::int64_t log_every = 1, eval_every = 0, eval_samples = 0, max_new_tokens = 0;
  std::int64_t checkpoint_every = 0;  // steps between checkpoints (0: at the end only)
  std::int64_t keep_checkpoints = 0;  // the newest N checkpoints kept, and the best (0: all)
  std::string best_metric;            // "eval_loss", "exact_match" or "" (none)
  std::int64_t early_stopping_patience = 0;
  double early_stopping_threshold = 0;
  std::int64_t recompute_every = 0;   // activation_checkpointing: every Nth decoder layer recomputed (1: all; 0: none)
  bool offload_checkpoints = false;   // activation_checkpointing = "offload": every layer recomputed, its input kept in host memory
  std::int64_t threads = 0;
  double lr = 0, max_grad_norm = 0;
  std::int64_t warmup_steps = 0;
  double warmup_ratio = 0;  // of the run's steps, rounded up, when warmup_steps is not given
  std::string scheduler;
  double min_lr_ratio = 0, decay_ratio = 0;
  std::int64_t cycles = 1;
  std::string decay_shape;
  std::string optimizer;  // adamw | adamw_8bit | lion | adafactor | sgd
  double weight_decay = 0, adam_beta1 = 0, adam_beta2 = 0, adam_epsilon = 0, momentum = 0;
  bool nesterov = false;
  // [data]
  std::optional<std::filesystem::path> train_file, eval_file;  // train_file: the first of train_files
  std::vector<std::filesystem::path> train_files;               // [data] train: one file or several
  std::vector<std::int64_t> train_weights;                      // [data] weights: one per train file, or none
  double eval_split = 0;  // held out of the training records: a count from 1, or a fraction below 1 (0: none)
  bool has_eval() const { return eval_file.has_value() || eval_split > 0; }
  std::string format;
  std::string chat_template;                        // a named template of the tokenizer ("": its default)
  std::filesystem::path chat_template_file;         // a template file instead ("": none)
  std::map<std::string, std::string> template_variables;  // more variables every template render sees
  bool skip_bad_lines = false;  // on_bad_line = "skip"
  bool shuffle = true;
  bool packing = false;  // samples laid end to end in rows of collate.max_length (runtime/packing.hpp)
  std::string packer = "first_fit_decreasing";
  CollateSettings collate;
  // Each sample carries its record beside the rendered prompt (an objective of pairs or sampled
  // completions: config/data.hpp's sample_with_record); set by open_session from the objective.
  bool samples_with_records = false;
  // [adapter]
  bool merge_adapter = false;
  std::filesystem::path adapter_start;  // start_from: an adapter folder whose values training starts from ("": fresh)
  // [parallel], as asked (the mesh over a launch's processes: resolve_mesh), with where each was set.
  struct Parallelism {
    int data = 0;  // 0: every process the pipeline and tensor axes leave
    int pipeline = 1, tensor = 1;
    int expert = 1;  // data ranks sharing out each mixture-of-experts layer's experts
    Location where, data_at, tensor_at, expert_at;
    int replica() const { return pipeline * tensor; }  // ranks holding one copy of the model
  } parallel;
};

// Reads `spec` (validated: every key there with its type) into a RunConfig; a value its schema
// cannot judge alone (activation_checkpointing's form) adds a problem at its key to `diagnostics`.
// [run] dtype on these GPUs: "auto" takes bf16 where every GPU has compute capability 8.0 or more,
// fp16 where one has less (7.x has no bfloat16), fp32 without GPUs; an explicit "bf16" with a 7.x
// GPU is refused at the key, naming fp16.
void choose_dtype(RunConfig& config, const GpuCapabilities& gpus, const SectionSpec& run, Diagnostics& diagnostics);

RunConfig read_run_config(const PipelineSpec& spec, Diagnostics& diagnostics);

// A run's training and evaluation samples: [data] train, and [data] eval or the records
// eval_split holds out of train (split_off, with [run] seed).
struct RunData {
  Dataset train, eval;
};
RunData load_run_data(const RunConfig& config);

}  // namespace loom::core
