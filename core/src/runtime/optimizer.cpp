#include "runtime/optimizer.hpp"

#include <cmath>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/placement.hpp"

namespace loom::core {

AdamW::AdamW(std::vector<NamedParameter> params, AdamWSettings settings) : params_(std::move(params)), s_(settings) {
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    m_.push_back(at::zeros_like(p.tensor, p.tensor.options().dtype(at::kFloat)));
    v_.push_back(at::zeros_like(p.tensor, p.tensor.options().dtype(at::kFloat)));
    master_.push_back(p.tensor.scalar_type() == at::kFloat ? at::Tensor() : p.tensor.detach().to(at::kFloat));
  }
}

namespace {

// What one foreach update touches of a parameter: its float32 weights (the master copy, or the
// parameter itself), gradient and moments, and the bf16/fp16 parameter the master copy feeds.
struct Piece {
  at::Tensor w, g, m, v, param;
};

// `t` as flat slices of at most `values` elements (itself when it is no larger, or not contiguous).
std::vector<at::Tensor> slices(const at::Tensor& t, std::int64_t values) {
  if (!t.defined() || t.numel() <= values || !t.is_contiguous()) return {t};
  std::vector<at::Tensor> out;
  const at::Tensor flat = t.view({-1});
  for (std::int64_t at = 0; at < flat.numel(); at += values) out.push_back(flat.narrow(0, at, std::min(values, flat.numel() - at)));
  return out;
}

}  // namespace

void AdamW::prepare_step() {
  torch::NoGradGuard no_grad;
  prepared_.clear();
  // Per device, slices of at most kit::kOptimizerSliceValues values at a time: the float32 gradients
  // and denominators of one slice are the step's only temporaries (the planner counts them), one
  // set of foreach kernels per slice instead of a handful per tensor.
  std::map<std::string, std::vector<Piece>> pieces;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].tensor;
    if (!p.grad().defined()) continue;
    const at::Tensor w = master_[i].defined() ? master_[i] : p;
    const bool whole = p.numel() <= kit::kOptimizerSliceValues || !(w.is_contiguous() && p.is_contiguous() && p.grad().is_contiguous());
    const std::int64_t values = whole ? p.numel() : kit::kOptimizerSliceValues;
    const auto ws = slices(w, values), gs = slices(p.grad(), values), ms = slices(m_[i], values), vs = slices(v_[i], values);
    const auto ps = master_[i].defined() ? slices(p, values) : std::vector<at::Tensor>(ws.size());
    for (std::size_t k = 0; k < ws.size(); ++k) pieces[p.device().str()].push_back({ws[k], gs[k], ms[k], vs[k], master_[i].defined() ? ps[k] : at::Tensor()});
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
      b.m.push_back(piece.m);
      b.v.push_back(piece.v);
      if (piece.param.defined()) {
        b.params.push_back(piece.param);
        b.masters.push_back(piece.w);
      }
      values += piece.w.numel();
    }
  }
}

void AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  if (prepared_.empty()) prepare_step();
  ++t_;
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
    if (s_.weight_decay > 0) at::_foreach_mul_(b.w, 1 - lr * s_.weight_decay);
    at::_foreach_mul_(b.m, s_.beta1);
    at::_foreach_add_(b.m, b.g, 1 - s_.beta1);
    at::_foreach_mul_(b.v, s_.beta2);
    at::_foreach_addcmul_(b.v, b.g, b.g, 1 - s_.beta2);
    auto denom = at::_foreach_div(b.v, c2);
    at::_foreach_sqrt_(denom);
    at::_foreach_add_(denom, s_.eps);
    at::_foreach_addcdiv_(b.w, b.m, denom, -lr / c1);
    kit::compat::foreach_copy(b.params, b.masters);
  }
  prepared_.clear();  // the lists hold this step's gradients
}

std::uint64_t AdamW::state_bytes() const {
  std::uint64_t bytes = 0;
  for (const auto* list : {&m_, &v_, &master_})
    for (const auto& t : *list)
      if (t.defined()) bytes += static_cast<std::uint64_t>(t.numel()) * t.element_size();
  return bytes;
}

std::map<std::string, std::vector<at::Tensor>> AdamW::grads_by_device() const {
  std::map<std::string, std::vector<at::Tensor>> groups;
  for (const auto& p : params_)
    if (p.tensor.grad().defined()) groups[p.tensor.device().str()].push_back(p.tensor.grad());
  return groups;
}

std::vector<at::Tensor> AdamW::queue_grad_squares(const std::vector<bool>& skip) const {
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

double AdamW::read_squares(const std::vector<at::Tensor>& queued) {
  double squares = 0;
  for (const auto& s : queued) squares += s.item<double>();
  return squares;
}

double AdamW::grad_squares(const std::vector<bool>& skip) const { return read_squares(queue_grad_squares(skip)); }

double AdamW::grad_norm() const { return std::sqrt(grad_squares()); }

void AdamW::scale_grads(double factor) {
  torch::NoGradGuard no_grad;
  for (auto& [device, grads] : grads_by_device()) at::_foreach_mul_(grads, factor);
}

void AdamW::zero_grad() {
  prepared_.clear();
  for (auto& p : params_)
    if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
}

void AdamW::save(std::vector<std::pair<std::string, at::Tensor>>& out) const {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("param/" + params_[i].name, master_[i].defined() ? master_[i] : params_[i].tensor);
    out.emplace_back("adam_m/" + params_[i].name, m_[i]);
    out.emplace_back("adam_v/" + params_[i].name, v_[i]);
  }
}

void AdamW::load(const kit::SafetensorsFile& f, std::int64_t steps) {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& name = params_[i].name;
    for (const char* kind : {"param/", "adam_m/", "adam_v/"})
      if (!f.find(kind + name))
        throw UserError(f.path().string() + ": no optimizer state for parameter " + name + " (" + kind +
                        "); the checkpoint is from another model, adapter or loom version: resume with the pipeline that wrote it");
    // Each saved tensor has the parameter's shape and a floating dtype: a damaged state is refused
    // here, before it is broadcast into the run or fails deep inside a step.
    const auto state = [&](const char* kind) {
      at::Tensor t = f.tensor(kind + name);
      if (t.sizes() != params_[i].tensor.sizes() || !at::isFloatingType(t.scalar_type())) {
        std::ostringstream saved, wanted;
        saved << t.sizes();
        wanted << params_[i].tensor.sizes();
        throw UserError(f.path().string() + ": " + kind + name + " is " + c10::toString(t.scalar_type()) + " " + saved.str() +
                        " where this run's parameter is floating point " + wanted.str() +
                        "; the checkpoint is damaged or from another model: resume from another checkpoint, or start a new run");
      }
      return t;
    };
    const at::Tensor saved = state("param/"), m = state("adam_m/"), v = state("adam_v/");
    if (master_[i].defined()) master_[i].copy_(saved);
    params_[i].tensor.copy_(saved);
    m_[i].copy_(m);
    v_[i].copy_(v);
  }
  t_ = steps;
}

double LearningRate::at(std::int64_t step, std::int64_t total) const {
  if (warmup > 0 && step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (scheduler == "constant") return peak;
  const double progress = total > warmup ? static_cast<double>(step - warmup) / static_cast<double>(total - warmup) : 1.0;
  if (scheduler == "linear") return peak * std::max(0.0, 1.0 - progress);
  return peak * 0.5 * (1.0 + std::cos(std::acos(-1.0) * std::min(1.0, progress)));
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
