#include "loom/layers.hpp"

#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/model.hpp"

namespace loom {

LinearAdapter::~LinearAdapter() = default;
DeltaAddedInPlace::~DeltaAddedInPlace() = default;
WholeProduct::~WholeProduct() = default;
FoldableDelta::~FoldableDelta() = default;

LinearWeight::~LinearWeight() = default;

void LinearWeight::assign(const std::string& suffix, const at::Tensor& value) {
  for (auto& [name, tensor] : stored()) {
    if (name != suffix) continue;
    if (tensor.sizes() != value.sizes()) {
      const auto text = [](at::IntArrayRef s) {
        std::string out = "[";
        for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
        return out + "]";
      };
      throw UserError("has shape " + text(value.sizes()) + ", the config implies " + text(tensor.sizes()));
    }
    torch::NoGradGuard no_grad;
    tensor.copy_(value);
    return;
  }
  throw UserError("is not a part of this layer's weight (" + suffix + ")");
}

void LinearWeight::finish_load(const std::string&) {}

DenseWeight::DenseWeight(std::int64_t in, std::int64_t out, const at::TensorOptions& options) {
  weight = register_parameter("weight", at::empty({out, in}, options));
}

at::Tensor DenseWeight::forward(const at::Tensor& x, const at::Tensor& bias) { return at::linear(x, weight, bias); }

namespace {
void add_in_fp32(at::Tensor& weight, const at::Tensor& delta) {
  torch::NoGradGuard no_grad;
  // Summed in fp32 and rounded once, so a bf16 weight loses no more than one rounding.
  weight.copy_((weight.to(at::kFloat) + delta.to(at::kFloat)).to(weight.scalar_type()));
}
std::uint64_t bytes_of(const at::Tensor& t) { return static_cast<std::uint64_t>(t.numel()) * t.element_size(); }
}  // namespace

void DenseWeight::add_(const at::Tensor& delta) { add_in_fp32(weight, delta); }
std::uint64_t DenseWeight::bytes() const { return bytes_of(weight); }

AdaptableLinear::AdaptableLinear(std::int64_t in, std::int64_t out, bool has_bias, const at::TensorOptions& options)
    : in_features(in), out_features(out) {
  base_ = register_module("base", std::make_shared<DenseWeight>(in, out, options));
  if (has_bias) bias = register_parameter("bias", at::zeros({out}, options));
}

AdaptableLinear::AdaptableLinear(std::shared_ptr<LinearWeight> base, std::int64_t in, std::int64_t out, at::Tensor b)
    : in_features(in), out_features(out) {
  base_ = register_module("base", std::move(base));
  if (b.defined()) bias = register_parameter("bias", std::move(b));
}

at::Tensor AdaptableLinear::forward(const at::Tensor& x) {
  auto* whole = adapter_ ? dynamic_cast<WholeProduct*>(adapter_.get()) : nullptr;
  auto* in_place = adapter_ ? dynamic_cast<DeltaAddedInPlace*>(adapter_.get()) : nullptr;
  if (whole == nullptr && in_place == nullptr) {
    at::Tensor y = base_->forward(x, bias);
    return adapter_ ? y + adapter_->delta(x) : y;
  }
  // On [tokens, features], as the base makes it: its own tensor, not a view of one (an in-place
  // product into a view would make autograd copy the whole gradient in backward, CopySlices).
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  at::Tensor y = whole != nullptr ? whole->forward_with(*base_, x2, bias) : at::Tensor();
  if (!y.defined()) {
    y = base_->forward(x2, bias);
    if (in_place != nullptr) in_place->add_delta_to(y, x2);
    else y = y + adapter_->delta(x2);
  }
  if (x.dim() == 2) return y;
  auto shape = x.sizes().vec();
  shape.back() = y.size(-1);
  return y.view(shape);
}

void AdaptableLinear::replace_base(std::shared_ptr<LinearWeight> base) {
  base_ = replace_module("base", std::move(base));
}

std::vector<std::pair<std::string, at::Tensor>> AdaptableLinear::stored() {
  auto out = base_->stored();
  if (bias.defined()) out.emplace_back("bias", bias);
  return out;
}

void AdaptableLinear::attach(const std::string& name, std::shared_ptr<LinearAdapter> adapter) {
  detach();
  adapter_name_ = name;
  adapter_ = register_module(name, std::move(adapter));
}

void AdaptableLinear::detach() {
  if (!adapter_) return;
  unregister_module(adapter_name_);
  adapter_.reset();
  adapter_name_.clear();
}

TensorShard LinearWeight::shard() const { return {}; }

}  // namespace loom
