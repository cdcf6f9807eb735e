#include "loom/kit/tensor_parallel.hpp"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/adapter.hpp"
#include "loom/kit/loss.hpp"

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

at::Tensor part_of_pieces(const at::Tensor& whole, std::int64_t dim, const std::vector<std::int64_t>& pieces, int rank, int size) {
  std::vector<at::Tensor> parts;
  std::int64_t offset = 0;
  for (const std::int64_t piece : pieces.empty() ? std::vector<std::int64_t>{whole.size(dim)} : pieces) {
    const auto r = shard_range(piece, rank, size);
    parts.push_back(whole.narrow(dim, offset + r.start, r.length));
    offset += piece;
  }
  if (offset != whole.size(dim))
    throw std::logic_error("part_of_pieces: pieces of " + std::to_string(offset) + " for a dimension of " + std::to_string(whole.size(dim)));
  return parts.size() == 1 ? parts.front() : at::cat(parts, dim);
}

at::Tensor gather_pieces(const at::Tensor& local, std::int64_t dim, const std::vector<std::int64_t>& pieces, Communicator& group) {
  if (pieces.empty()) return gather_shards(local, dim, -1, group);
  std::vector<at::Tensor> wholes;
  std::int64_t offset = 0;
  for (const std::int64_t piece : pieces) {
    const std::int64_t mine = shard_range(piece, group.rank(), group.size()).length;
    wholes.push_back(gather_shards(local.narrow(dim, offset, mine), dim, piece, group));
    offset += mine;
  }
  return at::cat(wholes, dim);
}

std::int64_t part_length(std::int64_t full, const TensorShard& shard, const std::vector<std::int64_t>& pieces) {
  std::int64_t length = 0;
  for (const std::int64_t piece : pieces.empty() ? std::vector<std::int64_t>{full} : pieces) length += shard_range(piece, shard.rank(), shard.size()).length;
  return length;
}

namespace {
// A split linear's product: `product(x, bias)` of this rank's part, the input copied into the
// tensor region first (column), or the output summed over the group and the bias added once (row).
template <class Product>
at::Tensor split_product(const TensorShard& shard, const at::Tensor& x, const at::Tensor& bias, const Product& product) {
  if (shard.style == ParallelStyle::kColumn) return product(copy_to_tensor_region(x, shard.group, /*share=*/true), bias);
  const at::Tensor y = reduce_from_tensor_region(product(x, at::Tensor()), shard.group);
  return bias.defined() ? y + bias : y;
}
}  // namespace

ShardedWeight::ShardedWeight(std::int64_t in, std::int64_t out, TensorShard shard, const at::TensorOptions& options, std::vector<std::int64_t> pieces)
    : DenseWeight(shard.style == ParallelStyle::kColumn ? in : part_length(in, shard), shard.style == ParallelStyle::kColumn ? part_length(out, shard, pieces) : out,
                  options),
      shard_(shard),
      pieces_(std::move(pieces)) {
  if (!pieces_.empty() && shard_.style != ParallelStyle::kColumn) throw std::logic_error("ShardedWeight: pieces of a split that is not by column");
}

SplitWeight::SplitWeight(std::shared_ptr<LinearWeight> part, TensorShard shard, std::vector<std::int64_t> pieces)
    : part_(register_module("part", std::move(part))), shard_(shard), pieces_(std::move(pieces)) {
  if (!pieces_.empty() && shard_.style != ParallelStyle::kColumn) throw std::logic_error("SplitWeight: pieces of a split that is not by column");
}

at::Tensor SplitWeight::forward(const at::Tensor& x, const at::Tensor& bias) {
  if (!shard_.split()) return part_->forward(x, bias);
  return split_product(shard_, x, bias, [&](const at::Tensor& in, const at::Tensor& b) { return part_->forward(in, b); });
}

void SplitWeight::replace_part(std::shared_ptr<LinearWeight> part) { part_ = replace_module("part", std::move(part)); }

std::vector<std::int64_t> column_pieces(const LinearWeight& weight) {
  if (const auto* sharded = dynamic_cast<const ShardedWeight*>(&weight)) return sharded->pieces();
  if (const auto* split = dynamic_cast<const SplitWeight*>(&weight)) return split->pieces();
  return {};
}

LinearWeight& held_weight(LinearWeight& weight) {
  auto* split = dynamic_cast<SplitWeight*>(&weight);
  return split != nullptr ? split->part() : weight;
}

at::Tensor ShardedWeight::forward(const at::Tensor& x, const at::Tensor& bias) {
  return split_product(shard_, x, bias, [&](const at::Tensor& in, const at::Tensor& b) { return at::linear(in, weight, b); });
}

std::shared_ptr<AdaptableLinear> make_linear(std::int64_t in, std::int64_t out, bool bias, const at::TensorOptions& options, TensorShard shard,
                                             const std::vector<std::int64_t>& pieces) {
  if (!shard.split()) return std::make_shared<AdaptableLinear>(in, out, bias, options);
  at::Tensor b;
  if (bias) b = at::zeros({shard.style == ParallelStyle::kColumn ? part_length(out, shard, pieces) : out}, options);
  return std::make_shared<AdaptableLinear>(std::make_shared<ShardedWeight>(in, out, shard, options, pieces), in, out, b);
}

at::Tensor SplitTensor::part(const at::Tensor& whole) const { return part_of_pieces(whole, dim, pieces, group->rank(), group->size()); }

at::Tensor SplitTensor::whole(const at::Tensor& part) const {
  return pieces.empty() ? gather_shards(part, dim, full, *group) : gather_pieces(part, dim, pieces, *group);
}

std::vector<std::int64_t> SplitTensor::whole_shape(const at::Tensor& part) const {
  auto shape = part.sizes().vec();
  shape[static_cast<std::size_t>(dim)] = full;
  return shape;
}

ShardRange SplitTensor::range() const {
  if (!pieces.empty()) throw std::logic_error("SplitTensor::range: a tensor of pieces has no one run");
  return shard_range(full, group->rank(), group->size());
}

VocabularySplit::VocabularySplit(std::int64_t vocab, Communicator* group)
    : vocab(vocab), group(group != nullptr && group->size() > 1 ? group : nullptr),
      rows(shard_range(vocab, this->group ? this->group->rank() : 0, this->group ? this->group->size() : 1)) {}

at::Tensor VocabularySplit::embed(const at::Tensor& weight, const at::Tensor& ids) const { return vocab_parallel_embedding(weight, rows.start, ids, group); }

at::Tensor VocabularySplit::head(const at::Tensor& hidden, const at::Tensor& weight) const { return at::linear(copy_to_tensor_region(hidden, group), weight); }

at::Tensor VocabularySplit::logits(const at::Tensor& part) const {
  return group && part.size(-1) != vocab ? gather_shards(part, part.dim() - 1, vocab, *group) : part;  // whole already: as it is
}

at::Tensor VocabularySplit::loss_sum(const at::Tensor& part, const at::Tensor& labels) const {
  return group ? vocab_parallel_loss_sum(part, rows.start, vocab, labels, *group) : next_token_loss_sum(part, labels);
}

at::Tensor VocabularySplit::loss_sum_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head) const {
  return group ? vocab_parallel_loss_sum_from_hidden(hidden, weight, rows.start, vocab, labels, head, *group)
               : next_token_loss_sum_from_hidden(hidden, weight, labels, head);
}

at::Tensor VocabularySplit::logps_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head,
                                              double temperature) const {
  return group ? vocab_parallel_logps_from_hidden(hidden, weight, rows.start, vocab, labels, head, temperature, *group)
               : next_token_logps_from_hidden(hidden, weight, labels, head, temperature);
}

}  // namespace loom::kit
