#include "runtime/host_split.hpp"

#include <map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/kit/tensor_parallel.hpp"
#include "loom/layers.hpp"

namespace loom::core {

std::vector<LinearInfo> declared_splits(const ModelStructure& structure) {
  std::vector<LinearInfo> out;
  for (const auto& block : structure.blocks)
    for (const auto& l : block.linears)
      if (l.parallel != ParallelStyle::kReplicated) out.push_back(l);
  return out;
}

std::string host_split_refusal(const ModelStructure& structure, int tensor, std::vector<std::string>& notes) {
  const auto splits = declared_splits(structure);
  if (splits.empty()) return "it neither splits itself (it offers no TensorParallelModel) nor declares how its linears split";
  std::size_t columns = 0;
  for (const auto& l : splits) {
    const bool column = l.parallel == ParallelStyle::kColumn;
    const std::int64_t cut = column ? l.out_features : l.in_features;
    if (cut % tensor != 0)
      return l.name + "'s " + std::to_string(cut) + (column ? " outputs" : " inputs") + " do not split over " + std::to_string(tensor) +
             " tensor ranks; use a tensor size that divides them";
    columns += column ? 1 : 0;
  }
  notes.push_back("split by the host as the model declares: " + std::to_string(columns) + " linears by column, " + std::to_string(splits.size() - columns) +
                  " by row; every other weight (the embedding and the head too) whole on every tensor rank");
  return "";
}

namespace {

// A model whose declared linears the host split: forwards everything, and says (and gathers for
// saving) what is split.
class HostSplitModel final : public LoadedModel {
 public:
  HostSplitModel(std::unique_ptr<LoadedModel> inner, const ModelStructure& structure, Communicator& group, const BaseStoringAdapter* storing)
      : inner_(std::move(inner)), group_(group) {
    std::map<std::string, ParallelStyle> declared;
    for (const auto& l : declared_splits(structure)) declared[l.name] = l.parallel;
    torch::NoGradGuard no_grad;
    for (const auto& l : inner_->linears()) {
      const auto style = declared.find(l.name);
      if (l.layer == nullptr || style == declared.end()) continue;
      split(l.name, *l.layer, TensorShard{style->second, &group_}, storing);
    }
  }

  std::size_t block_count() const override { return inner_->block_count(); }
  void forward(std::size_t index, ForwardState& state) override { inner_->forward(index, state); }
  at::Tensor loss_sum(const at::Tensor& head_output, const at::Tensor& labels) override { return inner_->loss_sum(head_output, labels); }
  at::Tensor logits(const at::Tensor& head_output) override { return inner_->logits(head_output); }
  std::vector<NamedLinear> linears() override { return inner_->linears(); }
  void set_training(bool training) override { inner_->set_training(training); }

  // The model's own list, a split linear's tensors read from the linear as it now is (its part).
  std::vector<NamedParameter> parameters() override {
    auto out = inner_->parameters();
    for (auto& p : out)
      if (const auto it = split_.find(p.name); it != split_.end())
        for (const auto& [suffix, tensor] : it->second.layer->stored())
          if (it->second.linear + "." + suffix == p.name) p.tensor = tensor;
    return out;
  }

  int shard_dim(const std::string& name) const override {
    const auto it = split_.find(name);
    return it != split_.end() ? it->second.dim : inner_->shard_dim(name);
  }

  // Every rank gathers the whole of each split tensor; the first hands the whole linears to the
  // model's own saving, then takes its parts back.
  void save_pretrained(const std::filesystem::path& dir) override {
    torch::NoGradGuard no_grad;
    std::vector<std::pair<Split*, at::Tensor>> wholes;
    for (auto& [name, s] : split_)
      if (name == s.linear + ".weight") wholes.emplace_back(&s, kit::gather_shards(s.layer->base().dense(), s.dim, -1, group_));
    std::map<AdaptableLinear*, at::Tensor> biases;
    for (auto& [name, s] : split_)
      if (name == s.linear + ".bias") biases[s.layer] = kit::gather_shards(s.layer->bias, 0, -1, group_);
    if (group_.rank() != 0) return;
    std::vector<std::tuple<AdaptableLinear*, std::shared_ptr<LinearWeight>, at::Tensor>> held;
    for (auto& [s, whole] : wholes) {
      auto dense = std::make_shared<DenseWeight>(s->layer->in_features, s->layer->out_features, whole.options());
      dense->assign("weight", whole);
      const auto b = biases.find(s->layer);
      held.emplace_back(s->layer, s->weight, b != biases.end() ? s->layer->bias.data() : at::Tensor());
      s->layer->replace_base(dense);
      if (b != biases.end()) s->layer->bias.set_data(b->second);  // the same tensor (the optimizer's) holds the whole for a while
    }
    try {
      inner_->save_pretrained(dir);
    } catch (...) {
      restore(held);
      throw;
    }
    restore(held);
  }

 private:
  struct Split {
    std::string linear;
    AdaptableLinear* layer = nullptr;
    int dim = -1;
    std::shared_ptr<LinearWeight> weight;  // the part the layer computes with
  };

  // The layer's weight cut to this rank's part: a split dense weight, or the adapter's storage of
  // the part (4-bit) in a split weight.
  void split(const std::string& name, AdaptableLinear& layer, const TensorShard& shard, const BaseStoringAdapter* storing) {
    const bool column = shard.style == ParallelStyle::kColumn;
    const int dim = column ? 0 : 1;
    const at::Tensor whole = layer.base().dense();
    const at::Tensor part = kit::part_of_pieces(whole, dim, {}, shard.rank(), shard.size());
    std::shared_ptr<LinearWeight> weight;
    if (storing != nullptr)
      if (auto stored = storing->base_weight(LinearInfo{name, part.size(1), part.size(0), shard.style}, whole.options())) {
        stored->assign("weight", part);
        stored->finish_load(name);
        weight = std::make_shared<kit::SplitWeight>(std::move(stored), shard);
      }
    if (!weight) {
      auto dense = std::make_shared<kit::ShardedWeight>(layer.in_features, layer.out_features, shard, whole.options());
      dense->assign("weight", part);
      weight = dense;
    }
    layer.replace_base(weight);
    split_[name + ".weight"] = {name, &layer, dim, weight};
    if (column && layer.bias.defined()) {
      layer.bias.set_data(kit::part_of_pieces(layer.bias.data(), 0, {}, shard.rank(), shard.size()).clone());
      split_[name + ".bias"] = {name, &layer, 0, weight};
    }
  }

  void restore(const std::vector<std::tuple<AdaptableLinear*, std::shared_ptr<LinearWeight>, at::Tensor>>& held) {
    for (const auto& [layer, weight, bias_part] : held) {
      layer->replace_base(weight);
      if (bias_part.defined()) layer->bias.set_data(bias_part);
    }
  }

  std::unique_ptr<LoadedModel> inner_;
  Communicator& group_;
  std::map<std::string, Split> split_;  // by parameter name ("....weight", a column's "....bias")
};

}  // namespace

std::unique_ptr<LoadedModel> split_by_host(std::unique_ptr<LoadedModel> model, const ModelStructure& structure, Communicator& group,
                                           const BaseStoringAdapter* storing) {
  return std::make_unique<HostSplitModel>(std::move(model), structure, group, storing);
}

}  // namespace loom::core
