#include "runtime/executor.hpp"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/devices.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/tensor_parallel.hpp"
#include "loom/layers.hpp"
#include "plugins/plugin_guard.hpp"
#include "runtime/checkpoint_offload.hpp"
#include "runtime/host_split.hpp"

namespace loom::core {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A block run without keeping its activations: forward runs it without a graph and keeps its
// input, the pass's shared tensors and the random state; backward runs it again with a graph and
// backpropagates through that (as torch.utils.checkpoint's reentrant variant does). The block's
// parameters get their gradients from that inner backward. With `offload`, the input waits for
// backward in host memory (runtime/checkpoint_offload), `offload` holding the pass's last one.
struct CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& anchor, std::int64_t model, std::int64_t index,
                            std::int64_t state_address, c10::intrusive_ptr<OffloadedInput>* offload) {
    auto* loaded = reinterpret_cast<LoadedModel*>(static_cast<std::intptr_t>(model));
    auto* state = reinterpret_cast<ForwardState*>(static_cast<std::intptr_t>(state_address));
    const auto rng = kit::random_state(hidden.device());
    state->hidden = hidden;
    loaded->forward(static_cast<std::size_t>(index), *state);
    c10::Dict<std::string, at::Tensor> pass;
    for (const auto& [name, t] : state->pass) pass.insert(name, t.defined() ? t : at::Tensor());
    ctx->saved_data["model"] = model;
    ctx->saved_data["index"] = index;
    ctx->saved_data["pass"] = pass;
    ctx->saved_data["positions"] = state->position_ids;
    ctx->saved_data["mask"] = state->attention_mask;
    ctx->saved_data["rng"] = c10::List<at::Tensor>(rng);
    if (offload != nullptr) {
      *offload = c10::make_intrusive<OffloadedInput>(hidden, *offload);
      ctx->saved_data["offloaded"] = c10::IValue::make_capsule(*offload);
    } else {
      ctx->save_for_backward({hidden});
    }
    (void)anchor;
    return state->hidden;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* loaded = reinterpret_cast<LoadedModel*>(static_cast<std::intptr_t>(ctx->saved_data["model"].toInt()));
    const at::Tensor saved = ctx->saved_data.count("offloaded") != 0
                                 ? c10::static_intrusive_pointer_cast<OffloadedInput>(ctx->saved_data["offloaded"].toCapsule())->take()
                                 : ctx->get_saved_variables().at(0);
    const at::Tensor input = saved.detach().set_requires_grad(saved.is_floating_point());
    ForwardState state;
    state.hidden = input;
    state.position_ids = ctx->saved_data["positions"].toTensor();
    state.attention_mask = ctx->saved_data["mask"].toTensor();
    for (const auto& entry : ctx->saved_data["pass"].toGenericDict()) state.pass[entry.key().toStringRef()] = entry.value().toTensor();
    std::vector<at::Tensor> rng;
    for (const auto& t : ctx->saved_data["rng"].toTensorList()) rng.push_back(t);
    const c10::Device device = input.device();
    const auto now = kit::random_state(device);
    kit::set_random_state(device, rng);
    {
      torch::AutoGradMode grad(true);
      loaded->forward(static_cast<std::size_t>(ctx->saved_data["index"].toInt()), state);
    }
    kit::set_random_state(device, now);
    torch::autograd::backward({state.hidden}, {grads.at(0)});
    return {input.requires_grad() ? input.grad() : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

c10::Device torch_device(const std::string& name) {
  const DeviceName d = parse_device(name);
  return d.is_cuda ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(d.index)) : c10::Device(c10::kCPU);
}

Executor::Executor(std::unique_ptr<LoadedModel> model, std::vector<std::optional<c10::Device>> devices, bool check_devices,
                   std::vector<std::string> block_names)
    : model_(std::move(model)), blocks_(std::move(devices)), check_devices_(check_devices), names_(std::move(block_names)) {
  if (blocks_.size() != model_->block_count())
    throw std::logic_error("executor: " + std::to_string(blocks_.size()) + " devices for " + std::to_string(model_->block_count()) + " blocks");
  for (const auto& d : blocks_)
    if (d) {
      if (std::find(distinct_.begin(), distinct_.end(), *d) == distinct_.end()) distinct_.push_back(*d);
      head_ = *d;
    }
  decoding_ = capability<StaticCacheDecoding>(*model_);
  for (const auto& p : model_->parameters())
    if (p.block >= blocks_.size() || !blocks_[p.block] || p.tensor.device() != *blocks_[p.block])
      throw std::logic_error("model plugin bug: parameter " + p.name + " is on " + p.tensor.device().str() + ", its block's device is " +
                             (p.block < blocks_.size() && blocks_[p.block] ? blocks_[p.block]->str() : "none on this rank"));
}

at::Tensor Executor::head_output(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass* cached) {
  ForwardState state{ids, positions, mask, nullptr, {}};
  if (!blocks_.empty()) run_blocks(0, blocks_.size() - 1, state, cached);
  return state.hidden;
}

void Executor::run_blocks(std::size_t first, std::size_t last, ForwardState& state, CachedPass* cached) {
  if (cached != nullptr && decoding_ == nullptr) throw std::logic_error("executor: a cached pass through a model without StaticCacheDecoding");
  c10::intrusive_ptr<OffloadedInput> last_offloaded;  // this pass's chain of offloaded inputs
  for (std::size_t i = first; i <= last && i < blocks_.size(); ++i) {
    if (!blocks_[i]) continue;
    const auto& device = *blocks_[i];
    if (state.hidden.device() != device) {
      state.hidden = state.hidden.to(device);
      state.position_ids = state.position_ids.to(device);
      state.attention_mask = state.attention_mask.to(device);
      for (auto& [name, t] : state.pass)
        if (t.defined() && !(t.dim() == 0 && t.is_cpu())) t = t.to(device);  // host values stay (loom/model.hpp)
    }
    if (i < checkpointed_.size() && checkpointed_[i] && state.cache == nullptr && torch::GradMode::is_enabled()) {
      if (!anchor_.defined()) anchor_ = at::zeros({}, at::kFloat).set_requires_grad(true);
      const at::Tensor input = state.hidden;
      state.hidden = CheckpointedBlock::apply(input, anchor_, static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(model_.get())),
                                              static_cast<std::int64_t>(i), static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&state)),
                                              offload_checkpoints_ ? &last_offloaded : nullptr);
    } else if (cached != nullptr) {
      decoding_->forward_cached(i, state, *cached);
    } else {
      model_->forward(i, state);
    }
    if (check_devices_ && state.hidden.device() != device)
      throw std::logic_error("check_devices: block " + (i < names_.size() ? names_[i] : std::to_string(i)) + " returned its output on " +
                             state.hidden.device().str() + ", not on its device " + device.str() + " (model plugin bug)");
  }
}

std::unique_ptr<Executor> load_executor(const Model& model, const Plan& plan, DType dtype, std::uint64_t seed, bool check_devices,
                                        int pipeline_rank, Parallel* parallel, const Adapter* adapter) {
  LoadRequest request;
  std::vector<std::string> names;
  for (const auto& b : plan.blocks) {
    request.block_devices.push_back(b.rank == pipeline_rank ? std::optional<c10::Device>(torch_device(b.device)) : std::nullopt);
    names.push_back(b.block);
  }
  request.dtype = dtype;
  request.seed = seed;
  request.parallel = parallel;
  const auto* storing = adapter ? capability<BaseStoringAdapter>(*adapter) : nullptr;
  // A model that does not split itself over a tensor group loads whole, and the host splits the
  // linears it declares (a 4-bit base stored part by part, after).
  const bool host_splits = parallel != nullptr && parallel->tensor().size() > 1 && capability<TensorParallelModel>(model) == nullptr;
  if (storing != nullptr && !host_splits)
    request.base_weight = [storing](const LinearInfo& linear, const at::TensorOptions& options) { return storing->base_weight(linear, options); };
  auto devices = request.block_devices;
  std::unique_ptr<LoadedModel> loaded = model.load(request);
  if (host_splits) loaded = split_by_host(std::move(loaded), model.structure(), parallel->tensor(), storing);
  return std::make_unique<Executor>(std::move(loaded), std::move(devices), check_devices, std::move(names));
}

void log_compact_base(LoadedModel& model) {
  std::uint64_t parameters = 0, bytes = 0, linears = 0;
  for (const auto& l : model.linears()) {
    if (!l.layer) continue;
    // Below a dense matrix of its compute dtype: stored its own way (by whichever adapter).
    const auto& base = l.layer->base();
    const auto values = static_cast<std::uint64_t>(l.layer->in_features) * static_cast<std::uint64_t>(l.layer->out_features);
    if (base.shard().split() || base.bytes() >= values * base.options().dtype().itemsize()) continue;
    parameters += values;
    bytes += base.bytes();
    ++linears;
  }
  if (linears > 0)
    spdlog::info("compact base: {} linears, {} parameters stored in {} bytes ({:.4f} bytes/parameter)", linears, parameters, bytes,
                 static_cast<double>(bytes) / static_cast<double>(parameters));
}

}  // namespace loom::core
