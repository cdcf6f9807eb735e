#pragma once
// Building blocks model plugins share (llama.cpp's lesson: one place for attention, norms and the
// point where adapters hook in), so every architecture gets them right once.
#include <cstdint>
#include <memory>
#include <string>

#include <torch/nn/module.h>

#include "loom/export.hpp"

namespace loom {

// What an adapter adds to one linear layer: out = base(x) + delta(x). Created by adapter plugins
// on the device and dtype of the layer it extends.
class LOOM_API LinearAdapter : public torch::nn::Module {
 public:
  ~LinearAdapter() override;
  virtual at::Tensor delta(const at::Tensor& x) = 0;
};

// Every linear layer an adapter may target. Model plugins build their projections from it; adapter
// plugins attach to it and never need to know the architecture.
class LOOM_API AdaptableLinear : public torch::nn::Module {
 public:
  AdaptableLinear(std::int64_t in_features, std::int64_t out_features, bool bias, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);

  // Registers `adapter` as submodule `name`; replaces any previous one.
  void attach(const std::string& name, std::shared_ptr<LinearAdapter> adapter);
  void detach();
  const std::shared_ptr<LinearAdapter>& adapter() const { return adapter_; }

  const std::int64_t in_features;
  const std::int64_t out_features;
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // undefined when the layer has none

 private:
  std::string adapter_name_;
  std::shared_ptr<LinearAdapter> adapter_;
};

// RMSNorm with statistics in fp32 and the result cast back before the weight, as HF computes it.
LOOM_API at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rotary embedding in the half-split convention (HF's rotate_half). x: [B, heads, T, d];
// cos, sin: [B, T, d].
LOOM_API at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Which keys each query may see: [B, 1, T, S] bool, causal over positions S-T.. S-1 and blind to
// padding. A query always sees itself, so a padding row never softmaxes over nothing (NaN).
LOOM_API at::Tensor attention_allowed(const at::Tensor& attention_mask, std::int64_t query_len);

// Softmax attention with grouped-query heads: q [B, H, T, d], k and v [B, KV, S, d], allowed as
// above, or undefined for plain causal attention when nothing is padded or cached. Uses
// LibTorch's fused SDPA where it has one, the exact formula otherwise.
LOOM_API at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed);

}  // namespace loom
