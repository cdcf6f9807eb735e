#include "runtime/generate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"

namespace loom::core {

std::mt19937_64 row_stream(std::uint64_t seed, std::int64_t row) {
  // Distinct, well-mixed seeds per row (splitmix64's constants), so rows never share a stream.
  std::uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(row + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return std::mt19937_64(z ^ (z >> 31));
}

at::Tensor choose_next(const at::Tensor& logits, const GenerationSettings& settings, std::vector<std::mt19937_64>& streams) {
  const at::Tensor values = logits.to(at::kCPU, at::kFloat).contiguous();
  const std::int64_t rows = values.size(0), width = values.size(1);
  const float* data = values.data_ptr<float>();
  std::vector<std::int64_t> chosen(static_cast<std::size_t>(rows));
  std::vector<double> probs(static_cast<std::size_t>(width));
  std::vector<std::int64_t> order(static_cast<std::size_t>(width));
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = data + r * width;
    std::int64_t best = 0;  // the first largest logit
    for (std::int64_t i = 1; i < width; ++i)
      if (row[i] > row[best]) best = i;
    if (!std::isfinite(row[best]))
      throw UserError("generate: the model's logits are not finite (NaN or infinite); its weights or the adapter diverged or are damaged");
    // One draw per row and step whatever the settings, so a row's stream never depends on others.
    const double u = static_cast<double>(streams[static_cast<std::size_t>(r)]() >> 11) * 0x1.0p-53;
    if (settings.temperature <= 0) {
      chosen[static_cast<std::size_t>(r)] = best;
      continue;
    }
    // Scaled from the largest logit down: a tiny temperature sends every other probability to 0
    // (sampling becomes greedy) instead of the largest to +inf.
    const double temperature = std::max(settings.temperature, static_cast<double>(std::numeric_limits<float>::min()));
    double total = 0;
    for (std::int64_t i = 0; i < width; ++i) {
      probs[static_cast<std::size_t>(i)] = std::exp((static_cast<double>(row[i]) - row[best]) / temperature);
      total += probs[static_cast<std::size_t>(i)];
    }
    // Most probable first (ties by id); nucleus: the smallest prefix whose probability reaches top_p.
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return probs[static_cast<std::size_t>(a)] > probs[static_cast<std::size_t>(b)];
    });
    std::size_t kept = 0;
    double mass = 0;
    while (kept < order.size() && (kept == 0 || mass / total < settings.top_p)) mass += probs[static_cast<std::size_t>(order[kept++])];
    // The token where the draw falls in the kept tokens' cumulative mass.
    const double target = u * mass;
    double running = 0;
    std::int64_t pick = order[kept - 1];
    for (std::size_t k = 0; k < kept; ++k) {
      running += probs[static_cast<std::size_t>(order[k])];
      if (target < running) {
        pick = order[k];
        break;
      }
    }
    chosen[static_cast<std::size_t>(r)] = pick;
  }
  return at::tensor(chosen, at::kLong);
}

std::vector<std::string> generate(const NextLogits& next_logits, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                  const GenerationSettings& settings) {
  if (prompts.empty()) return {};
  const auto specials = tokenizer.special_tokens();
  const std::int64_t pad = specials.pad.value_or(specials.eos.value_or(0));
  const std::int64_t eos = specials.eos.value_or(-1);
  torch::NoGradGuard no_grad;

  std::vector<std::vector<std::int64_t>> encoded;
  std::size_t width = 0;
  for (const auto& p : prompts) {
    encoded.push_back(tokenizer.encode(p, settings.templated ? Specials::kNone : Specials::kPrompt).ids);
    if (encoded.back().empty()) throw UserError("cannot generate from an empty prompt");
    width = std::max(width, encoded.back().size());
  }
  if (settings.max_positions > 0 && static_cast<std::int64_t>(width) + settings.max_new_tokens > settings.max_positions)
    throw UserError("a prompt of " + std::to_string(width) + " tokens and " + std::to_string(settings.max_new_tokens) +
                    " new ones pass the model's " + std::to_string(settings.max_positions) + " positions" +
                    (static_cast<std::int64_t>(width) < settings.max_positions
                         ? "; ask for at most " + std::to_string(settings.max_positions - static_cast<std::int64_t>(width)) + " new tokens"
                         : "; shorten the prompt"));
  const auto batch = static_cast<std::int64_t>(prompts.size());
  std::vector<std::int64_t> ids, mask;
  for (const auto& e : encoded) {  // left padding: every prompt ends at the last column
    for (std::size_t i = e.size(); i < width; ++i) {
      ids.push_back(pad);
      mask.push_back(0);
    }
    ids.insert(ids.end(), e.begin(), e.end());
    mask.insert(mask.end(), e.size(), 1);
  }
  at::Tensor input = at::tensor(ids, at::kLong).view({batch, -1});
  at::Tensor attention = at::tensor(mask, at::kLong).view({batch, -1});
  at::Tensor positions = (attention.cumsum(1) - 1).clamp_min(0);

  std::vector<std::mt19937_64> streams;
  for (std::int64_t b = 0; b < batch; ++b) streams.push_back(row_stream(settings.seed, b));
  // Rows of the embedding past the tokenizer's vocabulary (padding, or a model larger than its
  // tokenizer) name no token: they are never chosen.
  const std::int64_t choosable = tokenizer.vocab_size();
  KVCache cache;
  const auto started = std::chrono::steady_clock::now();
  auto prompt_done = started;
  std::int64_t steps = 0;
  std::vector<std::vector<std::int64_t>> out(prompts.size());
  std::vector<bool> done(prompts.size(), false);
  const bool keep_specials = settings.templated;
  // Where a row's text first holds a stop text (npos: nowhere yet).
  const auto stop_at = [&](const std::string& text) {
    std::size_t at = std::string::npos;
    for (const auto& stop : settings.stop_texts)
      if (!stop.empty()) at = std::min(at, text.find(stop));
    return at;
  };
  for (std::int64_t step = 0; step < settings.max_new_tokens; ++step) {
    at::Tensor logits = next_logits(input, positions, attention, &cache);  // on the CPU: the step has finished
    if (step == 0) prompt_done = std::chrono::steady_clock::now();
    ++steps;
    if (choosable > 0 && logits.size(-1) > choosable) logits = logits.narrow(-1, 0, choosable);
    const at::Tensor next = choose_next(logits, settings, streams);
    bool all_done = true;
    for (std::int64_t b = 0; b < batch; ++b) {
      if (done[b]) continue;
      const std::int64_t token = next[b].item<std::int64_t>();
      if (token == eos) done[b] = true;
      else {
        out[b].push_back(token);
        if (!settings.stop_texts.empty() && stop_at(tokenizer.decode(out[b], !keep_specials)) != std::string::npos) done[b] = true;
      }
      all_done = all_done && done[b];
    }
    if (all_done) break;
    input = next.view({batch, 1});
    attention = at::cat({attention, at::ones({batch, 1}, at::kLong)}, 1);
    positions = positions.select(1, -1).view({batch, 1}).to(at::kCPU) + 1;
  }
  const auto seconds = [](auto from, auto to) { return std::chrono::duration<double>(to - from).count(); };
  const double prompt_s = seconds(started, prompt_done), rest_s = seconds(prompt_done, std::chrono::steady_clock::now());
  spdlog::info("generate: {} prompt(s) of up to {} tokens: prompt pass {:.3f} s, then {} step(s) at {:.2f} ms each ({:.1f} new tokens/s)", batch,
               width, prompt_s, steps - 1, steps > 1 ? 1e3 * rest_s / static_cast<double>(steps - 1) : 0.0,
               rest_s > 0 ? static_cast<double>(batch * (steps - 1)) / rest_s : 0.0);
  std::vector<std::string> texts;
  for (const auto& o : out) {
    std::string text = tokenizer.decode(o, !keep_specials);
    if (const auto at = stop_at(text); at != std::string::npos) text.erase(at);
    texts.push_back(std::move(text));
  }
  return texts;
}

}  // namespace loom::core
