#pragma once
// Tensor parallelism as Megatron-LM does it (Shoeybi et al. 2019): a column-parallel linear splits
// its output features over the ranks of the tensor group, a row-parallel one its input features
// and sums its output over the group. Two autograd functions carry all the communication:
// copy-to-region (identity forward, gradient summed in backward) in front of column-parallel
// work, reduce-from-region (summed forward, identity backward) after row-parallel work. Model
// plugins build their linears with a TensorShard and never call a collective themselves.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/communicator.hpp"
#include "loom/export.hpp"
#include "loom/layers.hpp"
#include "loom/model.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// The rows [start, start + length) of `full` that rank `rank` of `size` holds: ceil(full / size)
// each, the last ranks fewer when it does not divide (a vocabulary of 50257 over 2 ranks).
struct ShardRange {
  std::int64_t start = 0;
  std::int64_t length = 0;
};
LOOM_API ShardRange shard_range(std::int64_t full, int rank, int size);

// Identity forward; backward sums the gradient over `group`. What a replicated input goes through
// before work that each rank does on its own part (column-parallel linears, a vocabulary shard).
// `share`: reuse the copy made for the same input tensor just before (q, k and v read one input:
// one all-reduce in backward instead of three).
LOOM_API at::Tensor copy_to_tensor_region(const at::Tensor& x, Communicator* group, bool share = false);
// Sums `x` over `group` forward; identity backward. What partial results of row-parallel work go
// through to become the whole result every rank holds.
LOOM_API at::Tensor reduce_from_tensor_region(const at::Tensor& x, Communicator* group);
// Every rank's `local` concatenated along `dim` into the full tensor of `full` entries there
// (ranks holding shard_range(full, r, size) each; full < 0: the sum of the ranks' sizes, one more
// collective); no gradient. For saving and generation.
LOOM_API at::Tensor gather_shards(const at::Tensor& local, std::int64_t dim, std::int64_t full, Communicator& group);

// A fused linear's output is several projections side by side (Phi-3's qkv_proj: q, k, v), each
// split over the group on its own: `pieces` are their whole lengths along `dim` (summing to its
// size), and a rank's part is each piece's shard_range part, in order. Empty `pieces`: one piece.
// Kit 3.0.
LOOM_API at::Tensor part_of_pieces(const at::Tensor& whole, std::int64_t dim, const std::vector<std::int64_t>& pieces, int rank, int size);
// The length of rank shard.rank()'s part of `full` features split by `shard` (each of `pieces` cut apart).
LOOM_API std::int64_t part_length(std::int64_t full, const TensorShard& shard, const std::vector<std::int64_t>& pieces = {});
// The inverse over the group: the whole tensor from every rank's part (one gather a piece); no gradient.
LOOM_API at::Tensor gather_pieces(const at::Tensor& local, std::int64_t dim, const std::vector<std::int64_t>& pieces, Communicator& group);

// A linear's weight split over a tensor group: [out / N, in] for column (its bias split alike),
// [out, in / N] for row (its output summed over the group, the bias added once after). The
// layer's in_features and out_features stay the whole layer's. A column split of a fused linear
// takes each of its `pieces` apart (part_of_pieces).
// `weight`, dense(), stored() and add_() are this rank's shard's.
class LOOM_API ShardedWeight final : public DenseWeight {
 public:
  ShardedWeight(std::int64_t in_features, std::int64_t out_features, TensorShard shard, const at::TensorOptions& options,
                std::vector<std::int64_t> pieces = {});
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias) override;
  TensorShard shard() const override { return shard_; }
  const std::vector<std::int64_t>& pieces() const { return pieces_; }

 private:
  TensorShard shard_;
  std::vector<std::int64_t> pieces_;
};

// Any weight of this rank's part of a split linear (an adapter's base: a 4-bit one), split as
// ShardedWeight splits a dense one: column, the input copied into the tensor region first; row, the
// output summed over the group, the bias added once after. assign() takes this rank's part, cut as
// part_of_pieces cuts the whole. Kit 3.0.
class LOOM_API SplitWeight final : public LinearWeight {
 public:
  SplitWeight(std::shared_ptr<LinearWeight> part, TensorShard shard, std::vector<std::int64_t> pieces = {});
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias) override;
  at::Tensor dense() const override { return part_->dense(); }
  void add_(const at::Tensor& delta) override { part_->add_(delta); }
  std::vector<std::pair<std::string, at::Tensor>> stored() override { return part_->stored(); }
  at::TensorOptions options() const override { return part_->options(); }
  std::uint64_t bytes() const override { return part_->bytes(); }
  TensorShard shard() const override { return shard_; }
  void assign(const std::string& suffix, const at::Tensor& value) override { part_->assign(suffix, value); }
  void finish_load(const std::string& name) override { part_->finish_load(name); }
  const std::vector<std::int64_t>& pieces() const { return pieces_; }
  LinearWeight& part() const { return *part_; }
  // Swaps the rank's part for another of its shape (a 4-bit part for a dense copy when merging).
  void replace_part(std::shared_ptr<LinearWeight> part);

 private:
  std::shared_ptr<LinearWeight> part_;
  TensorShard shard_;
  std::vector<std::int64_t> pieces_;
};

// The pieces a split weight's output is cut by (ShardedWeight's or SplitWeight's); empty for any other weight.
LOOM_API std::vector<std::int64_t> column_pieces(const LinearWeight& weight);
// The weight that holds a linear's values: a SplitWeight's part, else the weight itself.
LOOM_API LinearWeight& held_weight(LinearWeight& weight);

// An AdaptableLinear split per `shard` (a plain dense one when the shard does not split), a fused
// one's output by its `pieces`.
LOOM_API std::shared_ptr<AdaptableLinear> make_linear(std::int64_t in_features, std::int64_t out_features, bool bias, const at::TensorOptions& options,
                                                      TensorShard shard, const std::vector<std::int64_t>& pieces = {});

// The embedding lookup on a shard of its rows: tokens outside [start, start + rows) read zeros,
// and the sum over `group` gives every rank the whole lookup.
LOOM_API at::Tensor vocab_parallel_embedding(const at::Tensor& weight_shard, std::int64_t start, const at::Tensor& ids, Communicator* group);
// next_token_loss_sum() on logits split over the vocabulary: `logits_shard` [B, T, V / N] holds
// columns [start, start + V / N) of the `vocab` on this rank; the maximum, the sum of
// exponentials and the target logit are reduced over `group`, so the full [B, T, V] logits never
// exist on one rank. Every rank returns the same loss; backward gives each its shard's gradient.
LOOM_API at::Tensor vocab_parallel_loss_sum(const at::Tensor& logits_shard, std::int64_t start, std::int64_t vocab, const at::Tensor& labels,
                                            Communicator& group);
struct HeadLogits;  // loom/kit/loss.hpp
// next_token_loss_sum_from_hidden and next_token_logps_from_hidden (loss.hpp) over a head split by
// its vocabulary rows (kit 4.2): this rank's `weight_rows` [V / N, H] are rows [start, start +
// V / N) of `vocab`; every rank passes the whole `hidden` and gets the whole loss (log-
// probabilities), each slice's row statistics reduced over `group` as vocab_parallel_loss_sum
// reduces them, and hidden's gradient summed over the group. No rank makes [tokens, V / N] logits
// either.
LOOM_API at::Tensor vocab_parallel_loss_sum_from_hidden(const at::Tensor& hidden, const at::Tensor& weight_rows, std::int64_t start, std::int64_t vocab,
                                                        const at::Tensor& labels, const HeadLogits& head, Communicator& group,
                                                        std::int64_t slice_values = std::int64_t{1} << 26);
LOOM_API at::Tensor vocab_parallel_logps_from_hidden(const at::Tensor& hidden, const at::Tensor& weight_rows, std::int64_t start, std::int64_t vocab,
                                                     const at::Tensor& labels, const HeadLogits& head, double temperature, Communicator& group,
                                                     std::int64_t slice_values = std::int64_t{1} << 26);

// A tensor a model keeps split over a group (kit 4.1): along `dim`, of `full` whole, each of a
// fused tensor's `pieces` cut on its own (part_of_pieces). What the shell records of each split
// tensor, for loading (part), random init (part of the whole one device draws) and saving (whole).
struct SplitTensor {
  int dim = -1;
  std::int64_t full = 0;
  std::vector<std::int64_t> pieces;  // empty: one
  Communicator* group = nullptr;
  // This rank's part of the whole tensor.
  LOOM_API at::Tensor part(const at::Tensor& whole) const;
  // The whole tensor from every rank's part: every rank of the group calls it together.
  LOOM_API at::Tensor whole(const at::Tensor& part) const;
  // The whole tensor's shape from a part's.
  LOOM_API std::vector<std::int64_t> whole_shape(const at::Tensor& part) const;
  // This rank's run along `dim` (a tensor of one piece).
  LOOM_API ShardRange range() const;
};

// A vocabulary whose embedding and head rows split over the tensor group (null: whole), kit 4.1:
// the lookup, the head's product, the logits made whole and the loss over split logits, so a
// model's embedding and head need no collective of their own.
struct VocabularySplit {
  std::int64_t vocab = 0;
  Communicator* group = nullptr;
  ShardRange rows;  // this rank's rows of the embedding and the head
  VocabularySplit() = default;
  LOOM_API VocabularySplit(std::int64_t vocab, Communicator* group);
  // The embedding of ids [B, T] from this rank's rows `weight` [rows, H]: [B, T, H], whole on every rank.
  LOOM_API at::Tensor embed(const at::Tensor& weight, const at::Tensor& ids) const;
  // This rank's logits [..., rows] of hidden [..., H] through its rows of the head (hidden's
  // gradient summed over the group).
  LOOM_API at::Tensor head(const at::Tensor& hidden, const at::Tensor& weight) const;
  // Every rank's logits put together: [B, T, vocab] (logits whole already as they are).
  LOOM_API at::Tensor logits(const at::Tensor& part) const;
  // next_token_loss_sum() of this rank's logits (vocab_parallel_loss_sum over a group).
  LOOM_API at::Tensor loss_sum(const at::Tensor& part, const at::Tensor& labels) const;
  // The loss and each position's log-probability from the head's input `hidden` [B, T, H], whole
  // on every rank, through this rank's rows `weight` with the family's `head` (kit 4.2):
  // next_token_loss_sum_from_hidden and next_token_logps_from_hidden, over a group their
  // vocabulary-parallel forms.
  LOOM_API at::Tensor loss_sum_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head) const;
  LOOM_API at::Tensor logps_from_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const HeadLogits& head,
                                        double temperature) const;
};

}  // namespace loom::kit
