#pragma once
// The reference model of an objective that needs one (loom/objective.hpp): the model as the run
// started. Only the trainable tensors ever change, so a copy of their starting values is all it
// keeps (an adapter's size; a full fine-tune's trainable weights, which the planner counts), and a
// reference pass trades them in and back.
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/model.hpp"

namespace loom::core {

class StartingWeights {
 public:
  // Copies the current values of `trainable` (before a resumed run restores its checkpoint).
  explicit StartingWeights(const std::vector<NamedParameter>& trainable);
  // Runs `body` with every trainable tensor holding its starting values, then their current ones again.
  void with_start_values(const std::function<void()>& body) const;

 private:
  std::vector<at::Tensor> live_, start_;
};

}  // namespace loom::core
