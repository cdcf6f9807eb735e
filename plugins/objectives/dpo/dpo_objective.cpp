// Objective plugin `dpo`: Direct Preference Optimization (Rafailov et al. 2023) on pairs of a
// chosen and a rejected completion of one prompt, against the reference model (the model as the
// run started), with TRL's DPOTrainer's losses and metric names: each completion's log-probability
// is the sum over its tokens (IPO: their mean), logits = (chosen - rejected) - (reference chosen -
// reference rejected), and
//   sigmoid: -log sigmoid(beta logits) (1 - label_smoothing) - log sigmoid(-beta logits) label_smoothing
//   hinge:   relu(1 - beta logits)
//   ipo:     (logits - 1 / (2 beta))^2
// averaged over the step's pairs.
#include <ATen/ATen.h>

#include "loom/error.hpp"
#include "loom/objective.hpp"
#include "loom/plugin.hpp"

namespace loom::dpo {
namespace {

std::vector<OptionSpec> options() {
  return {
      OptionSpec::real("beta", 0.1, "how far from the reference the policy may move: higher keeps it closer").at_least(1e-6),
      OptionSpec::string("loss_type", "sigmoid", "\"sigmoid\" (DPO), \"ipo\" (IPO, on per-token mean log-probabilities) or \"hinge\" (SLiC)")
          .one_of({"sigmoid", "ipo", "hinge"}),
      OptionSpec::real("label_smoothing", 0.0, "sigmoid: the assumed fraction of pairs whose preference is wrong (cDPO)").at_least(0).at_most(0.5),
      OptionSpec::string("chosen_field", "chosen", "the record field holding the preferred completion"),
      OptionSpec::string("rejected_field", "rejected", "the record field holding the rejected completion"),
      OptionSpec::string("answer_field", "", "the record field evaluation's exact-match compares the greedy answer with (\"\": chosen_field)"),
  };
}

class Dpo final : public Objective {
 public:
  explicit Dpo(const Options& o)
      : beta_(o.get_float("beta")), loss_type_(o.get_string("loss_type")), smoothing_(o.get_float("label_smoothing")) {
    needs_.data = ObjectiveData::kPreferences;
    needs_.reference = true;
    needs_.chosen_field = o.get_string("chosen_field");
    needs_.rejected_field = o.get_string("rejected_field");
    needs_.answer_field = o.get_string("answer_field");
    if (needs_.chosen_field == needs_.rejected_field) throw UserError("chosen_field and rejected_field name the same field '" + needs_.chosen_field + "'");
    if (smoothing_ > 0 && loss_type_ != "sigmoid") throw UserError("label_smoothing applies to loss_type = \"sigmoid\" only");
    needs_.metric_names = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"};
  }

  ObjectiveNeeds needs() const override { return needs_; }

  ObjectiveLoss loss(const ObjectiveRows& rows) const override {
    const std::int64_t n = rows.pairs;
    at::Tensor policy = rows.token_logps().sum(1);
    at::Tensor reference = rows.reference_logps.sum(1);
    if (loss_type_ == "ipo") {  // IPO compares mean log-probabilities (TRL divides by the completion's tokens)
      const at::Tensor tokens = rows.mask.sum(1).clamp_min(1);
      policy = policy / tokens;
      reference = reference / tokens;
    }
    const at::Tensor chosen = policy.narrow(0, 0, n), rejected = policy.narrow(0, n, n);
    const at::Tensor ref_chosen = reference.narrow(0, 0, n), ref_rejected = reference.narrow(0, n, n);
    const at::Tensor logits = (chosen - rejected) - (ref_chosen - ref_rejected);
    at::Tensor losses;
    if (loss_type_ == "sigmoid") losses = -at::log_sigmoid(beta_ * logits) * (1 - smoothing_) - at::log_sigmoid(-beta_ * logits) * smoothing_;
    else if (loss_type_ == "hinge") losses = at::relu(1 - beta_ * logits);
    else losses = (logits - 1 / (2 * beta_)).pow(2);
    const at::Tensor chosen_rewards = beta_ * (chosen - ref_chosen).detach();
    const at::Tensor rejected_rewards = beta_ * (rejected - ref_rejected).detach();
    const auto count = static_cast<double>(n);
    ObjectiveLoss out;
    out.loss = losses.sum() / rows.step_rows;
    out.metrics = {{"rewards/chosen", chosen_rewards.sum(), count},
                   {"rewards/rejected", rejected_rewards.sum(), count},
                   {"rewards/accuracies", (chosen_rewards > rejected_rewards).to(at::kFloat).sum(), count},
                   {"rewards/margins", (chosen_rewards - rejected_rewards).sum(), count},
                   {"logps/chosen", chosen.detach().sum(), count},
                   {"logps/rejected", rejected.detach().sum(), count}};
    return out;
  }

 private:
  double beta_;
  std::string loss_type_;
  double smoothing_;
  ObjectiveNeeds needs_;
};

std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<Dpo>(o); }

}  // namespace
}  // namespace loom::dpo

LOOM_PLUGIN(loom::kKindObjective, "dpo", "0.1.0", "Direct Preference Optimization on chosen/rejected pairs (sigmoid, IPO, hinge), TRL's formulas",
            loom::dpo::options, loom::dpo::create)
