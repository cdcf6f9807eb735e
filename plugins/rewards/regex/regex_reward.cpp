// Reward plugin `regex`: a format reward, `matched` where the completion has the form a regular
// expression describes (the whole completion, or a match anywhere in it), else `unmatched`.
#include <memory>

#include "loom/kit/regex.hpp"
#include "loom/plugin.hpp"
#include "loom/reward.hpp"

namespace loom::regex_reward {
namespace {

std::vector<OptionSpec> options() {
  return {
      OptionSpec::string("pattern", std::nullopt, "a PCRE2 pattern, e.g. \"^<think>[\\\\s\\\\S]*</think>\"").require(),
      OptionSpec::boolean("whole", true, "the whole completion must match (false: a match anywhere in it)"),
      OptionSpec::real("matched", 1.0, "the reward of a completion that matches"),
      OptionSpec::real("unmatched", 0.0, "the reward of one that does not"),
  };
}

class RegexReward final : public Reward {
 public:
  explicit RegexReward(const Options& o)
      : pattern_(o.get_string("pattern")), whole_(o.get_bool("whole")), matched_(o.get_float("matched")), unmatched_(o.get_float("unmatched")) {}

  std::vector<double> score(const std::vector<Scored>& completions) const override {
    std::vector<double> out;
    for (const auto& c : completions) {
      const bool hit = whole_ ? pattern_.full_match(c.completion) : !pattern_.find_all(c.completion).empty();
      out.push_back(hit ? matched_ : unmatched_);
    }
    return out;
  }

 private:
  kit::Regex pattern_;
  bool whole_;
  double matched_, unmatched_;
};

std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<RegexReward>(o); }

}  // namespace
}  // namespace loom::regex_reward

LOOM_PLUGIN(loom::kKindReward, "regex", "0.1.0", "a format reward: 1 where the completion matches a regular expression", loom::regex_reward::options,
            loom::regex_reward::create)
