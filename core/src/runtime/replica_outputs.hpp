#pragma once
// What the ranks of one model replica write together: the adapter as one folder and the model as
// an HF folder, whichever pipeline ranks hold their parts. Data replica 0 writes; the others hold
// the same weights and write nothing.
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "loom/adapter.hpp"
#include "loom/communicator.hpp"
#include "loom/model.hpp"

namespace loom::core {

// Each rank's `values` summed over `group` (one collective on `device`, one host sync).
std::vector<double> sum_over(Communicator& group, std::vector<double> values, c10::Device device);
// The same with another reduction (the fewest, the most).
std::vector<double> reduce_over(Communicator& group, std::vector<double> values, c10::Device device, ReduceOp op);

class ReplicaOutputs {
 public:
  // `pipelined`: the replica's blocks are spread over its pipeline ranks; collectives run on
  // `device` (the rank's GPU under NCCL, else the CPU).
  ReplicaOutputs(Parallel& parallel, bool pipelined, c10::Device device) : parallel_(parallel), pipelined_(pipelined), device_(device) {}

  // The base model as the pipeline names it ([model] path: a folder or a hub id, and its revision),
  // for adapter_config.json's base_model_name_or_path and revision, which PEFT reads.
  void name_base(std::string name_or_path, std::string revision) {
    base_name_ = std::move(name_or_path);
    base_revision_ = std::move(revision);
  }
  // One PEFT folder of every rank's adapter tensors (the first of a name wins).
  void save_adapter(const Adapter& adapter, LoadedModel& model, const std::filesystem::path& dir);
  // One file in one process; with pipeline ranks one shard per rank
  // (model-0000K-of-0000N.safetensors) and model.safetensors.index.json, a tied copy kept once.
  void save_model(LoadedModel& model, const std::filesystem::path& dir);

 private:
  void together(Communicator& group, const std::string& what, const std::function<void()>& part);
  std::vector<std::pair<std::string, at::Tensor>> gather(std::vector<std::pair<std::string, at::Tensor>> tensors, const std::filesystem::path& dir);

  Parallel& parallel_;
  bool pipelined_;
  c10::Device device_;
  std::string base_name_, base_revision_;
};

}  // namespace loom::core
