#include "runtime/rank_runtime.hpp"

#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/kit/moe.hpp"
#include "distributed/distributed.hpp"
#include "plugins/plugin_guard.hpp"

namespace loom::core {
namespace {
enum TransferKind { kActivation = 0, kGradient = 1, kForwardOnly = 2 };
using Key = std::pair<int, int>;  // (stage, micro-batch)
}  // namespace

MicroBatch to_micro_batch(const Batch& b) {
  MicroBatch t;
  t.ids = at::tensor(b.input_ids, at::kLong).view({b.rows, b.cols});
  t.mask = at::tensor(b.attention_mask, at::kLong).view({b.rows, b.cols});
  // A label counts only where the token before it is of the same sample: a row's first token (after
  // left padding, too) or a packed sample's first has nothing of its own to be predicted from, so
  // padded, left-padded and packed batches take the loss on the same tokens.
  std::vector<std::int64_t> labels = b.labels;
  for (std::int64_t r = 0; r < b.rows; ++r)
    for (std::int64_t c = 0; c < b.cols; ++c) {
      const auto i = static_cast<std::size_t>(r * b.cols + c);
      if (c == 0 || b.attention_mask[i] == 0 || b.attention_mask[i - 1] != b.attention_mask[i]) labels[i] = -100;
    }
  t.labels = at::tensor(labels, at::kLong).view({b.rows, b.cols});
  const bool packed = std::any_of(b.attention_mask.begin(), b.attention_mask.end(), [](std::int64_t v) { return v > 1; });
  if (!packed) {
    t.positions = (t.mask.cumsum(1) - 1).clamp_min(0);
    return t;
  }
  // Packed rows (mask values are samples): positions restart with each sample; padding takes 0.
  std::vector<std::int64_t> positions(b.attention_mask.size(), 0);
  for (std::int64_t r = 0; r < b.rows; ++r) {
    std::int64_t segment = 0, position = 0;
    for (std::int64_t c = 0; c < b.cols; ++c) {
      const auto i = static_cast<std::size_t>(r * b.cols + c);
      const std::int64_t v = b.attention_mask[i];
      if (v == 0) continue;
      position = v == segment ? position + 1 : 0;
      segment = v;
      positions[i] = position;
    }
  }
  t.positions = at::tensor(positions, at::kLong).view({b.rows, b.cols});
  return t;
}

std::int64_t label_count(const MicroBatch& t) { return (t.labels.narrow(1, 1, t.labels.size(1) - 1) != -100).sum().item<std::int64_t>(); }

RankRuntime::RankRuntime(Executor& executor)
    : executor_(executor), me_(0), group_(nullptr), comm_device_(c10::kCPU), hidden_(0), dtype_(at::kFloat) {
  const std::size_t blocks = executor.model().block_count();
  if (blocks == 0) throw std::logic_error("a rank runtime over a model of no blocks");
  schedule_.stages = 1;
  schedule_.stage_rank = {0};
  first_ = {0};
  last_ = {blocks - 1};
  block_rank_.assign(blocks, 0);
}

std::unique_ptr<RankRuntime> RankRuntime::for_plan(Executor& executor, const Plan& plan, int me, Communicator& group, c10::Device comm_device,
                                                   std::int64_t hidden_size, at::ScalarType dtype) {
  if (plan.schedule.empty()) return std::make_unique<RankRuntime>(executor);
  return std::make_unique<RankRuntime>(executor, plan, me, group, comm_device, hidden_size, dtype);
}

RankRuntime::RankRuntime(Executor& executor, const Plan& plan, int me, Communicator& group, c10::Device comm_device, std::int64_t hidden_size,
                         at::ScalarType dtype)
    : executor_(executor), schedule_(plan.schedule), me_(me), group_(&group), comm_device_(comm_device), hidden_(hidden_size), dtype_(dtype) {
  first_.assign(static_cast<std::size_t>(schedule_.stages), 0);
  last_.assign(static_cast<std::size_t>(schedule_.stages), 0);
  for (std::size_t i = plan.blocks.size(); i-- > 0;) first_[static_cast<std::size_t>(plan.blocks[i].stage)] = i;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) last_[static_cast<std::size_t>(plan.blocks[i].stage)] = i;
  for (const auto& b : plan.blocks) block_rank_.push_back(b.rank);
}

void RankRuntime::tie(const ModelStructure& structure, const std::vector<NamedParameter>& params) {
  std::map<std::string, std::set<int>> holders;
  for (std::size_t i = 0; i < structure.blocks.size(); ++i)
    if (!structure.blocks[i].tied_group.empty()) holders[structure.blocks[i].tied_group].insert(block_rank_.at(i));
  tied_.clear();
  counted_elsewhere_.assign(params.size(), false);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& group = structure.blocks.at(params[i].block).tied_group;
    if (group.empty() || holders[group].size() < 2) continue;
    tied_.push_back({i, std::vector<int>(holders[group].begin(), holders[group].end())});
    if (tied_.back().holders.front() != me_) counted_elsewhere_[i] = true;  // the first holder counts it
  }
  // Every holder exchanges its copies in the same order: by name.
  std::sort(tied_.begin(), tied_.end(), [&](const TiedCopy& a, const TiedCopy& b) { return params[a.index].name < params[b.index].name; });
}

void RankRuntime::sum_tied_gradients(std::vector<NamedParameter>& params) {
  for (std::size_t k = 0; k < tied_.size(); ++k) {
    at::Tensor& param = params.at(tied_[k].index).tensor;
    const at::Tensor local = (param.grad().defined() ? param.grad() : at::zeros_like(param)).to(comm_device_).contiguous();
    std::map<int, at::Tensor> parts{{me_, local}};
    for (int peer : tied_[k].holders) {
      if (peer == me_) continue;
      std::vector<at::Tensor> out{local}, in{at::empty_like(local)};
      const int tag = (1 << 30) + static_cast<int>(k);
      // The lower rank sends first, the higher receives first: NCCL pairs them in order.
      std::unique_ptr<Work> first = me_ < peer ? group_->send(out, peer, tag) : group_->recv(in, peer, tag);
      std::unique_ptr<Work> second = me_ < peer ? group_->recv(in, peer, tag) : group_->send(out, peer, tag);
      first->wait();
      second->wait();
      parts[peer] = in[0];
    }
    at::Tensor sum;
    for (const auto& [rank, g] : parts) sum = sum.defined() ? sum + g : g.clone();
    if (param.grad().defined()) param.mutable_grad().copy_(sum);
    else param.mutable_grad() = sum.to(param.device());
  }
}

void RankRuntime::run_stage(int stage, ForwardState& state, CachedPass* cached) {
  executor_.run_blocks(first_[static_cast<std::size_t>(stage)], last_[static_cast<std::size_t>(stage)], state, cached);
}

at::Tensor RankRuntime::train_step(const std::vector<MicroBatch>& micro, const std::function<at::Tensor(const ForwardState&, std::size_t)>& loss,
                                   double scale, const std::function<void()>& before_last_backward) {
  // A one-stage run's schedule: each micro-batch's forward, then its backward.
  std::vector<StageAction> one_stage;
  if (!group_)
    for (int m = 0; m < static_cast<int>(micro.size()); ++m)
      for (StageOp op : {StageOp::kForward, StageOp::kBackward}) {
        StageAction a;
        a.op = op;
        a.stage = 0;
        a.micro_batch = m;
        one_stage.push_back(a);
      }
  const auto& actions = group_ ? schedule_.actions.at(static_cast<std::size_t>(me_)) : one_stage;
  std::size_t last_backward = actions.size();
  for (std::size_t i = 0; i < actions.size(); ++i)
    if (actions[i].op == StageOp::kBackward) last_backward = i;
  std::map<Key, Pending> activations_in, gradients_in;  // posted receives
  std::map<Key, at::Tensor> inputs, outputs;            // each stage's input leaf and output (its loss on the last stage)
  std::map<Key, at::Tensor> handed, handed_back;        // between stages of this rank
  std::map<Key, at::Tensor> gradients_out;
  // Sends posted before the previous compute are waited for (and their buffers freed) at the next
  // one: safe, since each peer posts the matching receive in the slot the send was made, and it
  // keeps at most two slots of sent tensors alive instead of a whole step's.
  std::vector<Pending> sends, fresh_sends;
  const auto retire_sends = [&] {
    for (auto& s : sends) s.work->wait();
    sends = std::move(fresh_sends);
    fresh_sends.clear();
  };
  at::Tensor total;
  const int last_stage = schedule_.stages - 1;
  for (std::size_t i = 0; i < actions.size(); ++i) {
    const StageAction& a = actions[i];
    const Key key{a.stage, a.micro_batch};
    const MicroBatch& mb = micro.at(static_cast<std::size_t>(a.micro_batch));
    switch (a.op) {
      case StageOp::kRecvActivation: {
        std::vector<at::Tensor> buffer{activation_buffer(mb.ids)};
        auto work = group_->recv(buffer, rank_of(a.stage - 1), tag(kActivation, a.stage, a.micro_batch));
        activations_in[key] = Pending{buffer[0], std::move(work)};
        break;
      }
      case StageOp::kForward: {
        retire_sends();
        const c10::Device device = stage_device(a.stage);
        at::Tensor input;
        if (a.stage == 0) {
          input = mb.ids;
        } else if (auto it = activations_in.find(key); it != activations_in.end()) {
          it->second.work->wait();
          input = it->second.buffer.to(device).detach().set_requires_grad(true);
          activations_in.erase(it);
        } else {
          input = handed.at(key).detach().set_requires_grad(true);
          handed.erase(key);
        }
        ForwardState state{input, mb.positions, mb.mask, nullptr, {}};
        run_stage(a.stage, state);
        if (a.stage > 0) inputs[key] = input;
        if (a.stage == last_stage) {
          const at::Tensor l = loss(state, static_cast<std::size_t>(a.micro_batch));
          total = total.defined() ? total + l.detach() : l.detach();
          outputs[key] = scale != 1.0 ? l * scale : l;
        } else {
          outputs[key] = state.hidden;
          if (rank_of(a.stage + 1) == me_) handed[{a.stage + 1, a.micro_batch}] = state.hidden;
        }
        break;
      }
      case StageOp::kSendActivation: {
        std::vector<at::Tensor> t{outputs.at(key).detach().to(comm_device_).contiguous()};
        auto work = group_->send(t, rank_of(a.stage + 1), tag(kActivation, a.stage + 1, a.micro_batch));
        fresh_sends.push_back(Pending{t[0], std::move(work)});
        break;
      }
      case StageOp::kRecvGradient: {
        const at::Tensor& out = outputs.at(key);
        std::vector<at::Tensor> buffer{at::empty(out.sizes(), out.options().device(comm_device_))};
        auto work = group_->recv(buffer, rank_of(a.stage + 1), tag(kGradient, a.stage, a.micro_batch));
        gradients_in[key] = Pending{buffer[0], std::move(work)};
        break;
      }
      case StageOp::kBackward: {
        retire_sends();
        if (i == last_backward && before_last_backward) before_last_backward();
        const at::Tensor out = outputs.at(key);
        outputs.erase(key);
        if (a.stage == last_stage) {
          // A micro-batch that labels nothing (the collator kept no sample of it) has a constant loss.
          if (out.requires_grad()) torch::autograd::backward({out});
        } else {
          at::Tensor grad;
          if (auto it = gradients_in.find(key); it != gradients_in.end()) {
            it->second.work->wait();
            grad = it->second.buffer.to(out.device());
            gradients_in.erase(it);
          } else {
            grad = handed_back.at(key);
            handed_back.erase(key);
          }
          // A first stage with nothing to train (a frozen embedding) has no graph to go through.
          if (out.requires_grad()) torch::autograd::backward({out}, {grad});
        }
        if (a.stage > 0) {
          const at::Tensor in = inputs.at(key);
          inputs.erase(key);
          at::Tensor g = in.grad().defined() ? in.grad() : at::zeros_like(in);
          if (rank_of(a.stage - 1) == me_) handed_back[{a.stage - 1, a.micro_batch}] = g;
          else gradients_out[key] = g;
        }
        break;
      }
      case StageOp::kSendGradient: {
        std::vector<at::Tensor> t{gradients_out.at(key).to(comm_device_).contiguous()};
        gradients_out.erase(key);
        auto work = group_->send(t, rank_of(a.stage - 1), tag(kGradient, a.stage - 1, a.micro_batch));
        fresh_sends.push_back(Pending{t[0], std::move(work)});
        break;
      }
    }
  }
  retire_sends();
  retire_sends();
  return total;
}

at::Tensor RankRuntime::activation_buffer(const at::Tensor& ids) const {
  return at::empty({ids.size(0), ids.size(1), hidden_}, at::TensorOptions().dtype(dtype_).device(comm_device_));
}

at::Tensor RankRuntime::receive_now(int stage, const at::Tensor& like_ids) {
  std::vector<at::Tensor> buffer{activation_buffer(like_ids)};
  group_->recv(buffer, rank_of(stage - 1), tag(kForwardOnly, stage, 0))->wait();
  return buffer[0].to(stage_device(stage));
}

at::Tensor RankRuntime::forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass* cached) {
  at::Tensor carried, result;
  for (int s = 0; s < schedule_.stages; ++s) {
    if (rank_of(s) != me_) continue;
    at::Tensor input = s == 0 ? ids : rank_of(s - 1) == me_ ? carried : receive_now(s, ids);
    ForwardState state{input, positions, mask, nullptr, {}};
    run_stage(s, state, cached);
    if (s + 1 == schedule_.stages) {
      result = state.hidden;
    } else if (rank_of(s + 1) == me_) {
      carried = state.hidden;
    } else {
      std::vector<at::Tensor> t{state.hidden.to(comm_device_).contiguous()};
      group_->send(t, rank_of(s + 1), tag(kForwardOnly, s + 1, 0))->wait();
    }
  }
  return result;
}

bool RankRuntime::graph_capturable(Parallel& parallel) const {
  const auto& devices = executor_.devices();
  // A mixture of experts records only where its grouped products count each expert's rows on the
  // GPU (a host read may not be recorded), and never over an expert group (its exchange's sizes are
  // read on the host): elsewhere its decode steps run eagerly.
  if (auto* experts = capability<ExpertWeights>(executor_.model()); experts && !experts->expert_weights().empty()) {
    if (expert_ranks(parallel) > 1) return false;
    for (const auto& e : experts->expert_weights())
      if (!kit::experts_run_on_device(e.weight, e.delta)) return false;
  }
  return group_ == nullptr && parallel.tensor().size() == 1 && devices.size() == 1 && devices[0].is_cuda();
}

namespace {

// Without the model's own cache: the rows' ids and positions so far, kept in the pass's cache
// (keys[0] ids, values[0] positions, [rows, capacity]), and the whole written prefix of each row
// run again. Returns the pass as an uncached forward takes it, and the column of each row's last
// token.
struct Recomputed {
  at::Tensor ids, positions, mask, last;
};
Recomputed recompute_pass(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass& pass) {
  StaticKVCache& cache = *pass.cache;
  const auto long_cpu = at::TensorOptions().dtype(at::kLong);
  if (cache.keys.empty()) {
    cache.keys = {at::zeros({cache.rows, cache.capacity}, long_cpu)};
    cache.values = {at::zeros({cache.rows, cache.capacity}, long_cpu)};
  }
  const at::Tensor rows = pass.rows.defined() ? pass.rows.to(at::kCPU) : at::arange(ids.size(0), long_cpu);
  const at::Tensor columns = pass.columns.to(at::kCPU);
  const at::Tensor at_rows = rows.view({-1, 1}).expand_as(columns);
  const c10::List<c10::optional<at::Tensor>> where{c10::optional<at::Tensor>(at_rows), c10::optional<at::Tensor>(columns)};
  cache.keys[0].index_put_(where, ids.to(at::kCPU));
  cache.values[0].index_put_(where, positions.to(at::kCPU));
  at::Tensor full_mask = mask.to(at::kCPU);
  if (pass.fresh) full_mask = at::zeros({ids.size(0), cache.capacity}, long_cpu).scatter_(1, columns, full_mask);
  return {cache.keys[0].index_select(0, rows), cache.values[0].index_select(0, rows), full_mask, columns.select(1, columns.size(1) - 1)};
}

}  // namespace

at::Tensor RankRuntime::last_logits(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass& pass) {
  at::Tensor out, last;  // the head's output, and the column of each row's last token in it
  if (executor_.cached_decoding() != nullptr) {
    out = forward(ids, positions, mask, &pass);
  } else {
    const Recomputed r = recompute_pass(ids, positions, mask, pass);
    out = forward(r.ids, r.positions, r.mask);
    last = r.last;
  }
  at::Tensor logits;
  if (out.defined()) {
    const at::Tensor tail = last.defined() ? out.gather(1, last.to(out.device()).view({-1, 1, 1}).expand({out.size(0), 1, out.size(2)}))
                                           : out.narrow(1, out.size(1) - 1, 1);
    logits = executor_.logits(tail).select(1, 0).to(at::kFloat);
  }
  if (!group_) return logits;
  const int root = rank_of(schedule_.stages - 1);
  // The width first (the head's output is the only place it is known), then the logits.
  std::vector<at::Tensor> width{at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(comm_device_))};
  if (me_ == root) {
    logits = logits.to(comm_device_).contiguous();
    width[0].fill_(logits.size(1));
  }
  group_->broadcast(width, root)->wait();
  if (me_ != root) logits = at::empty({ids.size(0), width[0].to(at::kCPU).item<std::int64_t>()}, at::TensorOptions().dtype(at::kFloat).device(comm_device_));
  std::vector<at::Tensor> payload{logits};
  group_->broadcast(payload, root)->wait();
  return payload[0];
}

}  // namespace loom::core
