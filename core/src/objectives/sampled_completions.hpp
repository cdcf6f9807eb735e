#pragma once
// One step's rows for an objective that samples (ObjectiveData::kPrompts): each of this rank's
// prompts continued `group_size` times by the model being trained, the completions scored by the
// pipeline's rewards, the scores gathered over the data ranks so every group's advantages are
// computed from the whole step's, and the rows (prompt + completion, labelled on the completion)
// cut into micro-batches.
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "config/session.hpp"
#include "generation/generate.hpp"

namespace loom::core {

struct SampledStep {
  std::vector<Batch> micro;               // one per micro-batch
  std::vector<at::Tensor> advantages;     // each micro-batch's rows' [rows] float32
  std::vector<std::pair<std::string, double>> metrics;  // over the whole step (every data rank)
};

struct SamplingPlan {
  std::int64_t first_prompt = 0;      // the global index of this rank's first prompt in the step
  std::int64_t micro_prompts = 1;     // prompts per micro-batch
  std::uint64_t seed = 0;             // the step's sampling seed
  std::int64_t max_positions = 0;     // the model's
  std::int64_t data_ranks = 1;
  std::int64_t data_rank = 0;
  // Whether this rank scores the completions: one rank of each replica does (its pipeline and
  // tensor ranks hold the same completions), so a reward with effects, such as a command, runs once.
  bool scores = true;
};

using SampleCompletions = std::function<std::vector<Generated>(const std::vector<std::string>& prompts, const GenerationSettings& settings)>;
// Sums each value over every rank that samples: the replica's ranks and the data ranks.
using SumOverRanks = std::function<std::vector<double>(std::vector<double>)>;

// `samples`: this rank's share of the step's prompts (samples with their records), every rank's
// share the same size.
SampledStep sample_step(const std::vector<std::string>& samples, const Session& session, const SamplingPlan& plan,
                        const SampleCompletions& sample, const SumOverRanks& sum_over_ranks);

}  // namespace loom::core
