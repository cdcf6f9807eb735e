#pragma once
// Adapters folded into their base weights while the model runs without gradients (evaluation,
// `loom generate`): a layer computes x (W + D)^T, one product, where base(x) + delta(x) takes three
// (LoRA: the base's, x A^T and its product with B). Only adapters that offer FoldableDelta, over
// dense float32 bases (a 4-bit one would need a full-precision copy, a 16-bit one would round D
// away), and only where the adapter holds at least an eighth of the base's parameters, so its
// products cost at least that share of the layer's; evaluation and `loom generate` choose alike,
// so they give the same tokens. A folded layer's adapter is detached meanwhile.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/layers.hpp"
#include "loom/model.hpp"

namespace loom::core {

enum class FoldFor {
  // Evaluation inside a run: training goes on after it, from bit-identical weights, so a copy of
  // each folded weight is kept meanwhile (at most 8x its adapter), on a GPU only where half its free
  // memory holds the copies.
  kWhileEvaluating,
  // `loom generate`: the adapter is never trained again, so the layers fold for good, with no copy
  // (as merging does).
  kGood,
};

// The least of each value over the ranks that hold parts of the same layers (a tensor group).
using AgreeOnFolds = std::function<std::vector<double>(std::vector<double>)>;

class FoldedAdapters {
 public:
  // Under tensor parallelism every rank of the group must fold the same layers (a row-parallel
  // LoRA sums its low-rank product over the group): `agree` takes each rank's choices (1: fold) and
  // returns the group's least. Without it the choices stand as made here.
  FoldedAdapters(LoadedModel& model, FoldFor what, const AgreeOnFolds& agree = {});
  // kWhileEvaluating: every weight back bit for bit and every adapter attached again as it was.
  ~FoldedAdapters();
  FoldedAdapters(const FoldedAdapters&) = delete;
  FoldedAdapters& operator=(const FoldedAdapters&) = delete;

  std::size_t layers() const { return folded_.size(); }
  std::uint64_t copied_bytes() const { return copied_bytes_; }

 private:
  struct Folded {
    AdaptableLinear* layer;
    std::string adapter_name;  // the submodule name to attach it under again
    std::shared_ptr<LinearAdapter> adapter;
    at::Tensor original;  // the weight before, kWhileEvaluating
  };
  void unfold() noexcept;

  std::vector<Folded> folded_;
  std::uint64_t copied_bytes_ = 0;
};

}  // namespace loom::core
