#include "distributed/data_parallel.hpp"

#include <map>

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

namespace loom::core {
namespace {

// Tells the sync that its parameter's gradient has been accumulated for this backward.
struct ReadyHook final : torch::autograd::FunctionPostHook {
  ReadyHook(GradientSync* sync, std::size_t index) : sync_(sync), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) override {
    sync_->ready(index_);
    return outputs;
  }
  GradientSync* sync_;
  std::size_t index_;
};

}  // namespace

GradientSync::GradientSync(Communicator& group, std::vector<NamedParameter> params, c10::Device group_device, std::size_t bucket_bytes)
    : group_(group), params_(std::move(params)), group_device_(group_device) {
  bucket_of_.assign(params_.size(), 0);
  // Backwards through the parameters, the order the backward pass produces their gradients; open
  // buckets by (device, dtype), each closing when it passes bucket_bytes.
  std::map<std::pair<std::string, int>, std::size_t> open;
  for (std::size_t k = params_.size(); k-- > 0;) {
    const auto& t = params_[k].tensor;
    const auto key = std::make_pair(t.device().str(), static_cast<int>(t.scalar_type()));
    auto it = open.find(key);
    if (it == open.end()) {
      buckets_.push_back({{}, t.device(), t.scalar_type(), 0});
      it = open.emplace(key, buckets_.size() - 1).first;
    }
    Bucket& b = buckets_[it->second];
    b.members.push_back(k);
    bucket_of_[k] = it->second;
    b.numel += t.numel();
    if (static_cast<std::size_t>(b.numel) * t.element_size() >= bucket_bytes) open.erase(it);
  }
  if (group_.size() == 1) return;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[k].tensor);
    if (!accumulator) continue;  // not a leaf that trains: finish() sends zeros for it
    accumulator->add_post_hook(std::make_unique<ReadyHook>(this, k));
    accumulators_.push_back(std::move(accumulator));
  }
}

GradientSync::~GradientSync() = default;

void GradientSync::start_round() {
  ready_count_.assign(buckets_.size(), 0);
  next_ = 0;
  flats_.assign(buckets_.size(), at::Tensor());
  pending_.clear();
  pending_.resize(buckets_.size());
}

void GradientSync::arm() {
  if (group_.size() == 1) return;
  std::lock_guard<std::mutex> lock(mutex_);
  armed_ = true;
  start_round();
}

void GradientSync::ready(std::size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_) return;  // an earlier micro-batch: gradients accumulate locally
  ++ready_count_[bucket_of_[index]];
  launch_in_order();
}

void GradientSync::launch_in_order() {
  while (next_ < buckets_.size() && ready_count_[next_] == buckets_[next_].members.size()) launch(next_++);
}

void GradientSync::launch(std::size_t k) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  for (auto i : buckets_[k].members) {
    const auto& p = params_[i].tensor;
    parts.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}, p.options()));
  }
  at::Tensor flat = at::cat(parts);
  if (flat.device().type() != group_device_.type()) flat = flat.to(group_device_);
  std::vector<at::Tensor> one{flat};
  pending_[k] = group_.all_reduce(one, ReduceOp::kSum);
  flats_[k] = flat;
}

void GradientSync::finish() {
  if (group_.size() == 1) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_ = false;
    if (!logged_) {
      spdlog::debug("gradient sync: {} of {} buckets were launched during the backward pass", next_, buckets_.size());
      logged_ = true;
    }
    if (ready_count_.size() != buckets_.size()) start_round();  // never armed: nothing launched yet
    while (next_ < buckets_.size()) launch(next_++);
  }
  torch::NoGradGuard no_grad;
  for (std::size_t k = 0; k < buckets_.size(); ++k) {
    pending_[k]->wait();
    const auto& b = buckets_[k];
    const at::Tensor flat = flats_[k].device() == b.device ? flats_[k] : flats_[k].to(b.device);
    std::int64_t offset = 0;
    for (auto i : b.members) {
      auto& p = params_[i].tensor;
      const at::Tensor part = flat.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
      if (p.grad().defined()) p.mutable_grad().copy_(part);
      else p.mutable_grad() = part.clone();
    }
  }
  ready_count_.clear();
}

}  // namespace loom::core
