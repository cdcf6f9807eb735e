#include "loom/kit/tensor_parallel.hpp"

#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/adapter.hpp"

namespace loom::kit {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::int64_t pointer_value(Communicator* group) { return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(group)); }
Communicator& group_of(AutogradContext* ctx) { return *reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt())); }

at::Tensor summed(const at::Tensor& x, Communicator& group) {
  at::Tensor y = x.clone(at::MemoryFormat::Contiguous);
  group.all_reduce_now({y}, ReduceOp::kSum);
  return y;
}

struct CopyToRegion : public torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return {summed(grads[0], group_of(ctx)), at::Tensor()}; }
};

struct ReduceFromRegion : public torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    return summed(x, group_of(ctx));
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

// The last shared copy: q, k and v (or gate and up) read one input one after another. The input
// is held weakly, so the cache never keeps an activation alive.
struct SharedCopy {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> input{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  const c10::TensorImpl* raw = nullptr;
  std::int64_t version = 0;
  Communicator* group = nullptr;
  at::Tensor output;
};
thread_local SharedCopy last_copy;

}  // namespace

ShardRange shard_range(std::int64_t full, int rank, int size) {
  const std::int64_t per = (full + size - 1) / std::max(size, 1);
  ShardRange r;
  r.start = std::min(full, per * rank);
  r.length = std::max<std::int64_t>(0, std::min(full, r.start + per) - r.start);
  return r;
}

at::Tensor copy_to_tensor_region(const at::Tensor& x, Communicator* group, bool share) {
  if (group == nullptr || group->size() == 1 || !at::GradMode::is_enabled() || !x.requires_grad()) return x;
  if (!share) return CopyToRegion::apply(x, pointer_value(group));
  SharedCopy& c = last_copy;
  if (c.raw == x.unsafeGetTensorImpl() && c.group == group && !c.input.expired() && c.version == x._version() && c.output.defined())
    return c.output;
  c.output = CopyToRegion::apply(x, pointer_value(group));
  c.input = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(x.getIntrusivePtr());
  c.raw = x.unsafeGetTensorImpl();
  c.version = x._version();
  c.group = group;
  return c.output;
}

at::Tensor reduce_from_tensor_region(const at::Tensor& x, Communicator* group) {
  if (group == nullptr || group->size() == 1) return x;
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return summed(x, *group);
  return ReduceFromRegion::apply(x, pointer_value(group));
}

at::Tensor gather_shards(const at::Tensor& local, std::int64_t dim, std::int64_t full, Communicator& group) {
  if (group.size() == 1) return local;
  if (full < 0) {
    at::Tensor total = at::full({1}, local.size(dim), local.options().dtype(at::kLong));
    group.all_reduce_now({total}, ReduceOp::kSum);
    full = total.item<std::int64_t>();
  }
  const std::int64_t per = shard_range(full, 0, group.size()).length;
  at::Tensor padded = local.detach().contiguous();
  if (padded.size(dim) < per) {
    auto shape = padded.sizes().vec();
    shape[static_cast<std::size_t>(dim)] = per - padded.size(dim);
    padded = at::cat({padded, at::zeros(shape, padded.options())}, dim).contiguous();
  }
  std::vector<at::Tensor> parts;
  for (int r = 0; r < group.size(); ++r) parts.push_back(at::empty_like(padded));
  group.all_gather(parts, padded)->wait();
  for (int r = 0; r < group.size(); ++r) parts[static_cast<std::size_t>(r)] = parts[static_cast<std::size_t>(r)].narrow(dim, 0, shard_range(full, r, group.size()).length);
  return at::cat(parts, dim);
}

at::Tensor vocab_parallel_embedding(const at::Tensor& weight_shard, std::int64_t start, const at::Tensor& ids, Communicator* group) {
  if (group == nullptr || group->size() == 1) return at::embedding(weight_shard, ids);
  const at::Tensor here = (ids >= start) & (ids < start + weight_shard.size(0));
  const at::Tensor local = (ids - start).masked_fill(~here, 0);
  const at::Tensor rows = at::embedding(weight_shard, local) * here.unsqueeze(-1).to(weight_shard.scalar_type());
  return reduce_from_tensor_region(rows, group);
}

namespace {
// The [out, in] sizes of rank shard.rank()'s part of a linear of `in` x `out` features.
std::int64_t part_of(std::int64_t full, const TensorShard& shard) { return shard_range(full, shard.rank(), shard.size()).length; }
}  // namespace

ShardedWeight::ShardedWeight(std::int64_t in, std::int64_t out, TensorShard shard, const at::TensorOptions& options)
    : DenseWeight(shard.style == ParallelStyle::kColumn ? in : part_of(in, shard), shard.style == ParallelStyle::kColumn ? part_of(out, shard) : out,
                  options),
      shard_(shard) {}

at::Tensor ShardedWeight::forward(const at::Tensor& x, const at::Tensor& bias) {
  if (shard_.style == ParallelStyle::kColumn) return at::linear(copy_to_tensor_region(x, shard_.group, /*share=*/true), weight, bias);
  const at::Tensor y = reduce_from_tensor_region(at::linear(x, weight), shard_.group);
  return bias.defined() ? y + bias : y;
}

std::shared_ptr<AdaptableLinear> make_linear(std::int64_t in, std::int64_t out, bool bias, const at::TensorOptions& options, TensorShard shard) {
  if (!shard.split()) return std::make_shared<AdaptableLinear>(in, out, bias, options);
  at::Tensor b;
  if (bias) b = at::zeros({shard.style == ParallelStyle::kColumn ? shard_range(out, shard.rank(), shard.size()).length : out}, options);
  return std::make_shared<AdaptableLinear>(std::make_shared<ShardedWeight>(in, out, shard, options), in, out, b);
}

}  // namespace loom::kit
