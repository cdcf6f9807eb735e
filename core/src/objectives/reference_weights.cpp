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
  // Each tensor trades values with its starting copy, in place: one tensor's worth of scratch at a
  // time, and every module and the optimizer keep the very tensors they hold.
  const auto trade = [&] {
    for (std::size_t i = 0; i < live_.size(); ++i) {
      const at::Tensor scratch = live_[i].detach().clone();
      live_[i].detach().copy_(start_[i]);
      start_[i].copy_(scratch);
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
