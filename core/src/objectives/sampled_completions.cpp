#include "objectives/sampled_completions.hpp"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "config/data.hpp"
#include "loom/error.hpp"
#include "loom/kit/utf8.hpp"
#include "config/objective_data.hpp"

namespace loom::core {

SampledStep sample_step(const std::vector<std::string>& samples, const Session& session, const SamplingPlan& plan,
                        const SampleCompletions& sample, const SumOverRanks& sum_over_ranks) {
  const ObjectiveNeeds& needs = session.needs;
  const std::int64_t group = needs.sampling.group_size;
  const auto prompts_here = static_cast<std::int64_t>(samples.size());
  const ObjectiveSamples read(session.chat);
  std::vector<SampleWithRecord> parsed;
  std::vector<std::string> prompts;  // each prompt group_size times
  for (const auto& s : samples) {
    parsed.push_back(split_sample(s));
    const std::string prompt = read.prompt_text(parsed.back());
    for (std::int64_t g = 0; g < group; ++g) prompts.push_back(prompt);
  }
  GenerationSettings g;
  // Chat prompts: encoded as the template wrote them, each completion ending with the turn.
  g.templated = read.templated();
  std::string end_of_turn;
  if (g.templated && !parsed.empty()) end_of_turn = read.end_of_turn(parsed.front());
  if (!end_of_turn.empty()) g.stop_texts.push_back(end_of_turn);
  g.max_new_tokens = needs.sampling.max_tokens;
  g.temperature = needs.sampling.temperature;
  g.top_p = needs.sampling.top_p;
  g.top_k = needs.sampling.top_k;
  g.ignore_eos = needs.sampling.ignore_eos;
  g.seed = plan.seed;
  g.first_stream = plan.first_prompt * group;  // completion k of the step draws from stream k, on whichever rank
  g.max_positions = plan.max_positions;
  g.max_rows = std::max<std::int64_t>(1, static_cast<std::int64_t>(prompts.size()));
  const std::vector<Generated> completions = sample(prompts, g);

  // Every reward's scores, then their weighted sum.
  std::vector<Scored> scored;
  for (std::size_t i = 0; i < completions.size(); ++i)
    scored.push_back({prompts[i], kit::replace_invalid_utf8(completions[i].text), parsed[i / static_cast<std::size_t>(group)].record.dump(
                                                                                       -1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)});
  const std::size_t n = completions.size(), rewards = session.rewards.size();
  // Per completion: each reward, the combined reward, its length and whether it ran to the limit.
  const std::size_t width = rewards + 3;
  std::vector<double> mine(n * width, 0.0);
  for (std::size_t r = 0; r < rewards && plan.scores; ++r) {
    const auto& named = session.rewards[r];
    const std::vector<double> scores = named.reward->score(scored);
    if (scores.size() != n)
      throw UserError("[reward." + named.name + "] gave " + std::to_string(scores.size()) + " scores for " + std::to_string(n) + " completions");
    for (std::size_t i = 0; i < n; ++i) {
      if (!std::isfinite(scores[i]))
        throw UserError("[reward." + named.name + "] scored completion " + std::to_string(i + 1) + " of this step " + std::to_string(scores[i]) +
                        "; a reward must be a finite number");
      mine[i * width + r] = scores[i];
      mine[i * width + rewards] += named.weight * scores[i];
    }
  }
  for (std::size_t i = 0; i < n && plan.scores; ++i) {
    const auto& ids = completions[i].ids;
    mine[i * width + rewards + 1] = static_cast<double>(ids.size());
    const bool ended = (!ids.empty() && session.tokenizer->special_tokens().eos && ids.back() == *session.tokenizer->special_tokens().eos) ||
                       (!end_of_turn.empty() && session.tokenizer->decode(ids, false).find(end_of_turn) != std::string::npos);
    mine[i * width + rewards + 2] = !ended && static_cast<std::int64_t>(ids.size()) >= needs.sampling.max_tokens ? 1.0 : 0.0;
  }
  // The step's table over every data rank, in rank order (each replica's scoring rank fills its
  // own slots; every other rank adds zeros).
  const std::size_t per_rank = n * width;
  std::vector<double> table(per_rank * static_cast<std::size_t>(plan.data_ranks), 0.0);
  std::copy(mine.begin(), mine.end(), table.begin() + static_cast<std::ptrdiff_t>(per_rank * static_cast<std::size_t>(plan.data_rank)));
  table = sum_over_ranks(std::move(table));
  const auto all = static_cast<std::int64_t>(table.size() / width);
  const at::Tensor values = at::tensor(table, at::kDouble).view({all, static_cast<std::int64_t>(width)});
  const at::Tensor combined = values.select(1, static_cast<std::int64_t>(rewards)).reshape({all / group, group});
  // Finite scores can still overflow: their weighted sum, a group's mean and spread, the float the
  // loss takes. Every rank sees the same table, so all of them stop here alike.
  const auto reward_range = [&] {
    char text[96];
    std::snprintf(text, sizeof text, "from %g to %g", combined.min().item<double>(), combined.max().item<double>());
    return std::string(text);
  };
  if (!at::isfinite(combined).all().item<bool>())
    throw UserError("this step's weighted rewards overflow (each [reward.NAME] score times its weight, summed, passes what a double holds); "
                    "scale the rewards or their weights down");
  const bool spread_overflows = group > 1 && !at::isfinite(combined.std(1, true)).all().item<bool>();
  const at::Tensor advantages = session.objective->advantages(combined.clone());
  if (advantages.sizes() != combined.sizes())
    throw UserError("the objective gave advantages of another shape than the rewards [" + std::to_string(all / group) + ", " + std::to_string(group) + "]");
  // An infinite spread gives advantages of 0 (r / inf): finite, and nothing learnt.
  if (spread_overflows || !at::isfinite(combined.mean(1)).all().item<bool>() || !at::isfinite(advantages.to(at::kFloat)).all().item<bool>())
    throw UserError("this step's rewards (" + reward_range() + ") overflow their groups' mean or spread, or the float the advantages take: "
                    "scale the rewards down (e.g. to within +-1e6)");
  const at::Tensor my_advantages =
      advantages.reshape({all}).narrow(0, plan.data_rank * static_cast<std::int64_t>(n), static_cast<std::int64_t>(n)).to(at::kFloat).contiguous();

  SampledStep out;
  const auto stat = [&](const std::string& name, const at::Tensor& v) { out.metrics.emplace_back(name, v.item<double>()); };
  stat("reward", combined.mean());
  stat("reward_std", combined.std(1, true).mean());  // TRL's: the groups' standard deviations, averaged
  stat("frac_reward_zero_std", (combined.std(1, true) < 1e-6).to(at::kDouble).mean());
  for (std::size_t r = 0; r < rewards; ++r) {
    const at::Tensor v = values.select(1, static_cast<std::int64_t>(r));
    stat("rewards/" + session.rewards[r].name + "/mean", v.mean());
    stat("rewards/" + session.rewards[r].name + "/std", all > 1 ? v.std() : at::zeros({}, at::kDouble));
  }
  const at::Tensor lengths = values.select(1, static_cast<std::int64_t>(rewards + 1));
  stat("completions/mean_length", lengths.mean());
  stat("completions/min_length", lengths.min());
  stat("completions/max_length", lengths.max());
  stat("completions/clipped_ratio", values.select(1, static_cast<std::int64_t>(rewards + 2)).mean());

  // The rows, micro-batch by micro-batch: nothing is cut (a completion is at most max_tokens).
  const auto pad = session.tokenizer->special_tokens().pad;
  if (!pad) throw UserError("the tokenizer has no padding token; set [tokenizer] pad_token (e.g. \"eos\")");
  CollateSettings whole;
  whole.max_length = std::int64_t{1} << 40;
  for (std::int64_t from = 0; from < prompts_here; from += plan.micro_prompts) {
    const std::int64_t count = std::min(plan.micro_prompts, prompts_here - from);
    std::vector<kit::LabeledRow> rows;
    for (std::int64_t p = from; p < from + count; ++p) {
      const auto prompt = read.prompt_ids(parsed[static_cast<std::size_t>(p)], *session.tokenizer);
      for (std::int64_t k = p * group; k < (p + 1) * group; ++k) rows.push_back(completion_row(prompt, completions[static_cast<std::size_t>(k)].ids));
    }
    out.micro.push_back(kit::pad_rows(std::move(rows), whole, *pad, session.tokenizer->pad_left()));
    if (out.micro.back().rows != count * group) throw std::logic_error("a sampled completion's row was dropped: its advantage would go to another");
    out.advantages.push_back(my_advantages.narrow(0, from * group, count * group));
  }
  return out;
}

}  // namespace loom::core
