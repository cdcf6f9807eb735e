#pragma once
// The trainer's parts that hold numbers across steps: AdamW, the learning-rate schedule and fp16
// loss scaling, each testable alone.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/kit/memory.hpp"
#include "loom/model.hpp"

namespace loom::kit {
class SafetensorsFile;
}

namespace loom::core {

struct AdamWSettings {
  double weight_decay = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
};

// AdamW (decoupled weight decay, bias-corrected moments) with fp32 moments and, for bf16/fp16
// parameters, an fp32 master copy, so small updates are not lost to rounding. State is keyed by
// parameter name, so a checkpoint says which parameter each tensor belongs to.
class AdamW {
 public:
  AdamW(std::vector<NamedParameter> params, AdamWSettings settings);

  // One update at learning rate `lr` of every parameter that has a gradient: fused (foreach)
  // kernels over slices of at most kit::kOptimizerSliceValues values per device, instead of a handful of
  // kernels per tensor (a LoRA run has hundreds), and float32 temporaries for one slice at a time.
  void step(double lr);
  // The bytes of the state it holds beside the parameters and their gradients: the moments and
  // the master copies (what the planner counts as optimizer state).
  std::uint64_t state_bytes() const;
  // Builds the lists of tensors the next step() updates (without launching anything): the host
  // does this while the device still runs the backward pass, instead of after the step's last
  // sync, when the device would wait for it. step() prepares itself when this was not called; any
  // change to the gradients' tensors (zero_grad(), a new backward) needs a new prepare.
  void prepare_step();
  // The global L2 norm of all gradients, one host sync per device.
  double grad_norm() const;
  // The sum of squares of the gradients, leaving out parameter i where skip[i] (a copy another
  // rank counts), for a norm over several ranks.
  double grad_squares(const std::vector<bool>& skip = {}) const;
  // The same queued, not read: a float32 scalar per device (read_squares() sums them), so the
  // host can queue it before it waits for the step's loss.
  std::vector<at::Tensor> queue_grad_squares(const std::vector<bool>& skip = {}) const;
  static double read_squares(const std::vector<at::Tensor>& queued);
  // Multiplies every gradient by `factor` (unscaling, clipping).
  void scale_grads(double factor);
  void zero_grad();
  // The gradients of each device, for foreach kernels and collectives.
  std::map<std::string, std::vector<at::Tensor>> grads_by_device() const;

  std::vector<NamedParameter>& params() { return params_; }
  std::int64_t steps_taken() const { return t_; }

  // "param/NAME", "adam_m/NAME", "adam_v/NAME" for every parameter.
  void save(std::vector<std::pair<std::string, at::Tensor>>& out) const;
  // Reads what save() wrote; throws UserError naming the file and the parameter when one is
  // missing or shaped differently.
  void load(const kit::SafetensorsFile& file, std::int64_t steps);

 private:
  std::vector<NamedParameter> params_;
  AdamWSettings s_;
  std::vector<at::Tensor> m_, v_, master_;
  std::int64_t t_ = 0;
  // What one set of foreach kernels updates: at most kit::kOptimizerSliceValues values of one
  // device's parameters.
  struct Batch {
    std::vector<at::Tensor> w, g, m, v;
    std::vector<at::Tensor> low_precision;  // gradients not in float32, cast into g's slots
    std::vector<std::size_t> float_slots;   // where in g each of those goes
    std::int64_t low_precision_values = 0;
    std::vector<at::Tensor> params, masters;  // bf16/fp16 parameters fed from float32 masters
  };
  std::vector<Batch> prepared_;  // empty: not prepared (or nothing to update)
};

// The learning rate at a step: linear warm-up to `peak` over `warmup` steps, then cosine or linear
// decay to 0 at `total`, or constant.
struct LearningRate {
  double peak = 2e-4;
  std::int64_t warmup = 0;
  std::string scheduler = "cosine";  // cosine | linear | constant
  double at(std::int64_t step, std::int64_t total) const;
};

// fp16 loss scaling: start at 2^16, halve on overflow (the step is skipped), double after 2000
// good steps in a row. Disabled (scale 1) for other dtypes.
class LossScaler {
 public:
  explicit LossScaler(bool enabled) : scale_(enabled ? 65536.0 : 1.0), enabled_(enabled) {}
  double scale() const { return scale_; }
  bool enabled() const { return enabled_; }
  // After a step's gradients are checked: false when they overflowed (skip the step).
  bool update(bool finite);
  std::int64_t good_steps() const { return good_steps_; }
  void restore(double scale, std::int64_t good_steps) {
    scale_ = scale;
    good_steps_ = good_steps;
  }

 private:
  double scale_;
  bool enabled_;
  std::int64_t good_steps_ = 0;
};

}  // namespace loom::core
