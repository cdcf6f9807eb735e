#pragma once
// The trainer's parts that hold numbers across steps: the optimizer, the learning-rate schedule and
// fp16 loss scaling, each testable alone.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "config/run_config.hpp"
#include "loom/kit/memory.hpp"
#include "loom/model.hpp"

namespace loom::kit {
class SafetensorsFile;
}

namespace loom::core {

enum class OptimizerKind { kAdamW, kAdamW8bit, kLion, kAdafactor, kSgd };

// [train] optimizer's names ("adamw", "adamw_8bit", "lion", "adafactor", "sgd").
OptimizerKind parse_optimizer(const std::string& name);
const char* optimizer_name(OptimizerKind kind);

struct OptimizerSettings {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double weight_decay = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW's; Lion takes beta1 and beta2
  double momentum = 0.9;                                             // SGD
  bool nesterov = false;                                             // SGD
};

// The run's [train] optimizer keys.
OptimizerSettings optimizer_settings(const RunConfig& config);

// What `settings`' optimizer keeps per trainable value and needs while it steps, as the planner
// counts it (kit::count_optimizer_as).
kit::OptimizerMemory optimizer_memory(const OptimizerSettings& settings);

// The run's optimizer. Every kind keeps, for bf16/fp16 parameters, an fp32 master copy, so small
// updates are not lost to rounding, and its state in float32 (8-bit AdamW: blockwise-quantized
// codes), keyed by parameter name, so a checkpoint says which parameter each tensor belongs to.
//   adamw       decoupled weight decay, bias-corrected moments (Loshchilov & Hutter).
//   adamw_8bit  the same with both moments as 8-bit codes of bitsandbytes' dynamic maps (signed
//               for the first, unsigned for the second), one float32 absolute maximum a block of
//               256 values, updated in float32 and quantized back to the nearest code; tensors
//               under 4096 values keep float32 moments (bitsandbytes' min_8bit_size).
//   lion        sign of beta1 m + (1 - beta1) g, decoupled weight decay; m <- beta2 m + (1 - beta2) g
//               (Chen et al. 2023).
//   adafactor   transformers' Adafactor as its Trainer makes it (lr given: relative_step, scale_parameter
//               and warmup_init off; no first moment): factored second moments of matrices (row and
//               column means), decay 1 - t^-0.8, eps (1e-30, 1e-3), updates clipped to RMS 1,
//               weight decay w <- w - lr wd w.
//   sgd         torch.optim.SGD: L2 weight decay added to the gradient, momentum (no dampening),
//               optionally Nesterov's.
class Optimizer {
 public:
  Optimizer(std::vector<NamedParameter> params, OptimizerSettings settings);

  // One update at learning rate `lr` of every parameter that has a gradient. AdamW, Lion and SGD
  // run fused (foreach) kernels over slices of at most kit::kOptimizerSliceValues values per
  // device, instead of a handful of kernels per tensor (a LoRA run has hundreds), with float32
  // temporaries for one slice at a time; 8-bit AdamW updates its codes in place, one pass a tensor
  // (kit::adamw_8bit_step: a CUDA kernel, or a CPU loop); Adafactor goes one tensor at a time.
  void step(double lr);
  // The bytes of the state it holds beside the parameters and their gradients: moments,
  // statistics or codes, and the master copies (what the planner counts as optimizer state).
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
  const OptimizerSettings& settings() const { return s_; }
  std::int64_t steps_taken() const { return t_; }

  // "param/NAME" (the float32 weights) and each state tensor as "STATE/NAME" (AdamW: adam_m,
  // adam_v; 8-bit AdamW: adam8_m, adam8_m_absmax, adam8_v, adam8_v_absmax; Lion: lion_m;
  // Adafactor: adafactor_row and adafactor_col, or adafactor_v; SGD: momentum).
  void save(std::vector<std::pair<std::string, at::Tensor>>& out) const;
  // Reads what save() wrote; throws UserError naming the file and the parameter when one is
  // missing or shaped differently.
  void load(const kit::SafetensorsFile& file, std::int64_t steps);

 private:
  struct State {
    std::string kind;  // its name in a checkpoint
    at::Tensor tensor;
  };
  void step_foreach(double lr);
  void step_adamw_8bit(std::size_t i, double lr, double c1, double c2);
  void step_adafactor(std::size_t i, double lr);

  std::vector<NamedParameter> params_;
  OptimizerSettings s_;
  std::vector<std::vector<State>> state_;  // per parameter
  std::vector<at::Tensor> master_;
  std::int64_t t_ = 0;
  // What one set of foreach kernels updates: at most kit::kOptimizerSliceValues values of one
  // device's parameters.
  struct Batch {
    std::vector<at::Tensor> w, g;
    std::vector<std::vector<at::Tensor>> state;  // per state kind, each beside w
    std::vector<at::Tensor> low_precision;  // gradients not in float32, cast into g's slots
    std::vector<std::size_t> float_slots;   // where in g each of those goes
    std::int64_t low_precision_values = 0;
    std::vector<at::Tensor> params, masters;  // bf16/fp16 parameters fed from float32 masters
  };
  std::vector<Batch> prepared_;  // empty: not prepared (or nothing to update)
};

// The learning rate at a step (0-based) of `total`: linear warm-up to `peak` over the first
// `warmup` steps ((step + 1) / warmup of it: the first step learns), then, with progress p from 0
// at the end of warm-up to 1 at `total` and floor = min_ratio:
//   cosine                 floor + (1 - floor) (1 + cos(pi p)) / 2
//   linear                 floor + (1 - floor) (1 - p)
//   constant               1
//   cosine_with_restarts   cosine over each of `cycles` equal parts of p (hard restarts)
//   wsd                    1 until the last `decay_ratio` of the steps after warm-up, then down to
//                          the floor along decay_shape (cosine, linear or 1-sqrt)
// times `peak`; transformers' schedules of those names after warm-up (its warm-up starts at 0).
struct LearningRate {
  double peak = 2e-4;
  std::int64_t warmup = 0;
  std::string scheduler = "cosine";
  double min_ratio = 0;
  std::int64_t cycles = 1;
  double decay_ratio = 0.1;
  std::string decay_shape = "cosine";
  double at(std::int64_t step, std::int64_t total) const;
};
// The run's [train] schedule keys, warmup_ratio taken as ceil(ratio x total_steps) steps.
LearningRate learning_rate(const RunConfig& config, std::int64_t total_steps);

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
