#include "runtime/micro_batches.hpp"

#include <algorithm>
#include <optional>

#include "distributed/data_parallel.hpp"

namespace loom::core {

SampleDraws::SampleDraws(std::size_t samples, std::uint64_t seed, bool shuffle, DrawCursor at)
    : samples_(samples), seed_(seed), shuffle_(shuffle), cursor_(at), order_(epoch_order(samples, seed, at.epoch, shuffle)) {}

std::vector<std::size_t> SampleDraws::next(std::size_t count) {
  std::vector<std::size_t> out;
  if (samples_ == 0) return out;
  while (out.size() < count) {
    if (cursor_.index >= order_.size()) {
      ++cursor_.epoch;
      cursor_.index = 0;
      order_ = epoch_order(samples_, seed_, cursor_.epoch, shuffle_);
    }
    out.push_back(order_[cursor_.index++]);
  }
  return out;
}

std::int64_t run_steps(const RunConfig& config, std::size_t samples, int data_ranks) {
  if (config.max_steps > 0) return config.max_steps;
  const auto per_step = static_cast<std::size_t>(config.batch_size * config.grad_accum * data_ranks);
  return static_cast<std::int64_t>((samples * static_cast<std::size_t>(config.epochs) + per_step - 1) / per_step);
}

Batch collate_micro_batch(const std::vector<std::string>& samples, const Collator& collator, const Tokenizer& tokenizer, const RunConfig& config) {
  if (!config.packing) return collator.collate(samples, tokenizer, config.collate);
  std::vector<Batch> alone;
  std::int64_t skipped = 0;
  for (const auto& sample : samples) {
    Batch one = collator.collate({sample}, tokenizer, config.collate);
    skipped += one.skipped;
    if (one.rows == 1) alone.push_back(std::move(one));
  }
  Batch packed = pack_samples(alone, config.collate.max_length, parse_packer(config.packer), 0);
  packed.skipped = skipped;
  return packed;
}

namespace {

// A sample collated alone: its tokens (what packing lays in a row) and its width (what a padded batch
// takes), both 0 where the collator drops it.
struct Alone {
  std::int64_t tokens = 0, width = 0;
};
Alone collate_alone(const std::string& sample, const Collator& collator, const Tokenizer& tokenizer, const RunConfig& config) {
  const Batch one = collator.collate({sample}, tokenizer, config.collate);
  if (one.rows != 1) return {};
  return {std::count_if(one.attention_mask.begin(), one.attention_mask.end(), [](std::int64_t m) { return m != 0; }), one.cols};
}

}  // namespace

MicroBatchShape largest_micro_batch(const Dataset& data, const Collator& collator, const Tokenizer& tokenizer, const RunConfig& config,
                                    int data_ranks) {
  // Each sample alone, found on its first draw.
  std::vector<std::optional<Alone>> alone(data.samples.size());
  const Packer packer = parse_packer(config.packer);
  SampleDraws draws(data.samples.size(), config.seed, config.shuffle);
  MicroBatchShape largest;
  const std::int64_t steps = run_steps(config, data.samples.size(), data_ranks);
  for (std::int64_t m = 0; m < steps * config.grad_accum; ++m) {
    const auto drawn = draws.next(static_cast<std::size_t>(config.batch_size * data_ranks));
    for (int rank = 0; rank < data_ranks; ++rank) {
      std::vector<std::int64_t> lengths;
      MicroBatchShape shape;
      for (const std::size_t i : share_of(drawn, rank, data_ranks)) {
        if (!alone[i]) alone[i] = collate_alone(data.samples[i], collator, tokenizer, config);
        lengths.push_back(alone[i]->tokens);
        if (alone[i]->tokens > 0) ++shape.rows;
        shape.cols = std::max(shape.cols, alone[i]->width);
      }
      if (config.packing) {
        const PackedRows rows = pack_rows(lengths, config.collate.max_length, packer);
        shape = {static_cast<std::int64_t>(rows.rows.size()), rows.longest};
      }
      if (shape.rows * shape.cols > largest.rows * largest.cols) largest = shape;
    }
  }
  return largest;
}

MicroBatchShape largest_eval_batch(const Dataset& data, const Collator& collator, const Tokenizer& tokenizer, const RunConfig& config,
                                   int data_ranks) {
  std::size_t count = data.samples.size();
  if (config.eval_samples > 0) count = std::min(count, static_cast<std::size_t>(config.eval_samples));
  const auto ranks = static_cast<std::size_t>(std::max(1, data_ranks));
  MicroBatchShape shape;
  shape.rows = std::min<std::int64_t>(std::max<std::int64_t>(1, config.batch_size), static_cast<std::int64_t>((count + ranks - 1) / ranks));
  for (std::size_t i = 0; i < count; ++i) shape.cols = std::max(shape.cols, collate_alone(data.samples[i], collator, tokenizer, config).width);
  if (shape.cols == 0) shape.rows = 0;
  return shape;
}

}  // namespace loom::core
