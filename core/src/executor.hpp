#pragma once
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/model.hpp"
#include "loom/placement.hpp"

namespace loom::core {

// Runs a loaded model block by block on the devices of its plan. Activations cross devices only
// here, at block boundaries; position ids and the attention mask travel with them.
class Executor {
 public:
  // Checks that every parameter sits on its block's device; with `check_devices`, forward() also
  // checks each block's output.
  Executor(std::unique_ptr<LoadedModel> model, std::vector<c10::Device> devices, bool check_devices = false,
           std::vector<std::string> block_names = {});

  // ids [B, T], positions [B, T], mask [B, S] on any device. Returns logits [B, T, V] on the
  // head's device.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, KVCache* cache = nullptr);

  LoadedModel& model() { return *model_; }
  const std::vector<c10::Device>& devices() const { return devices_; }
  const c10::Device& head_device() const { return devices_.back(); }

 private:
  std::unique_ptr<LoadedModel> model_;
  std::vector<c10::Device> devices_;
  bool check_devices_;
  std::vector<std::string> names_;  // for messages; "block N" when empty
};

c10::Device torch_device(const std::string& name);  // "cpu", "cuda:N"

// Loads the session's model onto the plan's devices.
std::unique_ptr<Executor> load_executor(const Model& model, const Plan& plan, DType dtype, std::uint64_t seed, bool check_devices = false);

}  // namespace loom::core
