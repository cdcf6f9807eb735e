// Objective plugin `grpo`: Group Relative Policy Optimization (Shao et al. 2024), as TRL's
// GRPOTrainer computes it with one update per generation. The host samples num_generations
// completions of each prompt from the model being trained and scores them with the pipeline's
// [reward.NAME] sections; each completion's advantage is its reward less its group's mean, divided
// by the group's standard deviation (scale_rewards = "group"), the batch's ("batch"), or not
// ("none"). The per-token loss is PPO's clipped surrogate,
//   -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A),   ratio = exp(logp - logp_sampled)
// plus beta times the k3 estimate of the KL divergence to the reference model,
//   exp(ref - logp) - (ref - logp) - 1,
// reduced as TRL's loss_type says: "grpo" each completion's token mean, averaged over completions;
// "dr_grpo" the token sum over completions x max_completion_length; "dapo" the token sum over the
// step's completion tokens.
#include <ATen/ATen.h>

#include "loom/error.hpp"
#include "loom/objective.hpp"
#include "loom/plugin.hpp"

namespace loom::grpo {
namespace {

std::vector<OptionSpec> options() {
  return {
      OptionSpec::integer("num_generations", 8, "completions sampled per prompt (a group)").at_least(2).at_most(1 << 12),
      OptionSpec::integer("max_completion_length", 256, "the longest completion, in tokens").at_least(1).at_most(1 << 16),
      OptionSpec::real("temperature", 1.0, "sampling temperature").at_least(1e-3).at_most(100),
      OptionSpec::real("top_p", 1.0, "nucleus sampling: the smallest set of likeliest tokens holding this much probability").at_least(1e-6).at_most(1),
      OptionSpec::integer("top_k", 0, "sample only from the k likeliest tokens (0: all)").at_least(0),
      OptionSpec::real("beta", 0.0, "weight of the KL penalty to the reference model (0: none, and no reference pass)").at_least(0),
      OptionSpec::real("epsilon", 0.2, "the clipping range's lower side: ratio >= 1 - epsilon").at_least(0).at_most(1),
      OptionSpec::real("epsilon_high", -1.0, "the clipping range's upper side: ratio <= 1 + epsilon_high (DAPO's clip-higher); negative: epsilon"),
      OptionSpec::string("loss_type", "dapo", "how the token losses are averaged: \"grpo\", \"dr_grpo\" or \"dapo\" (TRL's)")
          .one_of({"grpo", "dr_grpo", "dapo"}),
      OptionSpec::string("scale_rewards", "group", "divide advantages by the group's reward std (\"group\"), the batch's (\"batch\") or not (\"none\")")
          .one_of({"group", "batch", "none"}),
      OptionSpec::boolean("ignore_eos", false, "sample every completion to max_completion_length, past its end of sequence (benchmarks)"),
      OptionSpec::string("answer_field", "answer", "the record field evaluation's exact-match (and the exact-answer reward) compare with"),
  };
}

class Grpo final : public Objective {
 public:
  explicit Grpo(const Options& o)
      : beta_(o.get_float("beta")), epsilon_low_(o.get_float("epsilon")),
        epsilon_high_(o.get_float("epsilon_high") < 0 ? o.get_float("epsilon") : o.get_float("epsilon_high")),
        loss_type_(o.get_string("loss_type")), scale_(o.get_string("scale_rewards")) {
    needs_.data = ObjectiveData::kPrompts;
    needs_.reference = beta_ > 0;
    needs_.answer_field = o.get_string("answer_field");
    needs_.sampling.group_size = o.get_int("num_generations");
    needs_.sampling.max_tokens = o.get_int("max_completion_length");
    needs_.sampling.temperature = o.get_float("temperature");
    needs_.sampling.top_p = o.get_float("top_p");
    needs_.sampling.top_k = o.get_int("top_k");
    needs_.sampling.ignore_eos = o.get_bool("ignore_eos");
    needs_.metric_names = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"};
    if (beta_ > 0) needs_.metric_names.push_back("kl");
  }

  ObjectiveNeeds needs() const override { return needs_; }

  at::Tensor advantages(const at::Tensor& rewards) const override {
    const at::Tensor centred = rewards - rewards.mean(1, true);
    if (scale_ == "none") return centred;
    // torch's std (Bessel's correction) and TRL's 1e-4, so a group whose rewards tie gets 0.
    const at::Tensor spread = scale_ == "group" ? rewards.std(1, true, true) : rewards.std().expand({rewards.size(0), 1});
    return centred / (spread + 1e-4);
  }

  ObjectiveLoss loss(const ObjectiveRows& rows) const override {
    const at::Tensor logp = rows.token_logps();
    const at::Tensor& mask = rows.mask;
    const at::Tensor advantage = rows.advantages.to(logp.device()).unsqueeze(1);
    const at::Tensor ratio = (logp - logp.detach()).exp();
    const at::Tensor clipped = ratio.clamp(1 - epsilon_low_, 1 + epsilon_high_);
    at::Tensor per_token = -at::min(ratio * advantage, clipped * advantage);
    ObjectiveLoss out;
    if (beta_ > 0) {
      const at::Tensor gap = rows.reference_logps - logp;
      const at::Tensor kl = gap.exp() - gap - 1;
      per_token = per_token + beta_ * kl;
      out.metrics.push_back({"kl", (kl.detach() * mask).sum(), rows.tokens});
    }
    per_token = per_token * mask;
    if (loss_type_ == "grpo") out.loss = (per_token.sum(1) / mask.sum(1).clamp_min(1)).sum() / rows.step_rows;
    else if (loss_type_ == "dr_grpo") out.loss = per_token.sum() / (rows.step_rows * static_cast<double>(needs_.sampling.max_tokens));
    else out.loss = per_token.sum() / rows.step_tokens;
    const at::Tensor low = (ratio.detach() < 1 - epsilon_low_) & (advantage < 0), high = (ratio.detach() > 1 + epsilon_high_) & (advantage > 0);
    const double tokens = rows.tokens;
    out.metrics.push_back({"clip_ratio/low_mean", (low.to(at::kFloat) * mask).sum(), tokens});
    out.metrics.push_back({"clip_ratio/high_mean", (high.to(at::kFloat) * mask).sum(), tokens});
    out.metrics.push_back({"clip_ratio/region_mean", ((low | high).to(at::kFloat) * mask).sum(), tokens});
    return out;
  }

 private:
  double beta_, epsilon_low_, epsilon_high_;
  std::string loss_type_, scale_;
  ObjectiveNeeds needs_;
};

std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<Grpo>(o); }

}  // namespace
}  // namespace loom::grpo

LOOM_PLUGIN(loom::kKindObjective, "grpo", "0.1.0",
            "GRPO: completions sampled in the loop, scored by rewards, the clipped surrogate with an optional KL penalty (TRL's loss types)",
            loom::grpo::options, loom::grpo::create)
