#include "runtime/folded_adapters.hpp"

#include <map>
#include <set>

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/kit/torch_compat.hpp"

namespace loom::core {
namespace {

std::uint64_t bytes_of(const at::Tensor& t) { return static_cast<std::uint64_t>(t.numel()) * t.element_size(); }

std::int64_t parameters_of(const LinearAdapter& adapter) {
  std::int64_t n = 0;
  for (const auto& p : adapter.parameters()) n += p.numel();
  return n;
}

// The name `adapter` is registered under in `layer`.
std::string child_name(AdaptableLinear& layer, const LinearAdapter& adapter) {
  for (const auto& child : layer.named_children())
    if (child.value().get() == static_cast<const torch::nn::Module*>(&adapter)) return child.key();
  return {};
}

// A layer whose adapter can fold into its weight: a dense float32 base (tensor shards included).
// A 16-bit weight would round W + D to its 8 or 11 bits, which can take a trained adapter's small
// entries (1e-4 beside weights of 1e-2) half away or all: those stay apart.
DenseWeight* foldable_base(AdaptableLinear& layer) {
  if (!layer.adapter() || dynamic_cast<FoldableDelta*>(layer.adapter().get()) == nullptr) return nullptr;
  auto* dense = dynamic_cast<DenseWeight*>(&layer.base());
  return dense != nullptr && dense->weight.scalar_type() == at::kFloat ? dense : nullptr;
}

}  // namespace

FoldedAdapters::FoldedAdapters(LoadedModel& model, FoldFor what, const AgreeOnFolds& agree) {
  torch::NoGradGuard no_grad;
  // One choice a linear this rank holds, in the model's order: the same layers on every rank of a
  // tensor group. A layer or weight listed twice (a plugin's shared module) folds once.
  std::vector<AdaptableLinear*> layers;
  std::vector<double> fold;
  std::set<const void*> seen;
  std::map<int, std::uint64_t> copies_on_gpu;  // kWhileEvaluating: bytes each GPU would keep
  for (const auto& l : model.linears()) {
    if (!l.layer) continue;
    DenseWeight* base = foldable_base(*l.layer);
    // The adapter's products cost at least an eighth of the base's: worth a product fewer, and the
    // copy evaluation keeps is at most 8x the adapter.
    bool wanted = base != nullptr && parameters_of(*l.layer->adapter()) * 8 >= base->weight.numel() && seen.insert(l.layer).second &&
                  seen.insert(base).second;
    if (wanted && what == FoldFor::kWhileEvaluating && base->weight.is_cuda()) copies_on_gpu[base->weight.get_device()] += bytes_of(base->weight);
    layers.push_back(l.layer);
    fold.push_back(wanted ? 1 : 0);
  }
  // A GPU keeps the copies only where they leave room for generation's cache beside them.
  for (const auto& [index, bytes] : copies_on_gpu) {
    const auto available = kit::compat::cuda_available(index);
    if (available && *available / 2 >= bytes) continue;
    spdlog::info("evaluation computes its adapters apart on cuda:{}: folding them in would keep {} bytes of weights beside them", index, bytes);
    for (std::size_t i = 0; i < layers.size(); ++i)
      if (fold[i] > 0 && layers[i]->base().options().device() == c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index))) fold[i] = 0;
  }
  if (agree && !fold.empty()) fold = agree(std::move(fold));
  folded_.reserve(layers.size());
  try {
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (fold[i] <= 0) continue;
      AdaptableLinear* layer = layers[i];
      auto& base = static_cast<DenseWeight&>(layer->base());
      Folded f{layer, child_name(*layer, *layer->adapter()), layer->adapter(), at::Tensor()};
      const at::Tensor delta = dynamic_cast<FoldableDelta&>(*f.adapter).folded_delta();
      if (what == FoldFor::kWhileEvaluating) {
        f.original = base.weight.clone();
        copied_bytes_ += bytes_of(f.original);
      }
      folded_.push_back(std::move(f));  // before the weight changes: unfold() then sees it whatever follows
      base.add_(delta);
      layer->detach();
    }
  } catch (...) {
    unfold();
    throw;
  }
}

FoldedAdapters::~FoldedAdapters() { unfold(); }

void FoldedAdapters::unfold() noexcept {
  torch::NoGradGuard no_grad;
  for (auto f = folded_.rbegin(); f != folded_.rend(); ++f) {
    if (!f->original.defined()) continue;  // folded for good
    try {
      static_cast<DenseWeight&>(f->layer->base()).weight.copy_(f->original);
      if (!f->layer->adapter()) f->layer->attach(f->adapter_name, f->adapter);
      f->adapter->train(f->layer->is_training());  // the model's mode may have changed while it was off (dropout)
    } catch (const std::exception& e) {
      spdlog::error("evaluation could not put back the trained weight of a layer its adapter was folded into: {}", e.what());
    }
  }
  folded_.clear();
}

}  // namespace loom::core
