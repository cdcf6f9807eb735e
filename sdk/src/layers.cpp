#include "loom/layers.hpp"

#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/tensor_parallel.hpp"
#include "loom/torch_compat.hpp"

namespace loom {

LinearAdapter::~LinearAdapter() = default;

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

ShardedWeight::ShardedWeight(std::int64_t in, std::int64_t out, TensorShard shard, const at::TensorOptions& options) : shard_(shard) {
  const bool column = shard.style == ParallelStyle::kColumn;
  const auto part = shard_range(column ? out : in, shard.rank(), shard.size()).length;
  weight = register_parameter("weight", at::empty({column ? part : out, column ? in : part}, options));
}

at::Tensor ShardedWeight::forward(const at::Tensor& x, const at::Tensor& bias) {
  if (shard_.style == ParallelStyle::kColumn) return at::linear(copy_to_tensor_region(x, shard_.group, /*share=*/true), weight, bias);
  const at::Tensor y = reduce_from_tensor_region(at::linear(x, weight), shard_.group);
  return bias.defined() ? y + bias : y;
}

void ShardedWeight::add_(const at::Tensor& delta) { add_in_fp32(weight, delta); }
std::uint64_t ShardedWeight::bytes() const { return bytes_of(weight); }

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
  at::Tensor y = base_->forward(x, bias);
  if (adapter_) y = y + adapter_->delta(x);
  return y;
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

namespace {

// x * rsqrt(mean(x^2) + eps) in fp32, cast back to x's dtype; and that scale, one per row.
std::pair<at::Tensor, at::Tensor> normalize(const at::Tensor& x, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor rstd = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return {(xf * rstd).to(x.scalar_type()), rstd};
}

// RMSNorm as HF computes it (in fp32, the result cast back), with its own backward: autograd's
// would keep an fp32 copy of the input (twice the size of a bf16 input) for every norm; this keeps
// the input in its own dtype plus one fp32 scale per row, and recomputes the rest.
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    const auto [normed, rstd] = normalize(x, eps);
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["weight_grad"] = weight.requires_grad();
    return weight * normed;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2], &g = grads[0];
    // d/dx of x * rstd(x): rstd * (gy - xhat * mean(gy * xhat)), in fp32 as the forward.
    const at::Tensor gy = (g * weight).to(x.scalar_type()).to(at::kFloat);
    const at::Tensor xhat = x.to(at::kFloat) * rstd;
    const at::Tensor dx = (rstd * (gy - xhat * (gy * xhat).mean(-1, /*keepdim=*/true))).to(x.scalar_type());
    at::Tensor dweight;
    if (ctx->saved_data["weight_grad"].toBool()) dweight = (g * xhat.to(x.scalar_type())).sum_to_size(weight.sizes()).to(weight.scalar_type());
    return {dx, dweight, at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) return RmsNormFunction::apply(x, weight, eps);
  return weight * normalize(x, eps).first;
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto half = x.size(-1) / 2;
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  const at::Tensor rotated = at::cat({-x2, x1}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

at::Tensor attention_allowed(const at::Tensor& attention_mask, std::int64_t query_len) {
  const auto batch = attention_mask.size(0), keys = attention_mask.size(1);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(attention_mask.device());
  const at::Tensor query_pos = at::arange(keys - query_len, keys, opts).view({query_len, 1});
  const at::Tensor key_pos = at::arange(keys, opts).view({1, keys});
  const at::Tensor causal = key_pos <= query_pos;                        // [T, S]
  const at::Tensor real = attention_mask.to(at::kBool).view({batch, 1, 1, keys});
  const at::Tensor self = key_pos == query_pos;
  return (causal.view({1, 1, query_len, keys}) & real) | self.view({1, 1, query_len, keys});
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed) {
  return compat::scaled_dot_product_attention(q, k, v, allowed);
}

}  // namespace loom
