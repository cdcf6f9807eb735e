#include "objectives/reference_weights.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace loom::core {

StartingWeights::StartingWeights(const std::vector<NamedParameter>& trainable) {
  torch::NoGradGuard no_grad;
  for (const auto& p : trainable) {
    live_.push_back(p.tensor);
    start_.push_back(p.tensor.detach().clone());
  }
}

void StartingWeights::with_start_values(const std::function<void()>& body) const {
  torch::NoGradGuard no_grad;
  // Each tensor trades values with its starting copy, in place, so every module and the optimizer
  // keep the very tensors they hold. The scratch of a trade, one buffer per dtype and device as
  // large as the largest tensor there, is allocated before anything is traded: a trade then
  // allocates nothing and cannot stop halfway (an out-of-memory leaves every value as it was).
  std::vector<at::Tensor> scratch;  // per dtype and device
  std::vector<std::size_t> slot(live_.size());
  for (std::size_t i = 0; i < live_.size(); ++i) {
    const at::Tensor& t = live_[i];
    std::size_t k = 0;
    while (k < scratch.size() && !(scratch[k].scalar_type() == t.scalar_type() && scratch[k].device() == t.device())) ++k;
    if (k == scratch.size()) scratch.push_back(at::Tensor());
    if (!scratch[k].defined() || scratch[k].numel() < t.numel()) scratch[k] = at::Tensor(t);  // the largest so far, a placeholder
    slot[i] = k;
  }
  for (auto& s : scratch) s = at::empty({s.numel()}, s.options());
  const auto trade = [&] {
    for (std::size_t i = 0; i < live_.size(); ++i) {
      at::Tensor held = scratch[slot[i]].narrow(0, 0, live_[i].numel()).view(live_[i].sizes());
      held.copy_(live_[i].detach());
      live_[i].detach().copy_(start_[i]);
      start_[i].copy_(held);
    }
  };
  trade();
  try {
    body();
  } catch (...) {
    trade();
    throw;
  }
  trade();
}

}  // namespace loom::core
