#pragma once
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "loom/adapter.hpp"
#include "loom/collator.hpp"
#include "loom/devices.hpp"
#include "loom/model.hpp"
#include "loom/objective.hpp"
#include "loom/reward.hpp"
#include "loom/placement.hpp"
#include "loom/tokenizer.hpp"
#include "config/diagnostics.hpp"
#include "config/run_config.hpp"
#include "config/pipeline.hpp"
#include "plugins/plugin_registry.hpp"

namespace loom::core {

class ChatTemplate;


// A validated pipeline with its plugin objects created. Plugin factories are cheap by contract
// (options and metadata only), so building a Session is still "before anything heavy".
struct Session {
  PipelineSpec spec;
  std::map<std::string, const LoadedPlugin*> plugins;  // section -> plugin that serves it
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Adapter> adapter;
  std::unique_ptr<Collator> collator;
  std::unique_ptr<Placement> placement;
  std::unique_ptr<Objective> objective;  // [objective], sft where the pipeline names none
  ObjectiveNeeds needs;                  // the objective's, read once
  std::shared_ptr<const ChatTemplate> chat;  // [data]'s chat template, under a chat format
  struct NamedReward {
    std::string name;  // [reward.NAME]
    double weight = 1;
    std::unique_ptr<Reward> reward;
  };
  std::vector<NamedReward> rewards;  // in the file's order
  RunConfig config;          // the spec's [run], [train] and [data], read and checked once
  ModelStructure structure;  // the model's block list, read once (weights as the adapter stores them)
  std::uint64_t base_transient_bytes = 0;  // the adapter's full-precision copy of a base weight at a time
  bool base_quantized = false;             // the adapter stores the base its own way (4-bit)
  std::string base_stored_by_adapter;      // which linears, for the plan: "224 of 225 linears (q_proj, ...)"
};

// What the adapter trains in each block of the session's model: its trainable_parameters, plus what
// it adds to the model's stacked experts where both offer it (ExpertStructure, ExpertAdapterSizing).
std::vector<std::uint64_t> adapter_trainable(const Model& model, const Adapter& adapter, const ModelStructure& structure);

// The folder the pipeline's [model] path names (a hub id's in the local cache), or "" without one;
// the [tokenizer] path's folder, else the model's.
std::filesystem::path model_folder_of(const Session& session);
std::filesystem::path tokenizer_folder_of(const Session& session);

// Creates every plugin the pipeline names and checks that they fit together (tokenizer ids fit
// the model's vocabulary, the adapter applies to the model). Throws PipelineError pointing at
// the section that is wrong. [run] dtype is chosen for `gpus` (choose_dtype): this machine's where null.
Session open_session(PipelineSpec spec, const PluginRegistry& registry, const GpuCapabilities* gpus = nullptr);

// What a training run would trip over before its first step, found without loading weights: the
// first records of the training data collated into at least one sample with labels, sequence
// lengths within the model's positions, CPU threads within the machine's cores. Throws
// PipelineError pointing at the keys to change.
void check_inputs(const Session& session);

// What any command that computes (run, generate) would trip over on this machine: fp16 without a
// CUDA device, more [train] threads than cores. Throws PipelineError; the first form adds to `d`.
void check_machine(const Session& session);
void check_machine(const Session& session, Diagnostics& d);

}  // namespace loom::core
