// Reward plugin `exact-answer`: a completion's answer, pulled out by a regular expression, equal
// to the sample's answer field (both trimmed of surrounding whitespace): `correct`, else `wrong`.
// A completion where the pattern finds nothing is wrong.
#include <memory>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/kit/regex.hpp"
#include "loom/plugin.hpp"
#include "loom/reward.hpp"

namespace loom::exact_answer {
namespace {

std::vector<OptionSpec> options() {
  return {
      OptionSpec::string("field", "answer", "the record field holding the correct answer"),
      OptionSpec::string("pattern", "", "a PCRE2 pattern whose match is the answer, e.g. \"-?[0-9]+\" (\"\": the whole completion)"),
      OptionSpec::string("take", "first", "which match is the answer when there are several").one_of({"first", "last"}),
      OptionSpec::real("correct", 1.0, "the reward of a correct answer"),
      OptionSpec::real("wrong", 0.0, "the reward of a wrong or missing one"),
  };
}

std::string trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return "";
  return std::string(s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1));
}

class ExactAnswer final : public Reward {
 public:
  explicit ExactAnswer(const Options& o)
      : field_(o.get_string("field")), last_(o.get_string("take") == "last"), correct_(o.get_float("correct")), wrong_(o.get_float("wrong")) {
    if (!o.get_string("pattern").empty()) pattern_ = std::make_unique<kit::Regex>(o.get_string("pattern"));
  }

  std::vector<double> score(const std::vector<Scored>& completions) const override {
    std::vector<double> out;
    for (std::size_t i = 0; i < completions.size(); ++i) {
      const auto record = nlohmann::json::parse(completions[i].record);
      const auto it = record.find(field_);
      if (it == record.end() || !(it->is_string() || it->is_number()))
        throw UserError("completion " + std::to_string(i + 1) + ": its sample has no field '" + field_ + "' holding a string or number to compare with");
      const std::string expected = trim(it->is_string() ? it->get<std::string>() : it->dump());
      out.push_back(answer_of(completions[i].completion) == std::optional<std::string>(expected) ? correct_ : wrong_);
    }
    return out;
  }

 private:
  std::optional<std::string> answer_of(const std::string& completion) const {
    if (!pattern_) return trim(completion);
    const auto matches = pattern_->find_all(completion);
    if (matches.empty()) return std::nullopt;
    const auto& [begin, end] = last_ ? matches.back() : matches.front();
    return trim(std::string_view(completion).substr(begin, end - begin));
  }

  std::string field_;
  std::unique_ptr<kit::Regex> pattern_;
  bool last_;
  double correct_, wrong_;
};

std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<ExactAnswer>(o); }

}  // namespace
}  // namespace loom::exact_answer

LOOM_PLUGIN(loom::kKindReward, "exact-answer", "0.1.0", "1 where the answer a regex pulls out of the completion equals the sample's answer field",
            loom::exact_answer::options, loom::exact_answer::create)
