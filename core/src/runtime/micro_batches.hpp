#pragma once
// The micro-batches a run trains on, drawn and collated as the trainer draws and collates them,
// and the largest of them for the planner: activations are sized for what the data makes, not for
// batch_size rows of max_length (with packing, or with short samples, most of that never exists).
#include <cstdint>
#include <string>
#include <vector>

#include "config/data.hpp"
#include "config/run_config.hpp"
#include "loom/collator.hpp"
#include "loom/tokenizer.hpp"
#include "runtime/packing.hpp"

namespace loom::core {

// Where the draws stand: the epoch, and the next sample's place in its order.
struct DrawCursor {
  std::uint64_t epoch = 0;
  std::size_t index = 0;
};

// The run's samples in the order every rank draws them: epoch after epoch of epoch_order().
class SampleDraws {
 public:
  SampleDraws(std::size_t samples, std::uint64_t seed, bool shuffle, DrawCursor at = DrawCursor{});
  std::vector<std::size_t> next(std::size_t count);  // indices into the dataset
  const DrawCursor& cursor() const { return cursor_; }

 private:
  std::size_t samples_;
  std::uint64_t seed_;
  bool shuffle_;
  DrawCursor cursor_;
  std::vector<std::size_t> order_;
};

// Steps of a run over `samples` samples: [train] max_steps, or its epochs' worth of draws by every
// data rank.
std::int64_t run_steps(const RunConfig& config, std::size_t samples, int data_ranks);

// A micro-batch as the trainer collates it: the collator's batch padded to its longest sample, or
// with [data] packing each sample collated alone and laid end to end in rows of max_length.
Batch collate_micro_batch(const std::vector<std::string>& samples, const Collator& collator, const Tokenizer& tokenizer, const RunConfig& config);

struct MicroBatchShape {
  std::int64_t rows = 0, cols = 0;
};
// The micro-batch of the most tokens (rows x cols) over every step of the run's draws, for every
// one of `data_ranks` ranks' shares. Each sample is collated alone once: a padded micro-batch is its
// kept samples as wide as the widest of them alone (a collator pads to the longest, or wider), a
// packed one what pack_rows() makes of their tokens. {0, 0} when no sample is kept.
MicroBatchShape largest_micro_batch(const Dataset& data, const Collator& collator, const Tokenizer& tokenizer, const RunConfig& config,
                                    int data_ranks);
// At least the largest batch the evaluator collates from `data` ([train] eval_samples of it, each
// rank's share in batches of batch_size): batch_size rows (fewer when a rank has fewer samples) as
// wide as the widest sample alone.
MicroBatchShape largest_eval_batch(const Dataset& data, const Collator& collator, const Tokenizer& tokenizer, const RunConfig& config,
                                   int data_ranks);

}  // namespace loom::core
