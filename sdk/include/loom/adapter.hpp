#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "loom/capability.hpp"
#include "loom/export.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"

namespace loom {

// How an adapter stores the frozen base it trains on, for the planner.
struct BaseStorage {
  std::vector<std::uint64_t> weight_bytes;  // per block of the model, as stored; empty: as the model declares
  std::uint64_t transient_bytes = 0;        // the largest full-precision copy of a weight made at a time
};

class LOOM_API Adapter : public Plugin {
 public:
  ~Adapter() override;  // defined in the SDK library: one typeinfo for host and plugins
  // Trainable parameters the adapter adds to each block, in the order of model.blocks. Metadata
  // only, so a plan can count adapter weights, gradients and optimizer state before any weight
  // is loaded. Throws UserError when the adapter cannot apply (e.g. a target module the model lacks).
  virtual std::vector<std::uint64_t> trainable_parameters(const ModelStructure& model) const = 0;

  // Attaches fresh adapter weights to the model (on each target layer's device and dtype),
  // freezes the base, and returns the parameters to train, each with its saved name.
  virtual std::vector<NamedParameter> attach(LoadedModel& model, std::uint64_t seed) = 0;
  // Attaches weights read from an adapter folder this plugin (or its ecosystem peer) wrote.
  virtual std::vector<NamedParameter> load(LoadedModel& model, const std::filesystem::path& dir) = 0;
  // The attached weights this process holds, under the names an adapter folder stores them (a
  // pipeline's ranks each hold some; the host gathers them).
  virtual std::vector<std::pair<std::string, at::Tensor>> saved_tensors(LoadedModel& model) const = 0;
  // Writes an adapter folder of `tensors` (every rank's saved_tensors()), atomically per file.
  virtual void write(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::filesystem::path& dir) const = 0;
  // Both, for a process that holds every block.
  void save(LoadedModel& model, const std::filesystem::path& dir) const { write(saved_tensors(model), dir); }
  // Folds the attached weights into the base weights and detaches the adapter.
  virtual void merge(LoadedModel& model) = 0;
  // The dimension along which trainable parameter `name` (as attach() names it) is split over the
  // tensor group, -1 when every rank holds it whole (the default). Under tensor parallelism
  // saved_tensors() is called on every rank of the group and returns whole tensors.
  virtual int shard_dim(LoadedModel& model, const std::string& name) const;
};

// Capability of an Adapter that stores the frozen base itself (QLoRA's 4-bit base; see
// loom/capability.hpp). Without it the base is dense, as the model declares.
class LOOM_API BaseStoringAdapter : public Capability {
 public:
  ~BaseStoringAdapter() override;
  // The weight the model builds under linear `linear` instead of a dense one, with `options` (the
  // layer's dtype and device); null: dense. The model fills it through LinearWeight::assign()
  // while it loads, so a 4-bit base never exists in full precision whole.
  virtual std::shared_ptr<LinearWeight> base_weight(const LinearInfo& linear, const at::TensorOptions& options) const = 0;
  // The base's memory as this adapter stores it.
  virtual BaseStorage base_storage(const ModelStructure& model, DType dtype) const = 0;
};

// Capability of an Adapter that adapts stacked experts weights (SDK 3.10; loom/model.hpp's
// ExpertWeights): the trainable parameters it adds to each block for them, in the order of
// model.blocks, beside trainable_parameters' (the plan counts both). Throws UserError when what
// it targets names none of `experts`.
class LOOM_API ExpertAdapterSizing : public Capability {
 public:
  ~ExpertAdapterSizing() override;
  virtual std::vector<std::uint64_t> expert_trainable_parameters(const ModelStructure& model, const std::vector<ExpertsInfo>& experts) const = 0;
};

}  // namespace loom
