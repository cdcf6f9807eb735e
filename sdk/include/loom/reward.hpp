#pragma once
// How good a sampled completion is (SDK 3.12), for an objective that samples (ObjectiveData::kPrompts).
// A pipeline names its rewards as [reward.NAME] sections, each with its plugin, its options and a
// `weight`; a completion's reward is the weighted sum, and each reward is logged under its name.
#include <string>
#include <vector>

#include "loom/export.hpp"
#include "loom/plugin.hpp"

namespace loom {

struct Scored {
  std::string prompt;      // as the model read it
  std::string completion;  // as sampled, special tokens left out
  std::string record;      // the data record the prompt came from, as a JSON object's text
};

class LOOM_API Reward : public Plugin {
 public:
  ~Reward() override;  // defined in the SDK library: one typeinfo for host and plugins
  // One finite score per completion, in order. A completion it cannot judge is a UserError naming
  // it, never a silent zero.
  virtual std::vector<double> score(const std::vector<Scored>& completions) const = 0;
};

}  // namespace loom
