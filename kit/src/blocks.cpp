#include "loom/kit/blocks.hpp"

#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/kit/torch_compat.hpp"

namespace loom::kit {

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

}  // namespace loom::kit
