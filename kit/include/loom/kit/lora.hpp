#pragma once
// LoRA (Hu et al. 2021) with PEFT's semantics and file format: the adapter behind the `lora`
// plugin, and the base of any adapter that adds to it (the `qlora` plugin stores the frozen base
// 4-bit and is otherwise this). PEFT's key names and adapter_config.json, its initialisation (A
// Kaiming-uniform, B zero), its target matching; under tensor parallelism Megatron's split.
#include <memory>
#include <string>
#include <vector>

#include "loom/adapter.hpp"
#include "loom/options.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// r, alpha, dropout, target_modules, rslora, modules_to_save, bias.
LOOM_API std::vector<OptionSpec> lora_options();

class LOOM_API LoraAdapter : public Adapter, public ExpertAdapterSizing {
 public:
  // `options` holds lora_options()' keys (validated).
  explicit LoraAdapter(const Options& options);
  ~LoraAdapter() override;

  std::vector<std::uint64_t> trainable_parameters(const ModelStructure& model) const override;
  std::vector<NamedParameter> attach(LoadedModel& model, std::uint64_t seed) override;
  std::vector<NamedParameter> load(LoadedModel& model, const std::filesystem::path& dir) override;
  std::vector<std::pair<std::string, at::Tensor>> saved_tensors(LoadedModel& model) const override;
  void write(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::filesystem::path& dir) const override;
  void merge(LoadedModel& model) override;
  int shard_dim(LoadedModel& model, const std::string& name) const override;
  // target_parameters' A and B: E r (in + out) a weight.
  std::vector<std::uint64_t> expert_trainable_parameters(const ModelStructure& model, const std::vector<ExpertsInfo>& experts) const override;

  // Whether target_modules names linear `name` (an HF module name).
  bool adapts(const std::string& name) const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::kit
