// Generation's few-row products (blocks.hpp, product_kernels.hpp): which layers the kernel takes,
// and what the layers' forward adds after it.
#include <typeinfo>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/kit/blocks.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/layers.hpp"
#include "kernel_launch.hpp"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "product_kernels.hpp"
#endif

namespace loom::kit {

#ifdef LOOM_WITH_CUDA
namespace {

// x as the kernel reads it, with its row count; undefined where the kernel does not take it.
struct FewRows {
  at::Tensor input;
  std::int64_t rows = 0, in = 0;
};

FewRows few_rows(const at::Tensor& x) {
  if (at::GradMode::is_enabled() || !x.is_cuda() || !launch::kernels_take(x) || x.dim() < 1 || x.size(-1) < 1 || x.numel() == 0) return {};
  const std::int64_t in = x.size(-1), rows = x.numel() / in;
  if (rows > detail::kFewRowsMax) return {};
  return {x.contiguous(), rows, in};
}

// A dense [out, in] weight as weight s of the group: whole (not a tensor shard, whose forward
// communicates), on x's device, in its dtype, and contiguous: the kernel reads weights before the
// kernel ahead of it ends (cuda_elements.cuh), so never a copy made just before it.
bool describe_dense(const FewRows& x, const at::Tensor& w, int s, detail::ProductGroup& g, std::vector<at::Tensor>& kept) {
  if (g.quantized || w.dim() != 2 || w.size(1) != x.in || w.device() != x.input.device() || w.scalar_type() != x.input.scalar_type() ||
      !w.is_contiguous())
    return false;
  g.dense[s] = kept.emplace_back(w).data_ptr();
  g.out[s] = w.size(0);
  return true;
}

// A 4-bit [out, in] weight as weight s of the group (whose weights are then all 4-bit): its codes
// and every scale tensor on x's device and contiguous (as describe_dense, no copy before the kernel).
bool describe_codes(const FewRows& x, const QuantizedTensor& q, int s, detail::ProductGroup& g, std::vector<at::Tensor>& kept) {
  const auto device = x.input.device();
  const auto usable = [&](const at::Tensor& t) { return t.defined() && t.device() == device && t.is_contiguous(); };
  if ((s > 0 && !g.quantized) || !usable(q.packed) || !usable(q.absmax) || q.shape.size() != 2 || q.shape[1] != x.in) return false;
  if (q.double_quantized() && (!usable(q.nested_absmax) || !usable(q.nested_map))) return false;
  // Enough codes and scales for the shape: the kernel reads them all.
  const std::int64_t n = q.numel(), blocks = q.blocksize > 0 ? (n + q.blocksize - 1) / q.blocksize : -1;
  if (q.packed.scalar_type() != at::kByte || q.packed.numel() < (n + 1) / 2 || blocks < 0 || q.absmax.numel() < blocks) return false;
  if (q.double_quantized() &&
      (q.nested_blocksize < 1 || q.nested_absmax.numel() < (blocks + q.nested_blocksize - 1) / q.nested_blocksize || q.nested_map.numel() < 256))
    return false;
  g.quantized = true;
  g.codes[s] = launch::dequantize_args(q, kept);
  g.out[s] = q.shape[0];
  return true;
}

// One weight of the group from a layer's base, dense or 4-bit computing in x's dtype.
bool describe(const FewRows& x, const LinearWeight& base, int s, detail::ProductGroup& g, std::vector<at::Tensor>& kept) {
  if (typeid(base) == typeid(DenseWeight)) return describe_dense(x, static_cast<const DenseWeight&>(base).weight, s, g, kept);
  const auto* quantized = dynamic_cast<const QuantizedWeight*>(&base);
  return quantized != nullptr && quantized->compute_dtype() == x.input.scalar_type() && describe_codes(x, quantized->quantized(), s, g, kept);
}

// Outputs [..., out[s]] for the group's weights (one for SwiGLU) and the kernel run into them;
// empty where the kernel does not take the group.
std::vector<at::Tensor> run(const FewRows& x, detail::ProductGroup& g, const at::Tensor& original) {
  std::vector<at::Tensor> out;
  const int outputs = g.finish == detail::ProductFinish::kSwiGLU ? 1 : g.count;
  auto sizes = original.sizes().vec();
  for (int s = 0; s < outputs; ++s) {
    sizes.back() = g.out[s];
    g.y[s] = out.emplace_back(at::empty(sizes, original.options())).data_ptr();
  }
  const auto dtype = launch::kernel_dtype(x.input.scalar_type());
  if (!detail::few_row_products_supported(g, x.input.data_ptr(), x.rows, x.in, dtype)) return {};
  const c10::cuda::CUDAGuard guard(x.input.device());
  launch::check_cuda(detail::few_row_products_cuda(g, x.input.data_ptr(), x.rows, x.in, dtype, launch::current_stream(x.input)), "few_row_products");
  return out;
}

bool plain(const AdaptableLinear& layer) { return !layer.bias.defined() && !layer.adapter(); }

}  // namespace

std::vector<at::Tensor> few_row_products(const at::Tensor& x, const std::vector<AdaptableLinear*>& layers) {
  const FewRows rows = few_rows(x);
  if (!rows.input.defined() || layers.empty() || layers.size() > static_cast<std::size_t>(detail::kMaxGroupedWeights)) return {};
  detail::ProductGroup g;
  g.count = static_cast<int>(layers.size());
  std::vector<at::Tensor> kept;
  for (int s = 0; s < g.count; ++s)
    if (!describe(rows, layers[static_cast<std::size_t>(s)]->base(), s, g, kept)) return {};
  std::vector<at::Tensor> out = run(rows, g, x);
  for (std::size_t s = 0; s < out.size(); ++s) {
    AdaptableLinear& layer = *layers[s];
    if (layer.bias.defined()) out[s] = out[s] + layer.bias;
    if (layer.adapter()) out[s] = out[s] + layer.adapter()->delta(x);
  }
  return out;
}

at::Tensor few_row_product_add(const at::Tensor& x, AdaptableLinear& layer, const at::Tensor& residual) {
  if (!plain(layer)) {
    const auto product = few_row_products(x, {&layer});
    return product.empty() ? at::Tensor() : residual + product.front();
  }
  const FewRows rows = few_rows(x);
  if (!rows.input.defined() || residual.scalar_type() != x.scalar_type() || residual.device() != x.device()) return {};
  detail::ProductGroup g;
  g.count = 1;
  g.finish = detail::ProductFinish::kAddResidual;
  std::vector<at::Tensor> kept;
  if (!describe(rows, layer.base(), 0, g, kept)) return {};
  auto sizes = x.sizes().vec();
  sizes.back() = g.out[0];
  if (residual.sizes().vec() != sizes) return {};
  g.residual = kept.emplace_back(residual.contiguous()).data_ptr();
  const auto out = run(rows, g, x);
  return out.empty() ? at::Tensor() : out.front();
}

at::Tensor few_row_swiglu(const at::Tensor& x, AdaptableLinear& gate, AdaptableLinear& up) {
  if (!plain(gate) || !plain(up)) {
    const auto products = few_row_products(x, {&gate, &up});
    return products.empty() ? at::Tensor() : swiglu(products[0], products[1]);
  }
  const FewRows rows = few_rows(x);
  if (!rows.input.defined()) return {};
  detail::ProductGroup g;
  g.count = 2;
  g.finish = detail::ProductFinish::kSwiGLU;
  std::vector<at::Tensor> kept;
  if (!describe(rows, gate.base(), 0, g, kept) || !describe(rows, up.base(), 1, g, kept)) return {};
  const auto out = run(rows, g, x);
  return out.empty() ? at::Tensor() : out.front();
}

at::Tensor few_row_linear(const at::Tensor& x, const at::Tensor& weight) {
  const FewRows rows = few_rows(x);
  detail::ProductGroup g;
  g.count = 1;
  std::vector<at::Tensor> kept;
  if (!rows.input.defined() || !describe_dense(rows, weight, 0, g, kept)) return {};
  const auto out = run(rows, g, x);
  return out.empty() ? at::Tensor() : out.front();
}

at::Tensor linear_from_codes(const at::Tensor& x, const QuantizedTensor& q) {
  torch::NoGradGuard no_grad;
  const FewRows rows = few_rows(x);
  detail::ProductGroup g;
  g.count = 1;
  std::vector<at::Tensor> kept;
  if (!rows.input.defined() || !describe_codes(rows, q, 0, g, kept)) return {};
  const auto out = run(rows, g, x);
  return out.empty() ? at::Tensor() : out.front();
}

#else
// Without CUDA the layers compute these themselves: every answer is empty.
std::vector<at::Tensor> few_row_products(const at::Tensor&, const std::vector<AdaptableLinear*>&) { return {}; }
at::Tensor few_row_product_add(const at::Tensor&, AdaptableLinear&, const at::Tensor&) { return {}; }
at::Tensor few_row_swiglu(const at::Tensor&, AdaptableLinear&, AdaptableLinear&) { return {}; }
at::Tensor few_row_linear(const at::Tensor&, const at::Tensor&) { return {}; }
at::Tensor linear_from_codes(const at::Tensor&, const QuantizedTensor&) { return {}; }
#endif

}  // namespace loom::kit
