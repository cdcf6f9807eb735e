#pragma once
// The linear layer every model builds its projections from and every adapter attaches to: the
// point where a model, an adapter and a weight's storage meet without knowing one another.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "loom/capability.hpp"
#include "loom/export.hpp"

namespace loom {

struct TensorShard;  // loom/model.hpp

// What an adapter adds to one linear layer: out = base(x) + delta(x). Created by adapter plugins
// on the device and dtype of the layer it extends.
class LOOM_API LinearAdapter : public torch::nn::Module {
 public:
  ~LinearAdapter() override;
  virtual at::Tensor delta(const at::Tensor& x) = 0;
};

// Capability of a LinearAdapter (SDK 3.5) that adds its delta to the base's output in place, y +=
// delta(x), where a product can write into y itself (a GEMM's accumulate) instead of making a
// [tokens, out] delta and summing it. y is the base's fresh output; the result must equal
// y + delta(x), gradients included.
class LOOM_API DeltaAddedInPlace : public Capability {
 public:
  ~DeltaAddedInPlace() override;
  virtual void add_delta_to(at::Tensor& y, const at::Tensor& x) = 0;
};

// Capability of a LinearAdapter (SDK 3.7) whose delta is one matrix outside training: delta(x) =
// x D^T (no dropout, nothing else). Generation folds D into a dense base weight, where the adapter's
// products would cost a good share of the layer's, and takes it out again after; merging uses it.
class LOOM_API FoldableDelta : public Capability {
 public:
  ~FoldableDelta() override;
  // D in float32, [out, in] as base() holds its part of the layer (a tensor-parallel rank's rows or
  // columns), with no communication.
  virtual at::Tensor folded_delta() const = 0;
};

// The matrix under a linear layer, y = x W^T + b, as it is stored: dense today; a sharded or a
// 4-bit weight is another implementation, and adapters on top never need to know which.
class LOOM_API LinearWeight : public torch::nn::Module {
 public:
  ~LinearWeight() override;
  // x W^T + bias (bias may be undefined). The weight applies the bias once: a row-sharded weight
  // adds it after its reduction. Return a tensor of its own (not a view of one it keeps, nor one
  // its backward saves): an adapter with DeltaAddedInPlace accumulates into it.
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
  // How the weight is split over a tensor-parallel group: whole unless overridden.
  virtual TensorShard shard() const;
  // Fills stored tensor `suffix` ("weight", or a part such as "weight.absmax") from a
  // checkpoint or random init, as the whole layer's tensor. The default copies into stored()'s
  // tensor of that suffix; a 4-bit weight quantizes a full-precision "weight" as it arrives.
  // UserError (what is wrong, without the name: the caller adds it) when it does not fit.
  virtual void assign(const std::string& suffix, const at::Tensor& value);
  // After a checkpoint is read; UserError naming `name` when parts are missing.
  virtual void finish_load(const std::string& name);
};

// A plain [out, in] matrix in the compute dtype (the base of a tensor shard: loom::kit::ShardedWeight).
class LOOM_API DenseWeight : public LinearWeight {
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

// Capability of a LinearAdapter (SDK 3.6) that computes the whole layer, base(x) + delta(x), as one
// differentiable product over a frozen base: in backward the input's gradient from the base and
// from the adapter come out of one buffer (the adapter's product accumulating into the base's),
// where autograd would make two [tokens, in] gradients and sum them. x: [tokens, in]. Returns
// undefined where it does not serve (a base it does not know, a weight that learns); the layer then
// uses DeltaAddedInPlace or delta(). The result must equal base.forward(x, bias) + delta(x),
// gradients included.
class LOOM_API WholeProduct : public Capability {
 public:
  ~WholeProduct() override;
  virtual at::Tensor forward_with(LinearWeight& base, const at::Tensor& x, const at::Tensor& bias) = 0;
};

// Every linear layer an adapter may target. Model plugins build their projections from it; adapter
// plugins attach to it and never need to know the architecture or how the base weight is stored.
class LOOM_API AdaptableLinear : public torch::nn::Module {
 public:
  // A dense layer.
  AdaptableLinear(std::int64_t in_features, std::int64_t out_features, bool bias, const at::TensorOptions& options);
  // A layer over `base` (a sharded or quantized weight) of the whole layer's sizes; `bias` as this
  // rank adds it (undefined: none).
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

}  // namespace loom
