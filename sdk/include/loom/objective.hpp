#pragma once
// What training minimises (SDK 3.12): supervised fine-tuning's next-token loss, a preference loss
// over pairs of completions (DPO), or a policy-gradient loss over completions the model samples
// itself and rewards score (GRPO). An objective says what its rows are made of; the host reads the
// data, samples and scores completions, runs the reference passes, places and schedules the
// passes, and hands each micro-batch's rows to loss() on the rank that computes the head.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/plugin.hpp"

namespace loom {

enum class ObjectiveData {
  // Each record rendered by [data] format (or a chat format) and labelled by the collator: one row a sample.
  kText,
  // Each record a prompt (rendered by [data] format) and two completions, its fields `chosen` and
  // `rejected` (ObjectiveNeeds): a micro-batch's rows are the pairs' chosen rows, then their
  // rejected rows in the same order, labelled on the completions.
  kPreferences,
  // Each record a prompt (rendered by [data] format): the host samples `group_size` completions of
  // each from the model being trained, scores them with the pipeline's rewards and gives each
  // completion its advantage (Objective::advantages); rows are prompt + completion, labelled on the
  // completion.
  kPrompts,
};

// How the host samples completions for kPrompts.
struct CompletionSampling {
  std::int64_t group_size = 8;          // completions per prompt
  std::int64_t max_tokens = 256;        // the longest completion
  double temperature = 1.0;             // > 0
  double top_p = 1.0;
  std::int64_t top_k = 0;               // 0: every token
  bool ignore_eos = false;              // every completion max_tokens long (benchmarks)
};

struct ObjectiveNeeds {
  ObjectiveData data = ObjectiveData::kText;
  // The reference model's log-probabilities of each labelled token (ObjectiveRows::reference_logps):
  // the model as the run started (the base with the adapter as it was loaded, or switched off when
  // it starts fresh; a full fine-tune's starting weights), computed without gradients.
  bool reference = false;
  // kPreferences: the record fields holding the two completions.
  std::string chosen_field = "chosen", rejected_field = "rejected";
  // kPreferences and kPrompts: the record field evaluation's exact-match compares a greedy answer
  // with (kPreferences: chosen_field when empty).
  std::string answer_field;
  CompletionSampling sampling;  // kPrompts
  // The metrics loss() gives (ObjectiveMetric::name), every one every call: the ranks that compute
  // no head sum them too, knowing only their names.
  std::vector<std::string> metric_names;
};

// One micro-batch as the objective sees it, on the head's device. Row r's token t is labelled when
// mask[r][t] is 1 (its log-probability is that of the token at t given the tokens before it).
struct ObjectiveRows {
  std::int64_t rows = 0;
  at::Tensor mask;  // [rows, T] float32
  // The summed next-token cross-entropy over the labelled tokens (the memory-lean fused form):
  // supervised fine-tuning's loss.
  std::function<at::Tensor()> loss_sum;
  // Each labelled token's log-probability under the model being trained, [rows, T] float32, 0 where
  // not labelled; differentiable. Made once per call: call it once. kPrompts: of the logits divided
  // by the sampling temperature (the distribution the completions were drawn from, as TRL does),
  // here and in reference_logps.
  std::function<at::Tensor()> token_logps;
  at::Tensor reference_logps;  // [rows, T] float32, 0 where not labelled; defined when needs().reference
  // kPrompts: each row's advantage [rows] float32. The rows were sampled from the weights being
  // trained, as they were before this step's update: the sampling policy's log-probabilities are
  // token_logps' values (PPO's ratio is exp(logp - logp.detach())).
  at::Tensor advantages;
  std::int64_t pairs = 0;  // kPreferences: rows [0, pairs) chosen, [pairs, 2 pairs) rejected
  double tokens = 0;       // this micro-batch's labelled tokens (known on the host: no device sync)
  // The step's totals over every micro-batch and data rank: a loss normalised by them gives, summed
  // over the ranks' gradients, one process's gradient over the global batch.
  double step_rows = 0;    // rows (kPreferences: pairs)
  double step_tokens = 0;  // labelled tokens
};

// A value the host averages over the step and logs under `name`: sum / count, both summed over the
// step's micro-batches and every data rank.
struct ObjectiveMetric {
  std::string name;
  at::Tensor sum;  // a scalar on any device, without gradient
  double count = 1;
};

struct ObjectiveLoss {
  at::Tensor loss;  // the micro-batch's share of the step's loss: the host runs backward on it
  std::vector<ObjectiveMetric> metrics;
};

class LOOM_API Objective : public Plugin {
 public:
  ~Objective() override;  // defined in the SDK library: one typeinfo for host and plugins
  virtual ObjectiveNeeds needs() const = 0;
  virtual ObjectiveLoss loss(const ObjectiveRows& rows) const = 0;
  // kPrompts: each completion's advantage from the combined rewards of the step's completions,
  // [prompts, group_size] float64 on the CPU (every data rank's prompts, in rank order). The default
  // throws: an objective of another data form is never asked.
  virtual at::Tensor advantages(const at::Tensor& rewards) const;
};

}  // namespace loom
