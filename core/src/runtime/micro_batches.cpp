#include "runtime/micro_batches.hpp"

#include <algorithm>

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

MicroBatchShape largest_micro_batch(const Dataset& data, const Collator& collator, const Tokenizer& tokenizer, const RunConfig& config,
                                    int data_ranks) {
  // Each sample's tokens when collated alone (0: the collator drops it), found on first draw.
  std::vector<std::int64_t> length(data.samples.size(), -1);
  const auto length_of = [&](std::size_t i) {
    if (length[i] < 0) {
      const Batch one = collator.collate({data.samples[i]}, tokenizer, config.collate);
      length[i] = one.rows == 1 ? std::count_if(one.attention_mask.begin(), one.attention_mask.end(), [](std::int64_t m) { return m != 0; }) : 0;
    }
    return length[i];
  };
  const Packer packer = parse_packer(config.packer);
  SampleDraws draws(data.samples.size(), config.seed, config.shuffle);
  MicroBatchShape largest;
  const std::int64_t steps = run_steps(config, data.samples.size(), data_ranks);
  for (std::int64_t m = 0; m < steps * config.grad_accum; ++m) {
    const auto drawn = draws.next(static_cast<std::size_t>(config.batch_size * data_ranks));
    for (int rank = 0; rank < data_ranks; ++rank) {
      std::vector<std::int64_t> lengths;
      for (const std::size_t i : share_of(drawn, rank, data_ranks)) lengths.push_back(length_of(i));
      MicroBatchShape shape;
      if (config.packing) {
        const PackedRows rows = pack_rows(lengths, config.collate.max_length, packer);
        shape = {static_cast<std::int64_t>(rows.rows.size()), rows.longest};
      } else {
        shape.rows = std::count_if(lengths.begin(), lengths.end(), [](std::int64_t l) { return l > 0; });
        shape.cols = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
      }
      if (shape.rows * shape.cols > largest.rows * largest.cols) largest = shape;
    }
  }
  return largest;
}

}  // namespace loom::core
