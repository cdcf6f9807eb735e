#pragma once
// Building blocks model plugins share (llama.cpp's lesson: one place for attention, norms and the
// point where adapters hook in), so every architecture gets them right once.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "loom/export.hpp"

namespace loom {

struct TensorShard;  // loom/tensor_parallel.hpp

// What an adapter adds to one linear layer: out = base(x) + delta(x). Created by adapter plugins
// on the device and dtype of the layer it extends.
class LOOM_API LinearAdapter : public torch::nn::Module {
 public:
  ~LinearAdapter() override;
  virtual at::Tensor delta(const at::Tensor& x) = 0;
};

// The matrix under a linear layer, y = x W^T + b, as it is stored: dense today; a sharded or a
// 4-bit weight is another implementation, and adapters on top never need to know which.
class LOOM_API LinearWeight : public torch::nn::Module {
 public:
  ~LinearWeight() override;
  // x W^T + bias (bias may be undefined). The weight applies the bias once: a row-sharded weight
  // adds it after its reduction.
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& bias) = 0;
  // W as a dense [out, in] tensor in the compute dtype (a fresh copy for a quantized weight).
  virtual at::Tensor dense() const = 0;
  // W += delta ([out, in], any float dtype, summed in fp32): merging an adapter. Throws UserError
  // where the storage cannot take it.
  virtual void add_(const at::Tensor& delta) = 0;
  // The tensors saved and loaded for this weight, by suffix of the layer's name ("weight", or
  // "weight" + "weight.absmax" for a quantized one), as HF checkpoints name them.
  virtual std::vector<std::pair<std::string, at::Tensor>> stored() = 0;
  // The compute dtype and device: what inputs, outputs and adapters use.
  virtual at::TensorOptions options() const = 0;
  virtual std::uint64_t bytes() const = 0;  // as stored
  // How the weight is split over a tensor-parallel group (SDK 2.1): whole unless overridden.
  virtual TensorShard shard() const;
  // SDK 2.1: fills stored tensor `suffix` ("weight", or a part such as "weight.absmax") from a
  // checkpoint or random init, as the whole layer's tensor. The default copies into stored()'s
  // tensor of that suffix; a 4-bit weight quantizes a full-precision "weight" as it arrives.
  // UserError (what is wrong, without the name: the caller adds it) when it does not fit.
  virtual void assign(const std::string& suffix, const at::Tensor& value);
  // SDK 2.1: after a checkpoint is read; UserError naming `name` when parts are missing.
  virtual void finish_load(const std::string& name);
};

// A plain [out, in] matrix in the compute dtype.
class LOOM_API DenseWeight final : public LinearWeight {
 public:
  DenseWeight(std::int64_t in_features, std::int64_t out_features, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias) override;
  at::Tensor dense() const override { return weight; }
  void add_(const at::Tensor& delta) override;
  std::vector<std::pair<std::string, at::Tensor>> stored() override { return {{"weight", weight}}; }
  at::TensorOptions options() const override { return weight.options(); }
  std::uint64_t bytes() const override;

  at::Tensor weight;  // [out, in]
};

// Every linear layer an adapter may target. Model plugins build their projections from it; adapter
// plugins attach to it and never need to know the architecture or how the base weight is stored.
class LOOM_API AdaptableLinear : public torch::nn::Module {
 public:
  // A dense layer.
  AdaptableLinear(std::int64_t in_features, std::int64_t out_features, bool bias, const at::TensorOptions& options);
  // A layer over `base` (a sharded or quantized weight) of the whole layer's sizes; `bias` as this
  // rank adds it (undefined: none). SDK 2.1.
  AdaptableLinear(std::shared_ptr<LinearWeight> base, std::int64_t in_features, std::int64_t out_features, at::Tensor bias);
  at::Tensor forward(const at::Tensor& x);

  // Registers `adapter` as submodule `name`; replaces any previous one.
  void attach(const std::string& name, std::shared_ptr<LinearAdapter> adapter);
  void detach();
  const std::shared_ptr<LinearAdapter>& adapter() const { return adapter_; }

  LinearWeight& base() { return *base_; }
  const LinearWeight& base() const { return *base_; }
  // Swaps the stored weight (a quantizer or a sharder does this while loading); same shape.
  void replace_base(std::shared_ptr<LinearWeight> base);
  at::TensorOptions options() const { return base_->options(); }
  // The layer's parameters by suffix of its name: the weight's stored tensors, then "bias".
  std::vector<std::pair<std::string, at::Tensor>> stored();

  const std::int64_t in_features;   // the whole layer's, also when base() holds a shard
  const std::int64_t out_features;
  at::Tensor bias;  // undefined when the layer has none; a column-parallel layer's shard

 private:
  std::shared_ptr<LinearWeight> base_;
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
