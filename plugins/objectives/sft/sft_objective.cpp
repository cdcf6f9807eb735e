// Objective plugin `sft`: supervised fine-tuning, the next-token loss on the labelled tokens
// (the collator's), averaged over every labelled token of the step. The default objective.
#include <ATen/ATen.h>

#include "loom/objective.hpp"
#include "loom/plugin.hpp"

namespace loom::sft {
namespace {

std::vector<OptionSpec> options() { return {}; }

class Sft final : public Objective {
 public:
  ObjectiveNeeds needs() const override { return {}; }
  ObjectiveLoss loss(const ObjectiveRows& rows) const override { return {rows.loss_sum() / rows.step_tokens, {}}; }
};

std::unique_ptr<Plugin> create(const Options&) { return std::make_unique<Sft>(); }

}  // namespace
}  // namespace loom::sft

LOOM_PLUGIN(loom::kKindObjective, "sft", "0.1.0", "supervised fine-tuning: the next-token loss on the labelled tokens", loom::sft::options,
            loom::sft::create)
