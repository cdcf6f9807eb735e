#include "runtime/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/placement.hpp"

namespace loom::core {

OptimizerKind parse_optimizer(const std::string& name) {
  for (const auto kind : {OptimizerKind::kAdamW, OptimizerKind::kAdamW8bit, OptimizerKind::kLion, OptimizerKind::kAdafactor, OptimizerKind::kSgd})
    if (name == optimizer_name(kind)) return kind;
  throw UserError("unknown optimizer \"" + name + "\"; use adamw, adamw_8bit, lion, adafactor or sgd");
}

const char* optimizer_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdamW8bit: return "adamw_8bit";
    case OptimizerKind::kLion: return "lion";
    case OptimizerKind::kAdafactor: return "adafactor";
    case OptimizerKind::kSgd: return "sgd";
  }
  return "?";
}

namespace {

// 8-bit AdamW's quantization: blocks of 256 values, tensors of fewer than 4096 values in float32
// (bitsandbytes' blockwise optimizers and min_8bit_size).
constexpr std::int64_t kQuantBlock = 256, kMin8bitValues = 4096;

bool quantized(const at::Tensor& p) { return p.numel() >= kMin8bitValues; }
std::int64_t blocks_of(std::int64_t values) { return (values + kQuantBlock - 1) / kQuantBlock; }

// What one update touches of a parameter: its float32 weights (the master copy, or the
// parameter itself), gradient and state, and the bf16/fp16 parameter the master copy feeds.
struct Piece {
  at::Tensor w, g;
  std::vector<at::Tensor> state;
  at::Tensor param;
};

// `t` as flat slices of at most `values` elements (itself when it is no larger, or not contiguous).
std::vector<at::Tensor> slices(const at::Tensor& t, std::int64_t values) {
  if (!t.defined() || t.numel() <= values || !t.is_contiguous()) return {t};
  std::vector<at::Tensor> out;
  const at::Tensor flat = t.view({-1});
  for (std::int64_t at = 0; at < flat.numel(); at += values) out.push_back(flat.narrow(0, at, std::min(values, flat.numel() - at)));
  return out;
}

bool foreach_kind(OptimizerKind kind) { return kind == OptimizerKind::kAdamW || kind == OptimizerKind::kLion || kind == OptimizerKind::kSgd; }

}  // namespace

OptimizerSettings optimizer_settings(const RunConfig& c) {
  OptimizerSettings s;
  s.kind = parse_optimizer(c.optimizer);
  s.weight_decay = c.weight_decay;
  s.beta1 = c.adam_beta1;
  s.beta2 = c.adam_beta2;
  s.eps = c.adam_epsilon;
  s.momentum = c.momentum;
  s.nesterov = c.nesterov;
  return s;
}

LearningRate learning_rate(const RunConfig& c, std::int64_t total_steps) {
  LearningRate lr;
  lr.peak = c.lr;
  lr.warmup = c.warmup_ratio > 0 ? static_cast<std::int64_t>(std::ceil(c.warmup_ratio * static_cast<double>(total_steps))) : c.warmup_steps;
  lr.scheduler = c.scheduler;
  lr.min_ratio = c.min_lr_ratio;
  lr.cycles = c.cycles;
  lr.decay_ratio = c.decay_ratio;
  lr.decay_shape = c.decay_shape;
  return lr;
}

kit::OptimizerMemory optimizer_memory(const OptimizerSettings& s) {
  switch (s.kind) {
    case OptimizerKind::kAdamW: return {8, 4, kit::kOptimizerSliceValues};
    // Two codes and their share of two absolute maxima; the step (kit::adamw_8bit_step) goes
    // through the codes in place, with no temporaries.
    case OptimizerKind::kAdamW8bit: return {2 + 8.0 / kQuantBlock, 0, kit::kOptimizerSliceValues};
    case OptimizerKind::kLion: return {4, 4, kit::kOptimizerSliceValues};
    // Four bytes a row and a column of each matrix: half a byte a value bounds a rank-8 LoRA
    // matrix's and is far above a model's own; the squared gradient, the update and the factors'
    // product of a whole tensor at once.
    case OptimizerKind::kAdafactor: return {0.5, 16, 0};
    // The momentum buffer; a decayed gradient and Nesterov's direction as temporaries.
    case OptimizerKind::kSgd:
      return {s.momentum > 0 ? 4.0 : 0.0, (s.weight_decay > 0 ? 4.0 : 0.0) + (s.nesterov ? 4.0 : 0.0), kit::kOptimizerSliceValues};
  }
  return {};
}

Optimizer::Optimizer(std::vector<NamedParameter> params, OptimizerSettings settings) : params_(std::move(params)), s_(settings) {
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    const auto f32 = p.tensor.options().dtype(at::kFloat);
    const auto like = [&] { return at::zeros_like(p.tensor, f32); };
    std::vector<State> state;
    switch (s_.kind) {
      case OptimizerKind::kAdamW: state = {{"adam_m", like()}, {"adam_v", like()}}; break;
      case OptimizerKind::kAdamW8bit:
        if (quantized(p.tensor)) {
          const std::int64_t blocks = blocks_of(p.tensor.numel());
          // Code 0 decodes to the map's lowest value; the zero code's index starts every moment at 0.
          const auto zero_code = [&](bool is_signed) {
            const auto& v = is_signed ? kit::dynamic_map_8bit() : kit::dynamic_map_8bit_unsigned();
            return static_cast<int>(std::find(v.begin(), v.end(), 0.0f) - v.begin());
          };
          state = {{"adam8_m", at::full({blocks * kQuantBlock}, zero_code(true), f32.dtype(at::kByte))},
                   {"adam8_m_absmax", at::zeros({blocks}, f32)},
                   {"adam8_v", at::full({blocks * kQuantBlock}, zero_code(false), f32.dtype(at::kByte))},
                   {"adam8_v_absmax", at::zeros({blocks}, f32)}};
        } else {
          state = {{"adam_m", like()}, {"adam_v", like()}};
        }
        break;
      case OptimizerKind::kLion: state = {{"lion_m", like()}}; break;
      case OptimizerKind::kAdafactor:
        if (p.tensor.dim() >= 2) {
          auto row = p.tensor.sizes().vec(), col = p.tensor.sizes().vec();
          row.pop_back();
          col.erase(col.end() - 2);
          state = {{"adafactor_row", at::zeros(row, f32)}, {"adafactor_col", at::zeros(col, f32)}};
        } else {
          state = {{"adafactor_v", like()}};
        }
        break;
      case OptimizerKind::kSgd:
        if (s_.momentum > 0) state = {{"momentum", like()}};
        break;
    }
    state_.push_back(std::move(state));
    master_.push_back(p.tensor.scalar_type() == at::kFloat ? at::Tensor() : p.tensor.detach().to(at::kFloat));
  }
}

void Optimizer::prepare_step() {
  torch::NoGradGuard no_grad;
  prepared_.clear();
  if (!foreach_kind(s_.kind)) return;
  // Per device, slices of at most kit::kOptimizerSliceValues values at a time: the float32 gradients
  // and temporaries of one slice are the step's only temporaries (the planner counts them), one
  // set of foreach kernels per slice instead of a handful per tensor.
  std::map<std::string, std::vector<Piece>> pieces;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].tensor;
    if (!p.grad().defined()) continue;
    const at::Tensor w = master_[i].defined() ? master_[i] : p;
    const bool whole = p.numel() <= kit::kOptimizerSliceValues || !(w.is_contiguous() && p.is_contiguous() && p.grad().is_contiguous());
    const std::int64_t values = whole ? p.numel() : kit::kOptimizerSliceValues;
    const auto ws = slices(w, values), gs = slices(p.grad(), values);
    std::vector<std::vector<at::Tensor>> ss;
    for (const auto& st : state_[i]) ss.push_back(slices(st.tensor, values));
    const auto ps = master_[i].defined() ? slices(p, values) : std::vector<at::Tensor>(ws.size());
    for (std::size_t k = 0; k < ws.size(); ++k) {
      Piece piece{ws[k], gs[k], {}, master_[i].defined() ? ps[k] : at::Tensor()};
      for (const auto& s : ss) piece.state.push_back(s[k]);
      pieces[p.device().str()].push_back(std::move(piece));
    }
  }
  for (const auto& [device, all] : pieces) {
    std::int64_t values = 0;
    prepared_.emplace_back();  // a device's own batches
    for (const auto& piece : all) {
      if (!prepared_.back().w.empty() && values + piece.w.numel() > kit::kOptimizerSliceValues) {
        prepared_.emplace_back();
        values = 0;
      }
      Batch& b = prepared_.back();
      b.w.push_back(piece.w);
      // Gradients not in float32 are cast together in step(): a foreach kernel, not one per tensor.
      if (piece.g.scalar_type() == at::kFloat) {
        b.g.push_back(piece.g);
      } else {
        b.float_slots.push_back(b.g.size());
        b.g.emplace_back();
        b.low_precision.push_back(piece.g);
        b.low_precision_values += piece.g.numel();
      }
      b.state.resize(piece.state.size());
      for (std::size_t k = 0; k < piece.state.size(); ++k) b.state[k].push_back(piece.state[k]);
      if (piece.param.defined()) {
        b.params.push_back(piece.param);
        b.masters.push_back(piece.w);
      }
      values += piece.w.numel();
    }
  }
}

void Optimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ++t_;
  if (foreach_kind(s_.kind)) {
    step_foreach(lr);
    return;
  }
  const double c1 = 1 - std::pow(s_.beta1, static_cast<double>(t_)), c2 = 1 - std::pow(s_.beta2, static_cast<double>(t_));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].tensor.grad().defined()) continue;
    if (s_.kind == OptimizerKind::kAdafactor) step_adafactor(i, lr);
    else step_adamw_8bit(i, lr, c1, c2);
    if (master_[i].defined()) params_[i].tensor.copy_(master_[i]);
  }
  prepared_.clear();
}

void Optimizer::step_foreach(double lr) {
  if (prepared_.empty()) prepare_step();
  const double c1 = 1 - std::pow(s_.beta1, static_cast<double>(t_)), c2 = 1 - std::pow(s_.beta2, static_cast<double>(t_));
  for (Batch& b : prepared_) {
    // The batch's float32 gradients as views of one buffer: one allocation, not one a tensor.
    std::vector<at::Tensor> as_float;
    if (!b.low_precision.empty()) {
      const at::Tensor buffer = at::empty({b.low_precision_values}, b.low_precision.front().options().dtype(at::kFloat));
      std::int64_t at = 0;
      for (std::size_t k = 0; k < b.low_precision.size(); ++k) {
        const at::Tensor& low = b.low_precision[k];
        as_float.push_back(buffer.narrow(0, at, low.numel()).view(low.sizes()));
        b.g[b.float_slots[k]] = as_float.back();
        at += low.numel();
      }
    }
    kit::compat::foreach_copy(as_float, b.low_precision);
    switch (s_.kind) {
      case OptimizerKind::kAdamW: {
        auto& m = b.state[0];
        auto& v = b.state[1];
        if (s_.weight_decay > 0) at::_foreach_mul_(b.w, 1 - lr * s_.weight_decay);
        at::_foreach_mul_(m, s_.beta1);
        at::_foreach_add_(m, b.g, 1 - s_.beta1);
        at::_foreach_mul_(v, s_.beta2);
        at::_foreach_addcmul_(v, b.g, b.g, 1 - s_.beta2);
        auto denom = at::_foreach_div(v, c2);
        at::_foreach_sqrt_(denom);
        at::_foreach_add_(denom, s_.eps);
        at::_foreach_addcdiv_(b.w, m, denom, -lr / c1);
        break;
      }
      case OptimizerKind::kLion: {
        auto& m = b.state[0];
        if (s_.weight_decay > 0) at::_foreach_mul_(b.w, 1 - lr * s_.weight_decay);
        auto direction = at::_foreach_mul(m, s_.beta1);
        at::_foreach_add_(direction, b.g, 1 - s_.beta1);
        for (auto& d : direction) d.sign_();
        at::_foreach_add_(b.w, direction, -lr);
        at::_foreach_mul_(m, s_.beta2);
        at::_foreach_add_(m, b.g, 1 - s_.beta2);
        break;
      }
      case OptimizerKind::kSgd: {
        // torch.optim.SGD: g + wd w; buf <- momentum buf + g (the first step's buf is g, as from 0);
        // Nesterov's steps along g + momentum buf.
        if (s_.weight_decay > 0) {
          // A float32 gradient is the parameter's own: the decayed one is a temporary.
          b.g = at::_foreach_add(b.g, b.w, s_.weight_decay);
        }
        if (s_.momentum <= 0) {
          at::_foreach_add_(b.w, b.g, -lr);
          break;
        }
        auto& buf = b.state[0];
        at::_foreach_mul_(buf, s_.momentum);
        at::_foreach_add_(buf, b.g);
        if (s_.nesterov) {
          auto direction = at::_foreach_mul(buf, s_.momentum);
          at::_foreach_add_(direction, b.g);
          at::_foreach_add_(b.w, direction, -lr);
        } else {
          at::_foreach_add_(b.w, buf, -lr);
        }
        break;
      }
      default: throw std::logic_error("not a foreach optimizer");
    }
    kit::compat::foreach_copy(b.params, b.masters);
  }
  prepared_.clear();  // the lists hold this step's gradients
}

void Optimizer::step_adamw_8bit(std::size_t i, double lr, double c1, double c2) {
  const at::Tensor& p = params_[i].tensor;
  const at::Tensor w = master_[i].defined() ? master_[i] : p;
  auto& state = state_[i];
  if (!quantized(p)) {  // float32 moments, as adamw
    const at::Tensor g = p.grad().to(at::kFloat);
    at::Tensor &m = state[0].tensor, &v = state[1].tensor;
    if (s_.weight_decay > 0) w.mul_(1 - lr * s_.weight_decay);
    m.mul_(s_.beta1).add_(g, 1 - s_.beta1);
    v.mul_(s_.beta2).addcmul_(g, g, 1 - s_.beta2);
    w.addcdiv_(m, (v / c2).sqrt_().add_(s_.eps), -lr / c1);
    return;
  }
  // Strided weights are updated through a contiguous copy, copied back.
  const at::Tensor dense = w.is_contiguous() ? w : w.contiguous();
  kit::adamw_8bit_step(dense, p.grad(), state[0].tensor, state[1].tensor, state[2].tensor, state[3].tensor,
                       {lr, s_.beta1, s_.beta2, s_.eps, s_.weight_decay, t_});
  if (!w.is_contiguous()) w.copy_(dense);
}

void Optimizer::step_adafactor(std::size_t i, double lr) {
  constexpr double kEps1 = 1e-30, kClip = 1.0, kDecay = -0.8;
  const at::Tensor& p = params_[i].tensor;
  const at::Tensor w = master_[i].defined() ? master_[i] : p;
  const at::Tensor g = p.grad().to(at::kFloat);
  const double beta2 = 1 - std::pow(static_cast<double>(t_), kDecay);
  const at::Tensor squares = g * g + kEps1;
  at::Tensor update;
  if (state_[i].size() == 2) {
    at::Tensor &row = state_[i][0].tensor, &col = state_[i][1].tensor;
    row.mul_(beta2).add_(squares.mean(-1), 1 - beta2);
    col.mul_(beta2).add_(squares.mean(-2), 1 - beta2);
    // The factored estimate's inverse square root: rows by their mean, times columns.
    const at::Tensor row_factor = (row / row.mean(-1, true)).rsqrt_().unsqueeze(-1), col_factor = col.unsqueeze(-2).rsqrt();
    update = row_factor * col_factor;
    update.mul_(g);
  } else {
    at::Tensor& v = state_[i][0].tensor;
    v.mul_(beta2).add_(squares, 1 - beta2);
    update = v.rsqrt().mul_(g);
  }
  // Clipped to RMS kClip, on the device (no host sync a tensor).
  update.div_((update.norm() / (std::sqrt(static_cast<double>(std::max<std::int64_t>(update.numel(), 1))) * kClip)).clamp_min_(1.0));
  if (s_.weight_decay > 0) w.add_(w, -s_.weight_decay * lr);
  w.add_(update, -lr);
}

std::uint64_t Optimizer::state_bytes() const {
  std::uint64_t bytes = 0;
  const auto add = [&](const at::Tensor& t) {
    if (t.defined()) bytes += static_cast<std::uint64_t>(t.numel()) * t.element_size();
  };
  for (const auto& state : state_)
    for (const auto& s : state) add(s.tensor);
  for (const auto& t : master_) add(t);
  return bytes;
}

std::map<std::string, std::vector<at::Tensor>> Optimizer::grads_by_device() const {
  std::map<std::string, std::vector<at::Tensor>> groups;
  for (const auto& p : params_)
    if (p.tensor.grad().defined()) groups[p.tensor.device().str()].push_back(p.tensor.grad());
  return groups;
}

std::vector<at::Tensor> Optimizer::queue_grad_squares(const std::vector<bool>& skip) const {
  torch::NoGradGuard no_grad;
  std::map<std::string, std::vector<at::Tensor>> groups;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (params_[i].tensor.grad().defined() && !(i < skip.size() && skip[i])) groups[params_[i].tensor.device().str()].push_back(params_[i].tensor.grad());
  std::vector<at::Tensor> queued;
  for (const auto& [device, grads] : groups) {
    const auto norms = at::_foreach_norm(grads, 2);
    queued.push_back(at::stack(norms).to(at::kFloat).pow(2).sum());
  }
  return queued;
}

double Optimizer::read_squares(const std::vector<at::Tensor>& queued) {
  double squares = 0;
  for (const auto& s : queued) squares += s.item<double>();
  return squares;
}

double Optimizer::grad_squares(const std::vector<bool>& skip) const { return read_squares(queue_grad_squares(skip)); }

double Optimizer::grad_norm() const { return std::sqrt(grad_squares()); }

void Optimizer::scale_grads(double factor) {
  torch::NoGradGuard no_grad;
  for (auto& [device, grads] : grads_by_device()) at::_foreach_mul_(grads, factor);
}

void Optimizer::zero_grad() {
  prepared_.clear();
  for (auto& p : params_)
    if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
}

void Optimizer::save(std::vector<std::pair<std::string, at::Tensor>>& out) const {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("param/" + params_[i].name, master_[i].defined() ? master_[i] : params_[i].tensor);
    for (const auto& s : state_[i]) out.emplace_back(s.kind + "/" + params_[i].name, s.tensor);
  }
}

void Optimizer::load(const kit::SafetensorsFile& f, std::int64_t steps) {
  torch::NoGradGuard no_grad;
  // Every tensor is read and checked before any is copied: a damaged file leaves the optimizer as
  // it was, never half-loaded.
  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> read_all;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& name = params_[i].name;
    const auto missing = [&](const std::string& key) {
      return UserError(f.path().string() + ": no optimizer state for parameter " + name + " (" + key +
                       "); the checkpoint is from another model, adapter, optimizer or loom version: resume with the pipeline that wrote it");
    };
    // Each saved tensor has the shape and dtype of what this run holds: a damaged state is refused
    // here, before it is broadcast into the run or fails deep inside a step.
    const auto read = [&](const std::string& key, const at::Tensor& like) {
      if (!f.find(key)) throw missing(key);
      at::Tensor t = f.tensor(key);
      const bool codes = like.scalar_type() == at::kByte;
      if (t.sizes() != like.sizes() || (codes ? t.scalar_type() != at::kByte : !at::isFloatingType(t.scalar_type()))) {
        std::ostringstream saved, wanted;
        saved << t.sizes();
        wanted << like.sizes();
        throw UserError(f.path().string() + ": " + key + " is " + c10::toString(t.scalar_type()) + " " + saved.str() + " where this run holds " +
                        (codes ? "uint8 " : "floating point ") + wanted.str() +
                        "; the checkpoint is damaged or from another model: resume from another checkpoint, or start a new run");
      }
      return t;
    };
    const at::Tensor saved = read("param/" + name, params_[i].tensor);
    std::vector<at::Tensor> states;
    for (const auto& s : state_[i]) states.push_back(read(s.kind + "/" + name, s.tensor));
    read_all.emplace_back(saved, std::move(states));
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& [saved, states] = read_all[i];
    if (master_[i].defined()) master_[i].copy_(saved);
    params_[i].tensor.copy_(saved);
    for (std::size_t k = 0; k < states.size(); ++k) state_[i][k].tensor.copy_(states[k]);
  }
  t_ = steps;
}

double LearningRate::at(std::int64_t step, std::int64_t total) const {
  if (warmup > 0 && step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (scheduler == "constant") return peak;
  const double pi = std::acos(-1.0);
  const double progress = std::clamp(total > warmup ? static_cast<double>(step - warmup) / static_cast<double>(total - warmup) : 1.0, 0.0, 1.0);
  const auto floored = [&](double factor) { return peak * (min_ratio + (1 - min_ratio) * factor); };
  if (scheduler == "linear") return floored(1.0 - progress);
  if (scheduler == "cosine_with_restarts") {
    if (progress >= 1.0) return floored(0.0);
    return floored(0.5 * (1.0 + std::cos(pi * std::fmod(static_cast<double>(cycles) * progress, 1.0))));
  }
  if (scheduler == "wsd") {
    // The decay takes the last decay_ratio of the steps after warm-up, at least one.
    const auto after = std::max<std::int64_t>(total - warmup, 1);
    const auto decay = std::max<std::int64_t>(1, static_cast<std::int64_t>(std::llround(decay_ratio * static_cast<double>(after))));
    const std::int64_t into_decay = step - (total - decay);
    if (into_decay < 0) return peak;
    const double p = std::min(1.0, static_cast<double>(into_decay) / static_cast<double>(decay));
    if (decay_shape == "linear") return floored(1.0 - p);
    if (decay_shape == "1-sqrt") return floored(1.0 - std::sqrt(p));
    return floored(0.5 * (1.0 + std::cos(pi * p)));
  }
  return floored(0.5 * (1.0 + std::cos(pi * progress)));
}

bool LossScaler::update(bool finite) {
  if (!enabled_) return finite;
  if (!finite) {
    scale_ /= 2;
    good_steps_ = 0;
    return false;
  }
  if (++good_steps_ % 2000 == 0) scale_ *= 2;
  return true;
}

}  // namespace loom::core
