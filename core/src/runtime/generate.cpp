#include "runtime/generate.hpp"

#include <chrono>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"

namespace loom::core {

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
    encoded.push_back(tokenizer.encode(p, Specials::kPrompt).ids);
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

  auto gen = at::make_generator<at::CPUGeneratorImpl>(settings.seed);
  // Rows of the embedding past the tokenizer's vocabulary (padding, or a model larger than its
  // tokenizer) name no token: they are never chosen.
  const std::int64_t choosable = tokenizer.vocab_size();
  KVCache cache;
  const auto started = std::chrono::steady_clock::now();
  auto prompt_done = started;
  std::int64_t steps = 0;
  std::vector<std::vector<std::int64_t>> out(prompts.size());
  std::vector<bool> done(prompts.size(), false);
  for (std::int64_t step = 0; step < settings.max_new_tokens; ++step) {
    at::Tensor logits = next_logits(input, positions, attention, &cache);  // on the CPU: the step has finished
    if (step == 0) prompt_done = std::chrono::steady_clock::now();
    ++steps;
    if (choosable > 0 && logits.size(-1) > choosable) logits = logits.narrow(-1, 0, choosable);
    at::Tensor next;
    if (settings.temperature <= 0) {
      next = logits.argmax(-1);
    } else {
      // Scaled from the largest logit down, in fp32: a tiny temperature sends every other logit
      // to -inf (sampling becomes greedy) instead of the largest to +inf (NaN probabilities); below
      // fp32's smallest normal it could not be told from zero.
      const at::Tensor wide = logits.to(at::kFloat);
      const double temperature = std::max(settings.temperature, static_cast<double>(std::numeric_limits<float>::min()));
      at::Tensor probs = at::softmax((wide - std::get<0>(wide.max(-1, /*keepdim=*/true))) / temperature, -1);
      if (settings.top_p < 1.0) {  // keep the smallest set of tokens whose probability reaches top_p
        auto [sorted, order] = probs.sort(-1, /*descending=*/true);
        const at::Tensor outside = (sorted.cumsum(-1) - sorted) > settings.top_p;
        sorted = sorted.masked_fill(outside, 0);
        probs = at::zeros_like(probs).scatter(-1, order, sorted);
      }
      next = at::multinomial(probs, 1, false, gen).squeeze(-1);
    }
    bool all_done = true;
    for (std::int64_t b = 0; b < batch; ++b) {
      if (done[b]) continue;
      const std::int64_t token = next[b].item<std::int64_t>();
      if (token == eos) done[b] = true;
      else out[b].push_back(token);
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
  for (const auto& o : out) texts.push_back(tokenizer.decode(o, true));
  return texts;
}

}  // namespace loom::core
