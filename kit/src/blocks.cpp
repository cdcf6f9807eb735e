#include "loom/kit/blocks.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/kit/torch_compat.hpp"
#include "kernel_launch.hpp"
#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/api/include/torch/version.h>

#include "decode_kernels.hpp"
#endif

namespace loom::kit {

namespace {

// x * rsqrt(mean(x^2) + eps) in fp32, cast back to x's dtype; and that scale, one per row.
std::pair<at::Tensor, at::Tensor> normalize(const at::Tensor& x, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor rstd = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return {(xf * rstd).to(x.scalar_type()), rstd};
}

#ifdef LOOM_WITH_CUDA
// The kernels read 16 bytes at a time: a contiguous tensor may still start anywhere in its storage.
bool aligned16(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0; }

// Whether the rows kernels (decode_kernels.hpp) take this norm: a GPU, 16-bit x and weight alike.
bool norm_rows_kernels_take(const at::Tensor& x, const at::Tensor& weight) {
  return x.is_cuda() && x.dim() >= 1 && weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.numel() == x.size(-1) &&
         weight.device() == x.device() && launch::kernels_take(x) && detail::rms_norm_rows_supported(x.size(-1), launch::kernel_dtype(x.scalar_type()));
}

// The norm by the rows kernel, and each row's fp32 scale into *rstd ([..., 1]) when asked; undefined
// where the kernel does not take x and weight.
at::Tensor norm_by_rows_kernel(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* rstd) {
  if (!norm_rows_kernels_take(x, weight)) return {};
  const at::Tensor in = x.contiguous(), w = weight.contiguous();
  if (!aligned16(in) || !aligned16(w)) return {};
  at::Tensor out = at::empty_like(in);
  if (rstd != nullptr) {
    auto shape = in.sizes().vec();
    shape.back() = 1;
    *rstd = at::empty(shape, in.options().dtype(at::kFloat));
  }
  const auto hidden = in.size(-1);
  launch::check_cuda(detail::rms_norm_rows_cuda(in.data_ptr(), w.data_ptr(), out.data_ptr(), rstd != nullptr ? rstd->data_ptr<float>() : nullptr,
                                                in.numel() / hidden, hidden, static_cast<float>(eps), launch::kernel_dtype(in.scalar_type()),
                                                launch::current_stream(in)),
                     "rms_norm");
  return out;
}
#endif

// RMSNorm as HF computes it (in fp32, the result cast back), with its own backward: autograd's
// would keep an fp32 copy of the input (twice the size of a bf16 input) for every norm; this keeps
// the input in its own dtype plus one fp32 scale per row, and recomputes the rest.
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    ctx->saved_data["weight_grad"] = weight.requires_grad();
#ifdef LOOM_WITH_CUDA
    // On a GPU one kernel a pass instead of eight, keeping the same input and fp32 scales.
    const at::Tensor in = norm_rows_kernels_take(x, weight) ? x.contiguous() : x;
    at::Tensor scales;
    if (at::Tensor out = norm_by_rows_kernel(in, weight, eps, &scales); out.defined()) {
      ctx->save_for_backward({in, weight, scales});
      return out;
    }
#endif
    const auto [normed, rstd] = normalize(x, eps);
    ctx->save_for_backward({x, weight, rstd});
    return weight * normed;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2], &g = grads[0];
    const bool weight_grad = ctx->saved_data["weight_grad"].toBool();
    // d/dx of x * rstd(x): rstd * (gy - xhat * mean(gy * xhat)), in fp32 as the forward.
    at::Tensor dx;
#ifdef LOOM_WITH_CUDA
    const bool kernel = norm_rows_kernels_take(x, weight) && g.scalar_type() == x.scalar_type() && x.is_contiguous() && aligned16(x);
    const at::Tensor gc = kernel ? g.contiguous() : at::Tensor(), w = kernel ? weight.contiguous() : at::Tensor();
    if (kernel && aligned16(gc) && aligned16(w)) {
      const at::Tensor r = rstd.contiguous();
      dx = at::empty_like(x);
      const auto hidden = x.size(-1);
      launch::check_cuda(detail::rms_norm_rows_backward_cuda(gc.data_ptr(), x.data_ptr(), w.data_ptr(), r.data_ptr<float>(), dx.data_ptr(),
                                                             x.numel() / hidden, hidden, launch::kernel_dtype(x.scalar_type()), launch::current_stream(x)),
                         "rms_norm backward");
      if (!weight_grad) return {dx, at::Tensor(), at::Tensor()};
    }
#endif
    const at::Tensor xhat = x.to(at::kFloat) * rstd;
    if (!dx.defined()) {
      const at::Tensor gy = (g * weight).to(x.scalar_type()).to(at::kFloat);
      dx = (rstd * (gy - xhat * (gy * xhat).mean(-1, /*keepdim=*/true))).to(x.scalar_type());
    }
    at::Tensor dweight;
    if (weight_grad) dweight = (g * xhat.to(x.scalar_type())).sum_to_size(weight.sizes()).to(weight.scalar_type());
    return {dx, dweight, at::Tensor()};
  }
};

#ifdef LOOM_WITH_CUDA
// Whether rotary_cuda takes x [B, heads, T, d] laid out by token (a projection's output,
// transposed) with cos and sin [B, T, d] of its dtype.
bool rotary_kernel_takes(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x.is_cuda() && x.dim() == 4 && x.size(-1) % 2 == 0 && launch::kernels_take(x) && cos.scalar_type() == x.scalar_type() &&
         sin.scalar_type() == x.scalar_type() && x.transpose(1, 2).is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 3 &&
         cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && cos.size(2) == x.size(3) && cos.device() == x.device() && sin.device() == x.device();
}

// x * cos + rotate_half(x) * sin by the kernel (transposed: the rotation's transpose): [B, heads,
// T, d], laid out by token.
at::Tensor rotary_by_kernel(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool transposed = false) {
  const at::Tensor by_token = x.transpose(1, 2), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty_like(by_token);
  launch::check_cuda(detail::rotary_cuda(by_token.data_ptr(), c.data_ptr(), s.data_ptr(), out.data_ptr(), x.size(0) * x.size(2), x.size(1), x.size(3),
                                         transposed, launch::kernel_dtype(x.scalar_type()), launch::current_stream(x)),
                     "rotary");
  return out.transpose(1, 2);
}

// Rotary with gradients: the backward is the rotation's transpose, by the same kernel, rounding each
// product and sum as autograd's composite backward does. (For HF's tables, whose halves repeat, the
// transpose is the rotation by -sin; the kernel does not assume it.)
struct RotaryFunction : public torch::autograd::Function<RotaryFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotary_by_kernel(x, cos, sin);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    // The gradient laid out by token, as the kernel reads it.
    const at::Tensor g = grads[0].transpose(1, 2).contiguous().transpose(1, 2);
    return {rotary_by_kernel(g, saved[0], saved[1], /*transposed=*/true), at::Tensor(), at::Tensor()};
  }
};

// Whether the SwiGLU kernels take gate and up: a GPU, one 16-bit dtype and shape, contiguous and
// 16-byte aligned.
bool swiglu_kernels_take(const at::Tensor& gate, const at::Tensor& up) {
  return gate.is_cuda() && up.device() == gate.device() && up.scalar_type() == gate.scalar_type() && gate.sizes() == up.sizes() &&
         gate.is_contiguous() && up.is_contiguous() &&
         detail::swiglu_cuda_takes(gate.numel(), launch::kernel_dtype(gate.scalar_type()), {gate.data_ptr(), up.data_ptr()});
}

at::Tensor swiglu_by_kernel(const at::Tensor& gate, const at::Tensor& up) {
  at::Tensor out = at::empty_like(gate);
  launch::check_cuda(detail::swiglu_cuda(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), launch::kernel_dtype(gate.scalar_type()),
                                         launch::current_stream(gate)),
                     "swiglu");
  return out;
}

#endif

// SwiGLU with gradients keeping only gate and up: autograd's composite also keeps silu(gate), a
// third [tokens, intermediate] tensor a layer. silu is recomputed in backward; on a GPU one kernel
// forward and one backward, where the composite runs two and three.
struct SwigluFunction : public torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
#ifdef LOOM_WITH_CUDA
    if (swiglu_kernels_take(gate, up)) return swiglu_by_kernel(gate, up);
#endif
    return at::silu(gate) * up;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
#ifdef LOOM_WITH_CUDA
    const at::Tensor g = grads[0].to(gate.scalar_type()).contiguous();
    if (g.sizes() == gate.sizes() && swiglu_kernels_take(gate, up) && swiglu_kernels_take(g, gate)) {
      at::Tensor d_gate = at::empty_like(gate), d_up = at::empty_like(up);
      launch::check_cuda(detail::swiglu_backward_cuda(g.data_ptr(), gate.data_ptr(), up.data_ptr(), d_gate.data_ptr(), d_up.data_ptr(), gate.numel(),
                                                      launch::kernel_dtype(gate.scalar_type()), launch::current_stream(gate)),
                         "swiglu backward");
      return {d_gate, d_up};
    }
#else
    const at::Tensor& g = grads[0];
#endif
    return {at::silu_backward(g * up, gate), g * at::silu(gate)};
  }
};

#ifdef LOOM_WITH_CUDA
// The rows kernels over both [rows, 2W]: gate at each row's start, up W values on, with `more`
// tensors of the same row shapes (a gradient [rows, W]).
bool halves_kernels_take(const at::Tensor& both, std::int64_t width, std::initializer_list<const void*> more = {}) {
  if (!both.is_cuda() || !both.is_contiguous()) return false;
  std::vector<const void*> pointers{both.data_ptr(), static_cast<const char*>(both.data_ptr()) + width * static_cast<std::int64_t>(both.element_size())};
  pointers.insert(pointers.end(), more.begin(), more.end());
  for (const void* p : pointers)
    if (!detail::swiglu_rows_cuda_takes(width, 2 * width, width, launch::kernel_dtype(both.scalar_type()), {p})) return false;
  return true;
}
void* shifted(const at::Tensor& t, std::int64_t values) { return static_cast<char*>(t.data_ptr()) + values * static_cast<std::int64_t>(t.element_size()); }
#endif

// silu(gate) * up of a tensor's two halves, as LibTorch's two kernels compute it.
at::Tensor swiglu_halves_values(const at::Tensor& both) {
  const std::int64_t width = both.size(-1) / 2;
#ifdef LOOM_WITH_CUDA
  if (halves_kernels_take(both, width)) {
    auto shape = both.sizes().vec();
    shape.back() = width;
    at::Tensor out = at::empty(shape, both.options());
    launch::check_cuda(detail::swiglu_rows_cuda(both.data_ptr(), shifted(both, width), out.data_ptr(), both.numel() / (2 * width), width, 2 * width,
                                                width, launch::kernel_dtype(both.scalar_type()), launch::current_stream(both)),
                       "swiglu of halves");
    return out;
  }
#endif
  return at::silu(both.narrow(-1, 0, width)) * both.narrow(-1, width, width);
}

// The same keeping only the tensor: its backward writes both halves' gradient as one tensor, where
// autograd's two slices would each make a zero-filled copy to add up.
struct SwigluHalvesFunction : public torch::autograd::Function<SwigluHalvesFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& both) {
    ctx->save_for_backward({both});
    return swiglu_halves_values(both);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const at::Tensor both = ctx->get_saved_variables()[0];
    const std::int64_t width = both.size(-1) / 2;
    const at::Tensor g = grads[0].to(both.scalar_type()).contiguous();
#ifdef LOOM_WITH_CUDA
    at::Tensor d_both = at::empty_like(both);
    if (halves_kernels_take(both, width, {g.data_ptr(), d_both.data_ptr(), shifted(d_both, width)})) {
      launch::check_cuda(detail::swiglu_rows_backward_cuda(g.data_ptr(), both.data_ptr(), shifted(both, width), d_both.data_ptr(), shifted(d_both, width),
                                                           both.numel() / (2 * width), width, 2 * width, width, launch::kernel_dtype(both.scalar_type()),
                                                           launch::current_stream(both)),
                         "swiglu of halves backward");
      return {d_both};
    }
#endif
    const at::Tensor gate = both.narrow(-1, 0, width), up = both.narrow(-1, width, width);
    return {at::cat({at::silu_backward(g * up, gate), g * at::silu(gate)}, -1)};
  }
};

}  // namespace

at::Tensor swiglu_halves(const at::Tensor& both) {
  if (both.dim() < 1 || both.size(-1) % 2 != 0) throw std::logic_error("swiglu_halves: the last dimension is not two halves");
  if (at::GradMode::is_enabled() && both.requires_grad()) return SwigluHalvesFunction::apply(both);
  return swiglu_halves_values(both);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (at::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad())) return SwigluFunction::apply(gate, up);
#ifdef LOOM_WITH_CUDA
  if (swiglu_kernels_take(gate, up)) return swiglu_by_kernel(gate, up);
#endif
  return at::silu(gate) * up;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) return RmsNormFunction::apply(x, weight, eps);
#ifdef LOOM_WITH_CUDA
  // Without gradients on a GPU, many rows (a prompt, an evaluation batch, training's first layer):
  // the rows kernel.
  constexpr std::int64_t kFewRows = 16;
  if (x.dim() >= 1 && x.size(-1) > 0 && x.numel() / x.size(-1) > kFewRows)
    if (at::Tensor out = norm_by_rows_kernel(x, weight, eps, nullptr); out.defined()) return out;
  // A decode step's few rows: one kernel instead of eight, overlapping the kernel before it.
  if (x.is_cuda() && launch::kernels_take(x) && weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.numel() == x.size(-1) &&
      x.size(-1) <= detail::rms_norm_cuda_max_hidden) {
    const at::Tensor in = x.contiguous(), w = weight.contiguous();
    at::Tensor out = at::empty_like(in);
    const auto hidden = in.size(-1);
    launch::check_cuda(detail::rms_norm_cuda(in.data_ptr(), w.data_ptr(), out.data_ptr(), hidden > 0 ? in.numel() / hidden : 0, hidden,
                                             static_cast<float>(eps), launch::kernel_dtype(in.scalar_type()), launch::current_stream(in)),
                       "rms_norm");
    return out;
  }
#endif
  return weight * normalize(x, eps).first;
}

namespace {
// RMSNorm computed in fp32 and rounded once (Gemma's (1 + w), OLMo 2's w): backward keeps x as it
// came and one fp32 scale a row, where the composite's autograd keeps x and the normalized rows in
// fp32 (four values a feature instead of one, for each of Gemma's six norms a layer).
struct RmsNormInFloat : public torch::autograd::Function<RmsNormInFloat> {
  static at::Tensor scale_of(const at::Tensor& weight, bool offset) { return offset ? weight.to(at::kFloat) + 1 : weight.to(at::kFloat); }
  // The norm's value, and its fp32 scale a row (`r`).
  static at::Tensor normed(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset, at::Tensor& r) {
    const at::Tensor f = x.to(at::kFloat);
    r = at::rsqrt(f.pow(2).mean(-1, true) + eps);
    return (f * r * scale_of(weight, offset)).to(x.scalar_type());
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
    at::Tensor r;
    const at::Tensor y = normed(x, weight, eps, offset, r);
    ctx->save_for_backward({x, weight, r});
    ctx->saved_data["offset"] = offset;
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &r = saved[2];
    const at::Tensor g = grads[0].to(at::kFloat), normed = x.to(at::kFloat) * r;
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      // d/dx of x r s: r (g s - x r mean(g s x r)), the mean over the row's features.
      const at::Tensor gs = g * scale_of(weight, ctx->saved_data["offset"].toBool());
      dx = (r * (gs - normed * (gs * normed).mean(-1, true))).to(x.scalar_type());
    }
    if (ctx->needs_input_grad(1)) dw = (g * normed).reshape({-1, normed.size(-1)}).sum(0).to(weight.scalar_type());
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm_in_float(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  if (grad) return RmsNormInFloat::apply(x, weight, eps, offset);
  at::Tensor r;
  return RmsNormInFloat::normed(x, weight, eps, offset, r);
}
}  // namespace

at::Tensor rms_norm_offset(const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm_in_float(x, weight, eps, true); }

at::Tensor rms_norm_float(const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm_in_float(x, weight, eps, false); }

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

at::Tensor layer_norm_float(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor f = x.to(at::kFloat);
  const at::Tensor centred = f - f.mean(-1, true);
  const at::Tensor normed = centred * at::rsqrt(centred.pow(2).mean(-1, true) + eps);
  return (weight.defined() ? normed * weight.to(at::kFloat) : normed).to(x.scalar_type());
}

at::Tensor apply_rotary_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto turned = cos.size(-1);
  if (turned < x.size(-1))
    return at::cat({apply_rotary_interleaved(x.narrow(-1, 0, turned), cos, sin), x.narrow(-1, turned, x.size(-1) - turned)}, -1);
  // Pairs (2i, 2i + 1) turn by frequency i, whose cos and sin sit at i (and i + r/2) of the tables.
  const auto half = turned / 2;
  const at::Tensor c = cos.narrow(-1, 0, half).to(at::kFloat).unsqueeze(1), s = sin.narrow(-1, 0, half).to(at::kFloat).unsqueeze(1);
  auto sizes = x.sizes().vec();
  sizes.back() = half;
  sizes.push_back(2);
  const at::Tensor pairs = x.to(at::kFloat).reshape(sizes);
  const at::Tensor even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
  return at::stack({even * c - odd * s, odd * c + even * s}, -1).flatten(-2).to(x.scalar_type());
}

at::Tensor soft_cap(const at::Tensor& x, double cap) { return at::tanh(x / cap) * cap; }

at::Tensor clamped_swiglu(const at::Tensor& gate, const at::Tensor& up, double alpha, double limit) {
  const at::Tensor g = gate.clamp_max(limit);
  return g * at::sigmoid(g * alpha) * (up.clamp(-limit, limit) + 1);
}

at::Tensor attention_exact(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed, const AttentionExtras& extras) {
  const auto heads = q.size(1), kv_heads = k.size(1), len = q.size(2), keys = k.size(2);
  if (kv_heads == 0 || heads % kv_heads != 0)
    throw std::logic_error("attention_exact: " + std::to_string(heads) + " query heads over " + std::to_string(kv_heads) + " key/value heads");
  // Grouped-query heads: query head h reads key/value head h / (heads / kv_heads).
  const at::Tensor k_all = kv_heads == heads ? k : k.repeat_interleave(heads / kv_heads, 1);
  const at::Tensor v_all = kv_heads == heads ? v : v.repeat_interleave(heads / kv_heads, 1);
  const double scale = extras.scale > 0 ? extras.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, k_all.transpose(-2, -1)) * scale;
  if (extras.softcap > 0) scores = soft_cap(scores, extras.softcap);
  // Causal over the last `len` of `keys` columns where no pattern is given.
  const at::Tensor seen = allowed.defined() ? allowed : at::ones({len, keys}, q.options().dtype(at::kBool)).tril(keys - len);
  // The softmax in fp32 at least (float64 stays float64).
  const auto softmax_type = at::promote_types(q.scalar_type(), at::kFloat);
  scores = scores.masked_fill(seen.logical_not(), -std::numeric_limits<float>::infinity()).to(softmax_type);
  at::Tensor weights;
  if (extras.sinks.defined()) {
    // The sink is one more column of each head's scores: it takes its share of the softmax and is
    // dropped, so the weights of a row sum to less than one.
    const at::Tensor sink = extras.sinks.to(softmax_type).view({1, heads, 1, 1}).expand({scores.size(0), heads, len, 1});
    weights = at::softmax(at::cat({scores, sink}, -1), -1).narrow(-1, 0, keys);
  } else {
    weights = at::softmax(scores, -1);
  }
  return at::matmul(weights.to(q.scalar_type()), v_all);
}

at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, bool tanh_approximation) {
  return at::gelu(gate, tanh_approximation ? "tanh" : "none") * up;
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // A partial rotary (cos narrower than a head) turns the head's first dimensions, the rest pass.
  if (const auto turned = cos.size(-1); turned < x.size(-1))
    return at::cat({apply_rotary(x.narrow(-1, 0, turned), cos, sin), x.narrow(-1, turned, x.size(-1) - turned)}, -1);
#ifdef LOOM_WITH_CUDA
  // On a GPU, heads laid out [B, T, H, d] (a projection's output, transposed): one kernel instead
  // of five, rounding as they do, forward and backward.
  if (rotary_kernel_takes(x, cos, sin)) {
    const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || cos.requires_grad() || sin.requires_grad());
    if (!grad) return rotary_by_kernel(x, cos, sin);
    if (!cos.requires_grad() && !sin.requires_grad()) return RotaryFunction::apply(x, cos, sin);
  }
#endif
  const auto half = x.size(-1) / 2;
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  const at::Tensor rotated = at::cat({-x2, x1}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

at::Tensor attention_allowed(const at::Tensor& attention_mask, std::int64_t query_len, std::int64_t window) {
  const auto batch = attention_mask.size(0), keys = attention_mask.size(1);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(attention_mask.device());
  const at::Tensor query_pos = at::arange(keys - query_len, keys, opts).view({query_len, 1});
  const at::Tensor key_pos = at::arange(keys, opts).view({1, keys});
  const at::Tensor causal = window > 0 ? (key_pos <= query_pos) & (key_pos > query_pos - window) : key_pos <= query_pos;  // [T, S]
  const at::Tensor key = attention_mask.view({batch, 1, 1, keys});
  const at::Tensor query = attention_mask.narrow(1, keys - query_len, query_len).view({batch, 1, query_len, 1});
  // A real query reads the keys of its own sample (packed rows number them; otherwise all are 1);
  // a padding query, whose output nothing reads, every real key before it.
  const at::Tensor visible = (key > 0) & ((key == query) | (query == 0));
  const at::Tensor self = key_pos == query_pos;
  return (causal.view({1, 1, query_len, keys}) & visible) | self.view({1, 1, query_len, keys});
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed) {
  return compat::scaled_dot_product_attention(q, k, v, allowed);
}

AttentionSegments attention_segments(const at::Tensor& attention_mask) {
  const at::Tensor mask = attention_mask.to(at::kCPU, at::kLong).contiguous();
  if (mask.dim() != 2) throw std::logic_error("attention_segments: a mask of " + std::to_string(mask.dim()) + " dimensions, not [B, T]");
  const auto rows = mask.size(0), cols = mask.size(1);
  if (rows * cols > std::numeric_limits<std::int32_t>::max()) throw std::logic_error("attention_segments: more tokens than int32 offsets hold");
  const std::int64_t* m = mask.data_ptr<std::int64_t>();
  std::vector<std::int32_t> offsets{0};
  std::int64_t longest = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t* row = m + r * cols;
    std::set<std::int64_t> ended;  // samples whose run has ended in this row
    std::int64_t start = 0;
    for (std::int64_t c = 1; c <= cols; ++c) {
      if (c < cols && row[c] == row[c - 1]) continue;
      // A sample whose tokens come back after a gap (a mask with holes) is not one segment.
      if (row[start] != 0 && !ended.insert(row[start]).second) return {};
      offsets.push_back(static_cast<std::int32_t>(r * cols + c));
      longest = std::max(longest, c - start);
      start = c;
    }
  }
  return {at::tensor(offsets, at::TensorOptions().dtype(at::kInt)).to(attention_mask.device()), longest};
}

// LibTorch 2.1 on gives its flash kernel's variable-length form, with a derivative, as an operator.
// Its window arguments came in 2.5.
#if defined(LOOM_WITH_CUDA) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1))
#define LOOM_SEGMENT_ATTENTION 1
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 5
#define LOOM_SEGMENT_WINDOW 1
#endif
#endif

bool segment_attention_serves(const at::Tensor& activations, std::int64_t head_dim, bool windowed) {
#ifdef LOOM_SEGMENT_ATTENTION
#ifndef LOOM_SEGMENT_WINDOW
  if (windowed) return false;
#endif
  const at::Tensor& a = activations;
  if (!a.is_cuda() || (a.scalar_type() != at::kBFloat16 && a.scalar_type() != at::kHalf)) return false;
  // LibTorch's flash kernel needs compute capability 8.0 (on 7.x the caller masks instead, as exact).
  return head_dim > 0 && head_dim % 8 == 0 && head_dim <= 256 && compat::cuda_device_capability(static_cast<int>(a.device().index())) >= 80;
#else
  (void)activations, (void)head_dim, (void)windowed;
  return false;
#endif
}

at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionSegments& segments, std::int64_t window) {
#ifdef LOOM_SEGMENT_ATTENTION
  const auto batch = q.size(0), heads = q.size(1), len = q.size(2), dim = q.size(3);
  if (k.size(2) != len || v.sizes() != k.sizes() || !segments.offsets.defined() || segments.offsets.device() != q.device())
    throw std::logic_error("segment_attention: keys of another length, or segments not on the queries' device");
  // [B, heads, T, d] -> the rows' tokens end to end, [B * T, heads, d].
  const auto end_to_end = [&](const at::Tensor& t) { return t.transpose(1, 2).reshape({batch * len, t.size(1), dim}); };
#ifdef LOOM_SEGMENT_WINDOW
  // The kernel's left window counts the keys before a token's own.
  const auto left = window > 0 ? c10::optional<int64_t>(window - 1) : c10::nullopt;
  const auto right = window > 0 ? c10::optional<int64_t>(0) : c10::nullopt;
  const auto result = at::_flash_attention_forward(end_to_end(q), end_to_end(k), end_to_end(v), segments.offsets, segments.offsets, segments.longest,
                                                   segments.longest, /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false,
                                                   /*scale=*/c10::nullopt, left, right);
#else
  if (window > 0) throw std::logic_error("segment_attention: a window in a LibTorch whose flash kernel takes none (segment_attention_serves says so)");
  const auto result = at::_flash_attention_forward(end_to_end(q), end_to_end(k), end_to_end(v), segments.offsets, segments.offsets, segments.longest,
                                                   segments.longest, /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false);
#endif
  return std::get<0>(result).view({batch, len, heads, dim}).transpose(1, 2);
#else
  (void)q, (void)k, (void)v, (void)segments, (void)window;
  throw std::logic_error("segment_attention: this build has no variable-length flash attention (segment_attention_serves says so)");
#endif
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed) {
#ifdef LOOM_WITH_CUDA
  const auto dim = q.size(-1);
  const bool supported_dim = dim % 32 == 0 && dim <= 256 && dim / 32 != 5 && dim / 32 != 7;
  if (q.is_cuda() && q.dim() == 4 && q.size(2) == 1 && supported_dim && launch::kernels_take(q) && k.scalar_type() == q.scalar_type() &&
      v.scalar_type() == q.scalar_type() && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
      k.size(3) == dim && q.size(1) % k.size(1) == 0 && allowed.defined() && allowed.scalar_type() == at::kBool &&
      allowed.numel() == q.size(0) * k.size(2)) {
    const at::Tensor by_token = q.transpose(1, 2).contiguous(), seen = allowed.reshape({q.size(0), k.size(2)}).contiguous();
    at::Tensor out = at::empty_like(by_token);
    launch::check_cuda(detail::decode_attention_cuda(by_token.data_ptr(), k.data_ptr(), v.data_ptr(), seen.data_ptr<bool>(), out.data_ptr(), q.size(0),
                                                     q.size(1), k.size(1), k.size(2), dim, launch::kernel_dtype(q.scalar_type()),
                                                     launch::current_stream(q)),
                       "decode_attention");
    return out.transpose(1, 2);
  }
#endif
  return attention(q, k, v, allowed);
}

at::Tensor decode_step_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                                 at::Tensor& keys, at::Tensor& values, const at::Tensor& allowed, const at::Tensor& columns) {
#ifdef LOOM_WITH_CUDA
  if (at::GradMode::is_enabled() || !q.is_cuda() || !launch::kernels_take(q) || q.dim() != 4 || q.size(1) != 1 || k.dim() != 4 || v.sizes() != k.sizes())
    return {};
  const auto batch = q.size(0), heads = q.size(2), kv_heads = k.size(2), dim = q.size(3);
  const auto dtype = q.scalar_type();
  const auto same = [&](const at::Tensor& t) { return t.scalar_type() == dtype && t.device() == q.device() && t.is_contiguous(); };
  if (dim % 64 != 0 || dim > 256 || k.size(0) != batch || k.size(1) != 1 || k.size(3) != dim || kv_heads < 1 || heads % kv_heads != 0 ||
      !same(q) || !same(k) || !same(v) || !same(keys) || !same(values) || keys.dim() != 4 || keys.sizes() != values.sizes() ||
      keys.size(0) != batch || keys.size(1) != kv_heads || keys.size(3) != dim || cos.sizes() != sin.sizes() || cos.numel() != batch * dim ||
      cos.scalar_type() != dtype || sin.scalar_type() != dtype || cos.device() != q.device() || sin.device() != q.device() || !allowed.defined() ||
      allowed.device() != q.device() || allowed.scalar_type() != at::kBool ||
      allowed.numel() != batch * keys.size(2) || columns.scalar_type() != at::kLong || columns.numel() != batch || columns.device() != q.device())
    return {};
  const at::Tensor c = cos.contiguous(), s = sin.contiguous(), at_column = columns.contiguous(), seen = allowed.reshape({batch, keys.size(2)}).contiguous();
  at::Tensor out = at::empty_like(q);  // [B, 1, H, d]
  detail::DecodeStepToken token;
  token.key = k.data_ptr();
  token.value = v.data_ptr();
  token.cos = c.data_ptr();
  token.sin = s.data_ptr();
  token.column = at_column.data_ptr<std::int64_t>();
  launch::check_cuda(detail::decode_attention_cuda(q.data_ptr(), keys.data_ptr(), values.data_ptr(), seen.data_ptr<bool>(), out.data_ptr(), batch, heads,
                                                   kv_heads, keys.size(2), dim, launch::kernel_dtype(dtype), launch::current_stream(q), &token),
                     "decode_step_attention");
  return out.transpose(1, 2);
#else
  (void)q, (void)k, (void)v, (void)cos, (void)sin, (void)keys, (void)values, (void)allowed, (void)columns;
  return {};
#endif
}

bool greedy_decode_step(const at::Tensor& logits, GreedyStepRows& rows, std::int64_t eos, std::int64_t max_new, std::int64_t capacity) {
#ifdef LOOM_WITH_CUDA
  if (!logits.is_cuda() || logits.dim() != 2 || logits.stride(1) != 1 || !launch::kernels_take(logits)) return false;
  const std::int64_t r = logits.size(0);
  const auto fits = [&](const at::Tensor& t, at::ScalarType type, std::int64_t numel) {
    return t.scalar_type() == type && t.is_contiguous() && t.numel() == numel && t.device() == logits.device();
  };
  if (!fits(rows.last, at::kLong, r) || !fits(rows.position, at::kLong, r) || !fits(rows.column, at::kLong, r) || !fits(rows.count, at::kLong, r) ||
      !fits(rows.tokens, at::kLong, r * (max_new + 1)) || rows.tokens.dim() != 2 || rows.tokens.size(1) != max_new + 1 || !fits(rows.done, at::kBool, r) ||
      !fits(rows.bad, at::kBool, 1))
    return false;
  const c10::cuda::CUDAGuard on_device(logits.device());  // the launch's device, as its stream's
  detail::GreedyStepRows state;
  state.last = rows.last.data_ptr<std::int64_t>();
  state.position = rows.position.data_ptr<std::int64_t>();
  state.column = rows.column.data_ptr<std::int64_t>();
  state.tokens = rows.tokens.data_ptr<std::int64_t>();
  state.count = rows.count.data_ptr<std::int64_t>();
  state.done = rows.done.data_ptr<bool>();
  state.bad = rows.bad.data_ptr<bool>();
  launch::check_cuda(detail::greedy_step_cuda(logits.data_ptr(), r, logits.size(1), logits.stride(0), state, eos, max_new, capacity,
                                              launch::kernel_dtype(logits.scalar_type()), launch::current_stream(logits)),
                     "greedy_decode_step");
  return true;
#else
  (void)logits, (void)rows, (void)eos, (void)max_new, (void)capacity;
  return false;
#endif
}

}  // namespace loom::kit
