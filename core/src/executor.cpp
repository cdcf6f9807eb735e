#include "executor.hpp"

#include <algorithm>

#include <ATen/ATen.h>

#include "loom/devices.hpp"

namespace loom::core {

c10::Device torch_device(const std::string& name) {
  const DeviceName d = parse_device(name);
  return d.is_cuda ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(d.index)) : c10::Device(c10::kCPU);
}

Executor::Executor(std::unique_ptr<LoadedModel> model, std::vector<std::optional<c10::Device>> devices, bool check_devices,
                   std::vector<std::string> block_names)
    : model_(std::move(model)), blocks_(std::move(devices)), check_devices_(check_devices), names_(std::move(block_names)) {
  if (blocks_.size() != model_->block_count())
    throw std::logic_error("executor: " + std::to_string(blocks_.size()) + " devices for " + std::to_string(model_->block_count()) + " blocks");
  for (const auto& d : blocks_)
    if (d) {
      if (std::find(distinct_.begin(), distinct_.end(), *d) == distinct_.end()) distinct_.push_back(*d);
      head_ = *d;
    }
  for (const auto& p : model_->parameters())
    if (p.block >= blocks_.size() || !blocks_[p.block] || p.tensor.device() != *blocks_[p.block])
      throw std::logic_error("model plugin bug: parameter " + p.name + " is on " + p.tensor.device().str() + ", its block's device is " +
                             (p.block < blocks_.size() && blocks_[p.block] ? blocks_[p.block]->str() : "none on this rank"));
}

at::Tensor Executor::forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, KVCache* cache) {
  ForwardState state{ids, positions, mask, cache, {}};
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    if (!blocks_[i]) continue;
    const auto& device = *blocks_[i];
    if (state.hidden.device() != device) {
      state.hidden = state.hidden.to(device);
      state.position_ids = state.position_ids.to(device);
      state.attention_mask = state.attention_mask.to(device);
      for (auto& [name, t] : state.pass)
        if (t.defined()) t = t.to(device);
    }
    model_->forward(i, state);
    if (check_devices_ && state.hidden.device() != device)
      throw std::logic_error("check_devices: block " + (i < names_.size() ? names_[i] : std::to_string(i)) + " returned its output on " +
                             state.hidden.device().str() + ", not on its device " + device.str() + " (model plugin bug)");
  }
  return state.hidden;
}

std::unique_ptr<Executor> load_executor(const Model& model, const Plan& plan, DType dtype, std::uint64_t seed, bool check_devices,
                                        int replica_rank, Parallel* parallel) {
  LoadRequest request;
  std::vector<std::string> names;
  for (const auto& b : plan.blocks) {
    request.block_devices.push_back(b.rank == replica_rank ? std::optional<c10::Device>(torch_device(b.device)) : std::nullopt);
    names.push_back(b.block);
  }
  request.dtype = dtype;
  request.seed = seed;
  request.parallel = parallel;
  auto devices = request.block_devices;
  return std::make_unique<Executor>(model.load(request), std::move(devices), check_devices, std::move(names));
}

}  // namespace loom::core
