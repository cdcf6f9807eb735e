#include "loom/layers.hpp"

#include <cmath>

#include <ATen/ATen.h>

#include "loom/torch_compat.hpp"

namespace loom {

LinearAdapter::~LinearAdapter() = default;

AdaptableLinear::AdaptableLinear(std::int64_t in, std::int64_t out, bool has_bias, const at::TensorOptions& options)
    : in_features(in), out_features(out) {
  weight = register_parameter("weight", at::empty({out, in}, options));
  if (has_bias) bias = register_parameter("bias", at::zeros({out}, options));
}

at::Tensor AdaptableLinear::forward(const at::Tensor& x) {
  at::Tensor y = at::linear(x, weight, bias);
  if (adapter_) y = y + adapter_->delta(x);
  return y;
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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
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
