#include "runtime/evaluator.hpp"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "chat/chat_collator.hpp"
#include "runtime/folded_adapters.hpp"
#include "generation/generate.hpp"
#include "distributed/distributed.hpp"
#include "runtime/replica_outputs.hpp"

namespace loom::core {
namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

template <typename T>
std::vector<T> slice(const std::vector<T>& all, std::size_t from, std::size_t count) {
  const auto begin = all.begin() + static_cast<std::ptrdiff_t>(from);
  return std::vector<T>(begin, all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), from + count)));
}

}  // namespace

NextLogits next_logits_of(RankRuntime& runtime) {
  return [&runtime](const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass& pass) {
    return runtime.last_logits(ids, positions, mask, pass);
  };
}

void share_generation(GenerationSettings& g, RankRuntime& runtime, Parallel& parallel, c10::Device comm_device,
                      const std::function<std::int64_t(std::int64_t rows, std::int64_t capacity)>& generation_rows) {
  // Every prompt in one generation: a row that ends takes the next prompt (continuous batching).
  g.cuda_graph = runtime.graph_capturable(parallel);
  // Every stage and tensor rank of a replica makes the same cache (their passes exchange its rows):
  // the fewest rows any of them fits. A rank where none fits answers 0, and all refuse together.
  g.before_cache = [&parallel, comm_device, generation_rows](std::int64_t rows, std::int64_t capacity) {
    std::int64_t fit = rows;
    std::string refusal;
    if (generation_rows) try {
        fit = generation_rows(rows, capacity);
      } catch (const UserError& e) {
        fit = 0;
        refusal = e.what();
      }
    double fewest = static_cast<double>(fit);
    fewest = reduce_over(parallel.pipeline(), {fewest}, comm_device, ReduceOp::kMin)[0];
    fewest = reduce_over(parallel.tensor(), {fewest}, comm_device, ReduceOp::kMin)[0];
    if (expert_ranks(parallel) > 1) fewest = reduce_over(*expert_group(parallel), {fewest}, comm_device, ReduceOp::kMin)[0];
    if (fewest < 1)
      throw UserError(!refusal.empty() ? refusal
                                       : "generation's cache of one row of " + std::to_string(capacity) +
                                             " positions does not fit another rank of this replica; lower [data] max_length or the tokens to generate");
    return static_cast<std::int64_t>(fewest);
  };
}

Evaluator::Evaluator(RankRuntime& runtime, const Collator& collator, const Tokenizer& tokenizer, Parallel& parallel, c10::Device comm_device,
                     EvalSettings settings)
    : runtime_(runtime), collator_(collator), tokenizer_(tokenizer), parallel_(parallel), comm_device_(comm_device), settings_(settings) {}

EvalResult Evaluator::evaluate(const std::vector<std::string>& all) {
  torch::NoGradGuard no_grad;
  Executor& executor = runtime_.executor();
  executor.model().set_training(false);
  // The loss and the answers from W + D where an adapter's products cost a good share of its
  // layer's; the trained weights come back, bit for bit, when this goes.
  // The ranks of a tensor group, and of an expert group (which decode in lockstep), fold alike.
  const FoldedAdapters folded(executor.model(), FoldFor::kWhileEvaluating, [&](std::vector<double> fold) {
    fold = reduce_over(parallel_.tensor(), std::move(fold), comm_device_, ReduceOp::kMin);
    if (Communicator* experts = expert_group(parallel_); experts != nullptr && experts->size() > 1)
      fold = reduce_over(*experts, std::move(fold), comm_device_, ReduceOp::kMin);
    return fold;
  });
  std::size_t count = all.size();
  if (settings_.max_samples > 0) count = std::min(count, static_cast<std::size_t>(settings_.max_samples));
  // The ranks of an expert group exchange rows inside every pass, so they take the same samples in
  // lockstep (their generations stop together); one of them counts the results.
  const int experts = expert_ranks(parallel_);
  const auto ranks = static_cast<std::size_t>(parallel_.data().size() / experts);
  const auto me = static_cast<std::size_t>(parallel_.data().rank() / experts);
  const bool counts = parallel_.data().rank() % experts == 0;
  std::vector<std::string> mine;
  for (std::size_t i = me; i < count; i += ranks) mine.push_back(all[i]);
  double loss = 0;
  std::int64_t label_tokens = 0;
  const auto batch = static_cast<std::size_t>(std::max<std::int64_t>(1, settings_.batch_size));
  for (std::size_t i = 0; i < mine.size(); i += batch) {
    const Batch b = collator_.collate(slice(mine, i, batch), tokenizer_, settings_.collate);
    if (b.rows == 0) continue;
    const MicroBatch t = to_micro_batch(b);
    label_tokens += label_count(t);
    const at::Tensor out = runtime_.forward(t.ids, t.positions, t.mask);
    if (out.defined()) loss += executor.loss_sum(out, t.labels.to(executor.head_device())).item<double>();  // on the last stage
  }
  std::vector<std::string> prompts, references;
  const auto* form = dynamic_cast<const PromptForm*>(&collator_);
  const bool templated = form != nullptr && form->templated();
  std::string empty_prompt;  // the first of this rank's samples whose prompt encodes to nothing
  for (std::size_t i = 0; i < mine.size(); ++i)
    if (auto split = collator_.split_for_generation(mine[i])) {
      if (empty_prompt.empty() && tokenizer_.encode(split->prompt, templated ? Specials::kNone : Specials::kPrompt).ids.empty())
        empty_prompt = "held-out sample " + std::to_string(me + 1 + i * ranks) + " renders an empty prompt: nothing to generate from";
      prompts.push_back(split->prompt);
      references.push_back(split->reference);
    }
  // Refused on every rank together, before any rank starts generating (validation names the file's line).
  if (reduce_over(parallel_.data(), {empty_prompt.empty() ? 0.0 : 1.0}, comm_device_, ReduceOp::kMax)[0] > 0) {
    executor.model().set_training(true);
    throw UserError(!empty_prompt.empty() ? empty_prompt : "a held-out sample of another data rank renders an empty prompt: nothing to generate from");
  }
  std::int64_t exact = 0;
  GenerationSettings g;
  g.max_new_tokens = settings_.max_new_tokens;
  // Chat data: prompts the template rendered, answers cut at the end of the assistant's turn. The
  // answer may take max_new_tokens and the end of turn its own tokens beyond them, so an answer of
  // full length is still seen to end.
  if (templated) {
    g.templated = true;
    for (const auto& s : mine)
      if (std::string end = form->end_of_turn(s); !end.empty()) {
        g.max_new_tokens += static_cast<std::int64_t>(tokenizer_.encode(end, Specials::kNone).ids.size());
        g.stop_texts.push_back(std::move(end));
        break;
      }
  }
  share_generation(g, runtime_, parallel_, comm_device_, settings_.generation_rows);
  const auto answers = generate(next_logits_of(runtime_), tokenizer_, prompts, g);
  for (std::size_t k = 0; k < answers.size(); ++k) exact += trim(answers[k]) == trim(references[k]) ? 1 : 0;
  loss = sum_over(parallel_.pipeline(), {loss}, comm_device_)[0];  // the last stage's
  const double counted = counts ? 1.0 : 0.0;
  const auto sums = sum_over(parallel_.data(),
                             {counted * loss, counted * static_cast<double>(label_tokens), counted * static_cast<double>(exact),
                              counted * static_cast<double>(prompts.size())},
                             comm_device_);
  executor.model().set_training(true);
  EvalResult r;
  r.loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
  r.samples = static_cast<std::int64_t>(count);
  r.exact = static_cast<std::int64_t>(sums[2]);
  r.prompts = static_cast<std::int64_t>(sums[3]);
  return r;
}

}  // namespace loom::core
