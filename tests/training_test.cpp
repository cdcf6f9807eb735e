// End-to-end training through the CLI: learning, PEFT output, and resume after SIGKILL.
#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <functional>
#include <map>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include "generation/generate.hpp"
#include "loom/error.hpp"
#include "loom/kit/loss.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/tokenizer.hpp"
#include "test_support.hpp"
#include "runtime/trainer.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;

// The sliced loss gives what cross-entropy over the whole fp32 logits gives, value and gradient,
// with ignored positions, bf16 logits, and every way the rows are sliced (slices of 2^14 values
// here, sliced as the 2^24 of a real vocabulary are).
TEST(Loss, SlicedNextTokenLossMatchesCrossEntropy) {
  at::manual_seed(11);
  constexpr std::int64_t kSlice = 1 << 14;
  // One slice for the whole batch, in both dtypes; then, in bf16 (the large-vocabulary case in
  // practice), several batch rows per slice (81 rows of 200: 10 rows of 8 positions, then 2) and
  // several slices per row (54 rows of 300: 129 positions in 3 slices).
  using Case = std::tuple<at::ScalarType, std::int64_t, std::int64_t, std::int64_t, std::int64_t>;
  for (const auto& [dtype, vocab, batch, length, slice] : std::vector<Case>{{at::kFloat, 50, 2, 9, kit::kLossSliceValues},
                                                                            {at::kBFloat16, 50, 2, 9, kit::kLossSliceValues},
                                                                            {at::kBFloat16, 200, 12, 9, kSlice},
                                                                            {at::kBFloat16, 300, 1, 130, kSlice}}) {
    SCOPED_TRACE(std::string(c10::toString(dtype)) + " vocab " + std::to_string(vocab) + " batch " + std::to_string(batch));
    const at::Tensor base = (at::randn({batch, length, vocab}) * 3).to(dtype);
    at::Tensor labels = at::randint(0, vocab, {batch, length}, at::kLong);
    labels.index_put_({0, 0}, -100);
    labels.narrow(1, 2, 3).fill_(-100);
    const at::Tensor a = base.clone().requires_grad_(true), b = base.clone().requires_grad_(true);
    const at::Tensor shifted = a.narrow(1, 0, length - 1).to(at::kFloat);
    const at::Tensor want = at::cross_entropy_loss(shifted.reshape({-1, vocab}), labels.narrow(1, 1, length - 1).reshape({-1}), {},
                                                   at::Reduction::Sum, -100);
    const at::Tensor got = kit::next_token_loss_sum(b, labels, slice);
    EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-4 * std::abs(want.item<double>()));
    const at::Tensor g = at::tensor(0.37);
    const auto ga = torch::autograd::grad({want}, {a}, {g})[0], gb = torch::autograd::grad({got}, {b}, {g})[0];
    EXPECT_EQ(gb.scalar_type(), dtype);
    // Against the exact gradient (fp64 from the same logits), the sliced one is as close as
    // cross-entropy's own; in bf16 both round to the same grid.
    const at::Tensor c = base.to(at::kDouble).requires_grad_(true);
    const at::Tensor exact_loss = at::cross_entropy_loss(c.narrow(1, 0, length - 1).reshape({-1, vocab}),
                                                         labels.narrow(1, 1, length - 1).reshape({-1}), {}, at::Reduction::Sum, -100);
    const auto exact = torch::autograd::grad({exact_loss}, {c}, {g.to(at::kDouble)})[0];
    const double err_ours = (gb.to(at::kDouble) - exact).abs().max().item<double>();
    const double err_theirs = (ga.to(at::kDouble) - exact).abs().max().item<double>();
    EXPECT_LE(err_ours, 2 * err_theirs + 1e-7) << "sliced " << err_ours << ", cross_entropy " << err_theirs;
    EXPECT_NEAR(got.item<double>(), exact_loss.item<double>(), 1e-5 * std::abs(exact_loss.item<double>()));
  }
}

// The loss from the head's input gives the head's logits' loss and the gradient of the head's
// input, with ignored positions, a batch row with no counted
// position, slices of a few rows and one slice; fp32 against the composite in fp64, bf16 within
// the composite's own rounding. A learning head weight takes the composite (its gradient too);
// without grad mode nothing is kept for backward.
TEST(Loss, FromHiddenGivesTheHeadsLossAndGradient) {
  at::manual_seed(5);
  const std::int64_t batch = 3, length = 11, width = 16, vocab = 40;
  for (const auto dtype : {at::kFloat, at::kBFloat16})
    for (const std::int64_t slice : {std::int64_t{3 * vocab}, kit::kLossSliceValues}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " slice " + std::to_string(slice));
      const at::Tensor base = at::randn({batch, length, width}).to(dtype), weight = (at::randn({vocab, width}) * 0.5).to(dtype);
      at::Tensor labels = at::randint(0, vocab, {batch, length}, at::kLong);
      labels.narrow(1, 0, 4).fill_(-100);  // a prompt
      labels[2].fill_(-100);               // a row with nothing to learn
      const at::Tensor a = base.clone().requires_grad_(true), exact_input = base.to(at::kDouble).requires_grad_(true);
      const at::Tensor got = kit::next_token_loss_sum_from_hidden(a, weight, labels, slice);
      const at::Tensor composite = kit::next_token_loss_sum(at::linear(base.clone().requires_grad_(true), weight), labels, slice);
      const at::Tensor exact = at::cross_entropy_loss(at::linear(exact_input, weight.to(at::kDouble)).narrow(1, 0, length - 1).reshape({-1, vocab}),
                                                      labels.narrow(1, 1, length - 1).reshape({-1}), {}, at::Reduction::Sum, -100);
      const double tolerance = dtype == at::kFloat ? 1e-5 : 1e-2;
      EXPECT_NEAR(got.item<double>(), exact.item<double>(), tolerance * std::abs(exact.item<double>()));
      EXPECT_NEAR(got.item<double>(), composite.item<double>(), tolerance * std::abs(exact.item<double>()));
      const at::Tensor scale = at::tensor(0.37);
      const at::Tensor grad = torch::autograd::grad({got}, {a}, {scale})[0];
      const at::Tensor want = torch::autograd::grad({exact}, {exact_input}, {scale.to(at::kDouble)})[0];
      EXPECT_EQ(grad.scalar_type(), dtype);
      EXPECT_LT(((grad.to(at::kDouble) - want).norm() / want.norm()).item<double>(), tolerance);
      EXPECT_EQ(grad[2].abs().max().item<double>(), 0.0) << "a row with no counted position has no gradient";
      EXPECT_EQ(grad.select(1, length - 1).abs().max().item<double>(), 0.0) << "the last position predicts nothing";
    }
  // A head weight that learns: the composite, gradient of the weight included.
  const at::Tensor hidden = at::randn({2, 5, 8}).requires_grad_(true), weight = at::randn({12, 8}).requires_grad_(true);
  const at::Tensor labels = at::randint(0, 12, {2, 5}, at::kLong);
  const at::Tensor loss = kit::next_token_loss_sum_from_hidden(hidden, weight, labels);
  const auto grads = torch::autograd::grad({loss}, {hidden, weight});
  const at::Tensor h2 = hidden.detach().clone().requires_grad_(true), w2 = weight.detach().clone().requires_grad_(true);
  const auto want = torch::autograd::grad({kit::next_token_loss_sum(at::linear(h2, w2), labels)}, {h2, w2});
  EXPECT_TRUE(at::allclose(grads[0], want[0], 1e-5, 1e-6) && at::allclose(grads[1], want[1], 1e-5, 1e-6));
  // Evaluation: no gradient kept, the same value.
  at::NoGradGuard no_grad;
  const at::Tensor frozen = weight.detach();
  EXPECT_NEAR(kit::next_token_loss_sum_from_hidden(hidden, frozen, labels).item<double>(),
              kit::next_token_loss_sum(at::linear(hidden, frozen), labels).item<double>(), 1e-4);
}

// A family's scaled and soft-capped logits (Granite's and Cohere's multipliers, Gemma 2's
// final_logit_softcapping) from the head's input: the loss and the input's gradient equal the
// composite's, cap tanh(m linear(hidden, W) / cap), written out in fp64, with the cap biting (the
// scaled logits reach several times it); in fp32 and bf16, in one slice and in slices of 3 rows.
TEST(Loss, FromHiddenTakesTheFamilysMultiplierAndSoftCap) {
  at::manual_seed(6);
  const std::int64_t batch = 2, length = 9, width = 16, vocab = 40;
  const kit::HeadLogits head{2.5, 3.0};
  for (const auto dtype : {at::kFloat, at::kBFloat16})
    for (const std::int64_t slice : {std::int64_t{3 * vocab}, kit::kHeadLossSliceValues}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " slice " + std::to_string(slice));
      const at::Tensor base = at::randn({batch, length, width}).to(dtype), weight = at::randn({vocab, width}).to(dtype);
      at::Tensor labels = at::randint(0, vocab, {batch, length}, at::kLong);
      labels.narrow(1, 0, 3).fill_(-100);
      const at::Tensor a = base.clone().requires_grad_(true), exact_input = base.to(at::kDouble).requires_grad_(true);
      const at::Tensor got = kit::next_token_loss_sum_from_hidden(a, weight, labels, head, slice);
      const at::Tensor scaled = at::linear(exact_input, weight.to(at::kDouble)) * head.multiplier;
      ASSERT_GT(scaled.abs().max().item<double>(), 3 * head.softcap) << "the cap should bite";
      const at::Tensor capped = at::tanh(scaled / head.softcap) * head.softcap;
      const at::Tensor exact = at::cross_entropy_loss(capped.narrow(1, 0, length - 1).reshape({-1, vocab}), labels.narrow(1, 1, length - 1).reshape({-1}),
                                                      {}, at::Reduction::Sum, -100);
      const double tolerance = dtype == at::kFloat ? 1e-5 : 2e-2;
      EXPECT_NEAR(got.item<double>(), exact.item<double>(), tolerance * std::abs(exact.item<double>()));
      const at::Tensor grad = torch::autograd::grad({got}, {a})[0];
      const at::Tensor want = torch::autograd::grad({exact}, {exact_input})[0];
      EXPECT_LT(((grad.to(at::kDouble) - want).norm() / want.norm()).item<double>(), tolerance);
    }
  // Without the cap and multiplier it is the plain loss, bit for bit.
  const at::Tensor hidden = at::randn({2, 5, 8}), weight = at::randn({12, 8});
  const at::Tensor labels = at::randint(0, 12, {2, 5}, at::kLong);
  EXPECT_TRUE(at::equal(kit::next_token_loss_sum_from_hidden(hidden, weight, labels, kit::HeadLogits{}),
                        kit::next_token_loss_sum_from_hidden(hidden, weight, labels)));
}

// Each position's log-probability from the head's input with a family's multiplier, soft-cap (biting)
// and a sampling temperature equals log_softmax(cap tanh(m logits / cap) / temperature) gathered,
// written out in fp64: values (0 at the first position and where the label is -100) and the
// gradient of a weighted sum, in fp32 and bf16, one slice or slices of 3 rows; without a graph the
// same values.
TEST(Loss, LogpsFromHiddenAreTheFamilysLogSoftmaxGathered) {
  at::manual_seed(11);
  const std::int64_t batch = 2, length = 9, width = 16, vocab = 40;
  for (const auto& [head, temperature] : {std::pair{kit::HeadLogits{}, 1.0}, std::pair{kit::HeadLogits{2.5, 3.0}, 0.7}})
    for (const auto dtype : {at::kFloat, at::kBFloat16})
      for (const std::int64_t slice : {std::int64_t{3 * vocab}, kit::kHeadLossSliceValues}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " slice " + std::to_string(slice) + " temperature " + std::to_string(temperature));
        const at::Tensor base = at::randn({batch, length, width}).to(dtype), weight = at::randn({vocab, width}).to(dtype);
        at::Tensor labels = at::randint(0, vocab, {batch, length}, at::kLong);
        labels.narrow(1, 0, 3).fill_(-100);
        const at::Tensor upstream = at::randn({batch, length});
        const at::Tensor a = base.clone().requires_grad_(true), exact_input = base.to(at::kDouble).requires_grad_(true);
        const at::Tensor got = kit::next_token_logps_from_hidden(a, weight, labels, head, temperature, slice);
        at::Tensor logits = at::linear(exact_input, weight.to(at::kDouble)) * head.multiplier;
        if (head.softcap > 0) logits = at::tanh(logits / head.softcap) * head.softcap;
        const at::Tensor logp = at::log_softmax(logits / temperature, -1).narrow(1, 0, length - 1);
        const at::Tensor targets = labels.narrow(1, 1, length - 1);
        const at::Tensor picked = logp.gather(2, targets.clamp_min(0).unsqueeze(2)).squeeze(2) * targets.ne(-100);
        const at::Tensor exact = at::cat({at::zeros({batch, 1}, picked.options()), picked}, 1);
        const double tolerance = dtype == at::kFloat ? 1e-5 : 3e-2;
        ASSERT_EQ(got.sizes(), exact.sizes());
        EXPECT_LT((got.to(at::kDouble) - exact).abs().max().item<double>(), tolerance * (1 + exact.abs().max().item<double>()));
        EXPECT_EQ(got.narrow(1, 0, 3).abs().max().item<double>(), 0.0);
        const at::Tensor grad = torch::autograd::grad({(got * upstream).sum()}, {a})[0];
        const at::Tensor want = torch::autograd::grad({(exact * upstream.to(at::kDouble)).sum()}, {exact_input})[0];
        EXPECT_LT(((grad.to(at::kDouble) - want).norm() / want.norm()).item<double>(), tolerance);
        at::NoGradGuard no_grad;
        EXPECT_TRUE(at::equal(kit::next_token_logps_from_hidden(base, weight, labels, head, temperature, slice), got.detach()));
      }
}

// On a GPU the loss from the head's input takes one kernel a slice (vocabularies of a multiple of
// 8): its loss and gradient equal the CPU composite's within bf16's rounding, with uncounted
// positions, several slices, a row with nothing counted, and without gradients; 259 (not a
// multiple of 8) keeps the composite.
LOOM_GPU_TEST(Loss, FromHiddenOnTheGpuGivesTheCompositesLossAndGradient) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(9);
  const std::int64_t batch = 3, length = 21, width = 64;
  for (const std::int64_t vocab : {std::int64_t{4104}, std::int64_t{259}}) {
    for (const std::int64_t slice : {std::int64_t{5 * vocab}, kit::kHeadLossSliceValues}) {
      SCOPED_TRACE("vocabulary " + std::to_string(vocab) + ", slice " + std::to_string(slice));
      const at::Tensor base = (at::randn({batch, length, width}) * 2).to(at::kBFloat16), weight = (at::randn({vocab, width}) * 0.5).to(at::kBFloat16);
      at::Tensor labels = at::randint(0, vocab, {batch, length}, at::kLong);
      labels.narrow(1, 0, 4).fill_(-100);
      labels[1].fill_(-100);
      const auto run = [&](at::Device device) {
        const at::Tensor h = base.to(device).requires_grad_(true);
        const at::Tensor loss = kit::next_token_loss_sum_from_hidden(h, weight.to(device), labels.to(device), slice);
        const at::Tensor grad = torch::autograd::grad({loss}, {h}, {at::tensor(0.37f).to(device)})[0];
        return std::pair<double, at::Tensor>{loss.item<double>(), grad.cpu().to(at::kDouble)};
      };
      const auto gpu = run(at::kCUDA), cpu = run(at::kCPU);
      EXPECT_NEAR(gpu.first, cpu.first, 1e-3 * std::abs(cpu.first));
      EXPECT_LT(((gpu.second - cpu.second).norm() / cpu.second.norm()).item<double>(), 1e-2);
      EXPECT_EQ(gpu.second[1].abs().max().item<double>(), 0.0) << "a row with nothing counted";
      at::NoGradGuard no_grad;
      EXPECT_NEAR(kit::next_token_loss_sum_from_hidden(base.cuda(), weight.cuda(), labels.cuda(), slice).item<double>(), cpu.first,
                  1e-3 * std::abs(cpu.first));
    }
  }
}

// The copy task with LoRA (dropout on) and an embedding trained beside it.
fs::path tiny_pipeline(const fs::path& dir, int steps, int checkpoint_every) {
  write_file(dir / "p.toml", "[run]\nseed = 7\n" + copy_task(dir) + R"([adapter]
plugin = "lora"
r = 8
alpha = 16
target_modules = "all-linear"
dropout = 0.1
modules_to_save = ["embed_tokens"]
[train]
batch_size = 8
lr = 2e-2
log_every = 1
eval_samples = 12
max_new_tokens = 6
threads = 1
max_steps = )" + std::to_string(steps) + "\ncheckpoint_every = " + std::to_string(checkpoint_every) + "\n");
  return dir / "p.toml";
}

std::vector<nlohmann::json> training_rows(const fs::path& metrics) { return metrics_rows(metrics, false); }

TEST(Training, RunLearnsWritesMetricsAndAPeftAdapter) {
  const fs::path dir = temp_dir();
  const auto r = run_loom({"run", tiny_pipeline(dir, 40, 0).string(), "--output", (dir / "out").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto rows = training_rows(dir / "out/metrics.jsonl");
  ASSERT_GE(rows.size(), 41u);
  EXPECT_LT(rows[39]["loss"].get<double>(), rows[0]["loss"].get<double>() * 0.7) << "loss did not fall";
  EXPECT_TRUE(rows.back()["eval"].get<bool>());
  ASSERT_TRUE(rows.back()["exact_match"].is_number()) << rows.back();
  // PEFT's keys and shapes, and every lora_B moved from PEFT's zero start.
  std::map<std::string, std::vector<std::int64_t>> saved;
  for (const auto& [name, t] : tensors_of(dir / "out/adapter")) {
    saved[name] = t.sizes().vec();
    if (name.find("lora_B") != std::string::npos) {
      EXPECT_GT(t.abs().max().item<double>(), 0.0) << name << " did not train";
    }
  }
  EXPECT_EQ(saved, copy_task_adapter_shapes(2, 8, true));
  const auto config = nlohmann::json::parse(read_file(dir / "out/adapter/adapter_config.json"));
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["r"], 8);
  EXPECT_NE(r.out.find("held-out exact-match: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(PEFT format)"), std::string::npos) << r.out;

  // Evaluated on samples it trained on, 100 steps in, the model answers them; the exact-match the
  // run reports is what `loom generate` with the saved adapter answers for the same prompts.
  std::string adapted;
  const Samples seen = expect_trained_samples_answered(dir / "p.toml", dir / "seen", {}, adapted);
  // The random base answers none of them: what the adapted run answered came from the adapter.
  std::vector<std::string> args = {"generate", (dir / "p.toml").string(), "--max-new-tokens", "6"};
  for (const auto& p : seen.prompts) args.insert(args.end(), {"--prompt", p});
  const auto base = run_loom(args);
  ASSERT_EQ(base.exit_code, 0) << base.err;
  EXPECT_NE(base.out, adapted);
  const auto base_exact = exact_answers(base.out, seen.prompts, seen.answers);
  EXPECT_EQ(std::count(base_exact.begin(), base_exact.end(), true), 0) << base.out;

  // Sampling is seeded by [run] seed: the same command gives the same text; a top-p so small
  // that only the likeliest token survives gives the greedy text.
  const auto sample = [&](const std::string& temperature, const std::string& top_p) {
    const auto r = run_loom({"generate", (dir / "p.toml").string(), "--prompt", "Q:abcd A:", "--adapter", (dir / "out/adapter").string(),
                             "--max-new-tokens", "4", "--temperature", temperature, "--top-p", top_p});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.out;
  };
  const auto greedy = run_loom({"generate", (dir / "p.toml").string(), "--prompt", "Q:abcd A:", "--adapter", (dir / "out/adapter").string(),
                                "--max-new-tokens", "4"});
  ASSERT_EQ(greedy.exit_code, 0) << greedy.err;
  EXPECT_EQ(sample("1.5", "1.0"), sample("1.5", "1.0"));
  EXPECT_EQ(sample("1.5", "0.000001"), greedy.out);
  // --adapter may name the run folder (its adapter/); --json gives each prompt and its answer.
  const auto as_json = run_loom({"generate", (dir / "p.toml").string(), "--prompt", "Q:abcd A:", "--prompt", "Q:efgh A:", "--adapter",
                                 (dir / "out").string(), "--max-new-tokens", "4", "--json"});
  ASSERT_EQ(as_json.exit_code, 0) << as_json.err;
  const auto answers = nlohmann::json::parse(as_json.out);
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_EQ(answers[0]["prompt"], "Q:abcd A:");
  EXPECT_EQ("Q:abcd A:" + answers[0]["answer"].get<std::string>() + "\n", greedy.out);
  const auto bad = run_loom({"generate", (dir / "p.toml").string(), "--prompt", "x", "--top-p", "0"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--top-p must be in (0, 1]"), std::string::npos) << bad.err;
}

// An embedding with rows past the tokenizer's vocabulary (padding) never has them chosen, greedy or
// sampled: generation continues with the likeliest token the tokenizer can decode.
TEST(Generation, RowsPastTheTokenizersVocabularyAreNeverChosen) {
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes");
  const std::int64_t vocab = tokenizer->vocab_size();
  // The model's likeliest id is one past the tokenizer's; its best decodable one is 'A'.
  const core::NextLogits padded = [&](const at::Tensor& ids, const at::Tensor&, const at::Tensor&, CachedPass&) {
    at::Tensor logits = at::zeros({ids.size(0), vocab + 61});
    logits.select(1, vocab + 20).fill_(50);
    logits.select(1, 'A').fill_(40);
    return logits;
  };
  for (const double temperature : {0.0, 1.0}) {
    core::GenerationSettings g;
    g.max_new_tokens = 5;
    g.temperature = temperature;
    EXPECT_EQ(core::generate(padded, *tokenizer, {"x", "yz"}, g), (std::vector<std::string>{"AAAAA", "AAAAA"})) << temperature;
  }
}

// A chat answer stops at the template's end-of-turn text, cut before it, row by row: a model that
// spells "47<e>" then rambles answers "47"; one that never writes it runs to max_new_tokens.
TEST(Generation, StopsAtAStopTextAndCutsIt) {
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes");
  const std::string script = "47<e>xyz";
  std::int64_t alone = 0;  // decode steps that fed one row: row 1 once row 0 has stopped
  const core::NextLogits spell = [&](const at::Tensor& ids, const at::Tensor&, const at::Tensor&, CachedPass& pass) {
    if (!pass.fresh && ids.size(0) == 1) ++alone;
    at::Tensor logits = at::zeros({ids.size(0), tokenizer->vocab_size()});
    for (std::int64_t b = 0; b < ids.size(0); ++b) {
      // the n-th new token of a row is script[n] for cache row 0, 'q' for row 1 (once row 0 has
      // stopped, row 1 steps alone: pass.rows names it); both prompts are left-padded to 3
      // columns, so the token fed at column c draws the (c - 2)-th
      const std::int64_t row = pass.rows.defined() ? pass.rows[b].item<std::int64_t>() : b;
      const std::int64_t n = pass.fresh ? 0 : pass.columns[b][0].item<std::int64_t>() - 2;
      const char next = row == 0 ? script[static_cast<std::size_t>(std::min<std::int64_t>(n, 7))] : 'q';
      logits[b][static_cast<unsigned char>(next)] = 10;
    }
    return logits;
  };
  core::GenerationSettings g;
  g.max_new_tokens = 8;
  g.templated = true;
  g.stop_texts = {"<e>"};
  for (const std::int64_t every : {1, 3, 8}) {
    g.check_every = every;
    alone = 0;
    EXPECT_EQ(core::generate(spell, *tokenizer, {"ab", "abc"}, g), (std::vector<std::string>{"47", "qqqqqqqq"})) << "looking every " << every;
    // On the CPU a step feeds only the rows holding a prompt when at most half do.
    if (every == 1) EXPECT_GT(alone, 0);
  }
}

// More prompts than rows: a row that ends takes the next prompt (its cache row written afresh),
// and every prompt gets the answer it gets alone. The model answers each prompt with its own
// last byte, then '.' after as many tokens as that byte's value mod 5 (rows end at different
// steps), read from the cache the way a real model would: through the ids it was fed.
TEST(Generation, RowsThatEndTakeTheNextPrompt) {
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes");
  const std::int64_t eos = tokenizer->special_tokens().eos.value();
  std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> fed;  // cache row -> (its prompt's last id, tokens since)
  const core::NextLogits echo = [&](const at::Tensor& ids, const at::Tensor&, const at::Tensor&, CachedPass& pass) {
    at::Tensor logits = at::zeros({ids.size(0), tokenizer->vocab_size()});
    for (std::int64_t b = 0; b < ids.size(0); ++b) {
      const std::int64_t row = pass.rows.defined() ? pass.rows[b].item<std::int64_t>() : b;
      auto& [last, since] = fed[row];
      if (pass.fresh) last = ids[b][ids.size(1) - 1].item<std::int64_t>(), since = 0;
      else ++since;
      logits[b][since < last % 5 ? last : since == last % 5 ? '.' : eos] = 10;
    }
    return logits;
  };
  std::vector<std::string> prompts;
  for (const char* p : {"a", "bb", "c", "dddd", "e", "f", "ggg", "h", "i", "j"}) prompts.push_back(p);
  core::GenerationSettings g;
  g.max_new_tokens = 6;
  std::vector<std::string> alone;
  for (const auto& p : prompts) alone.push_back(core::generate(echo, *tokenizer, {p}, g)[0]);
  EXPECT_EQ(alone[0], "aa.");  // 'a' is 97, and 97 % 5 = 2
  {  // Past the end-of-sequence token when told: a prompt pass and max_new_tokens - 1 steps.
    int passes = 0;
    const core::NextLogits counted = [&](const at::Tensor& ids, const at::Tensor& a, const at::Tensor& b, CachedPass& pass) {
      ++passes;
      return echo(ids, a, b, pass);
    };
    core::GenerationSettings on = g;
    on.ignore_eos = true;
    EXPECT_EQ(core::generate(counted, *tokenizer, {"a"}, on).at(0).rfind("aa.", 0), 0u);
    EXPECT_EQ(passes, 6);
    passes = 0;
    EXPECT_EQ(core::generate(counted, *tokenizer, {"a"}, g).at(0), "aa.");
    EXPECT_EQ(passes, 4);  // 'a', 'a', '.', then the end
  }
  for (const std::int64_t rows : {1, 3, 64}) {
    g.max_rows = rows;
    EXPECT_EQ(core::generate(echo, *tokenizer, prompts, g), alone) << rows << " rows";
  }
  // A caller whose devices hold fewer rows' cache (evaluation's check) gets the same answers.
  std::int64_t asked = 0;
  g.before_cache = [&](std::int64_t rows, std::int64_t) {
    asked = rows;
    return std::int64_t{2};
  };
  fed.clear();
  EXPECT_EQ(core::generate(echo, *tokenizer, prompts, g), alone);
  EXPECT_EQ(asked, 10);
  EXPECT_LE(fed.size(), 2u);  // two cache rows served every prompt
}

// The sampler draws from the temperature-scaled softmax cut to its top-p nucleus: over 40,000 draws
// each token's share is its probability (within 0.01), a token outside the nucleus is never drawn,
// greedy takes the first largest logit, and a row draws the same tokens whatever rows sit beside
// it and however many threads LibTorch has (the split runs of issue 29 had fewer).
TEST(Generation, SamplesTheNucleusDistributionRowByRow) {
  const at::Tensor row = at::tensor({2.0f, 1.0f, 0.5f, -1.0f, 2.0f});
  core::GenerationSettings g;
  g.temperature = 0.7;
  g.top_p = 0.9;
  g.seed = 11;
  const at::Tensor probs = at::softmax(row.to(at::kDouble) / g.temperature, 0);
  // The nucleus: ids 0 and 4 (tied, the most probable) then 1 reach 0.9; 2 and 3 lie outside.
  const double nucleus = (probs[0] + probs[4] + probs[1]).item<double>();
  ASSERT_LT((probs[0] + probs[4]).item<double>(), g.top_p);
  ASSERT_GE(nucleus, g.top_p);
  // Draw i of stream 0: all 40,000 at once, as rows of one batch.
  const int draws = 40000;
  const at::Tensor many = core::choose_next(row.expand({draws, 5}), g, at::zeros({draws}, at::kLong), at::arange(draws, at::kLong));
  const at::Tensor counts = at::bincount(many, {}, 5).to(at::kDouble) / draws;
  EXPECT_EQ(counts[2].item<double>() + counts[3].item<double>(), 0) << "drew outside the nucleus";
  for (const int id : {0, 1, 4}) EXPECT_NEAR(counts[id].item<double>(), probs[id].item<double>() / nucleus, 0.01) << "id " << id;
  // Top-k: only the two likeliest (the tied 0 and 4), in their share.
  core::GenerationSettings top_two = g;
  top_two.top_p = 1.0;
  top_two.top_k = 2;
  const at::Tensor two = at::bincount(core::choose_next(row.expand({draws, 5}), top_two, at::zeros({draws}, at::kLong), at::arange(draws, at::kLong)), {}, 5);
  EXPECT_EQ(two[1].item<std::int64_t>() + two[2].item<std::int64_t>() + two[3].item<std::int64_t>(), 0);
  EXPECT_NEAR(two[0].item<double>() / draws, 0.5, 0.01);

  core::GenerationSettings greedy;
  EXPECT_EQ(core::choose_next(row.view({1, 5}), greedy, at::zeros({1}, at::kLong), at::zeros({1}, at::kLong))[0].item<std::int64_t>(), 0);

  // Values at the edges of float: a top_p that is 0 in float still keeps the likeliest token (it
  // cut every token, and the answer was NUL bytes); a temperature past float's range still lets
  // top-k = 1 keep the likeliest (it flattened every score to 0 and drew at random).
  const at::Tensor peaked = at::tensor({0.5f, 3.0f, 1.0f, -2.0f, 2.5f});
  core::GenerationSettings tiny_p = g;
  tiny_p.top_p = 1e-300;
  core::GenerationSettings flat_top = g;
  flat_top.temperature = 1e39;
  flat_top.top_p = 1.0;
  flat_top.top_k = 1;
  for (const auto& edge : {tiny_p, flat_top}) {
    const at::Tensor drawn = core::choose_next(peaked.expand({200, 5}), edge, at::zeros({200}, at::kLong), at::arange(200, at::kLong));
    EXPECT_TRUE(drawn.eq(1).all().item<bool>()) << drawn;
  }

  // Stream 1 draws what it draws beside another stream, at 1 or 2 threads, and alone; another
  // seed draws otherwise.
  const at::Tensor batch = at::stack({row, row.flip(0)});
  const int threads = at::get_num_threads();
  std::vector<std::vector<std::int64_t>> seen;
  for (const int t : {1, 2}) {
    at::set_num_threads(t);
    std::vector<std::int64_t> tokens;
    for (int i = 0; i < 50; ++i)
      tokens.push_back(core::choose_next(batch, g, at::tensor({std::int64_t{0}, std::int64_t{1}}), at::full({2}, i, at::kLong))[1].item<std::int64_t>());
    seen.push_back(tokens);
  }
  at::set_num_threads(threads);
  EXPECT_EQ(seen[0], seen[1]);
  std::vector<std::int64_t> solo, reseeded;
  core::GenerationSettings other = g;
  other.seed = 12;
  for (int i = 0; i < 50; ++i) {
    solo.push_back(core::choose_next(row.flip(0).view({1, 5}), g, at::ones({1}, at::kLong), at::full({1}, i, at::kLong))[0].item<std::int64_t>());
    reseeded.push_back(core::choose_next(row.flip(0).view({1, 5}), other, at::ones({1}, at::kLong), at::full({1}, i, at::kLong))[0].item<std::int64_t>());
  }
  EXPECT_EQ(solo, seen[0]);
  EXPECT_NE(reseeded, solo);

  // Logits that are not finite stop generation with one clear error.
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes");
  const core::NextLogits broken = [&](const at::Tensor& ids, const at::Tensor&, const at::Tensor&, CachedPass&) {
    return at::full({ids.size(0), tokenizer->vocab_size()}, std::nanf(""));
  };
  try {
    core::generate(broken, *tokenizer, {"x"}, g);
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("logits are not finite"), std::string::npos) << e.what();
  }
}

// A run killed with SIGKILL after a checkpoint and resumed logs exactly the losses of a run that
// was never interrupted (dropout on, so the RNG state must come back too).
TEST(Training, ResumeAfterSigkillReproducesUninterruptedLosses) {
  const fs::path dir = temp_dir();
  const fs::path pipeline = tiny_pipeline(dir, 60, 10);
  const auto whole = run_loom({"run", pipeline.string(), "--output", (dir / "whole").string()});
  ASSERT_EQ(whole.exit_code, 0) << whole.err;

  const int pid = start_loom({"run", pipeline.string(), "--output", (dir / "killed").string()}, dir / "k.out", dir / "k.err");
  wait_until([&] { return fs::exists(dir / "killed/checkpoints/latest"); }, std::chrono::seconds(120), std::chrono::milliseconds(2));
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_child(pid), 128 + SIGKILL) << "the run finished before it could be killed; make it longer";
  ASSERT_LT(training_rows(dir / "killed/metrics.jsonl").size(), 60u);

  const auto resumed = run_loom({"run", pipeline.string(), "--output", (dir / "killed").string(), "--resume"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.err;
  EXPECT_EQ(training_rows(dir / "killed/metrics.jsonl"), training_rows(dir / "whole/metrics.jsonl"));
  EXPECT_EQ(read_file(dir / "killed/adapter/adapter_model.safetensors"), read_file(dir / "whole/adapter/adapter_model.safetensors"));
}

// SIGTERM (Slurm's preemption; Ctrl-C sends SIGINT, handled alike) stops the run at the next step
// with a checkpoint, says how to resume, and the resumed run logs exactly the losses of a run that
// was never interrupted.
TEST(Training, SigtermCheckpointsAndResumesLikeAnUninterruptedRun) {
  const fs::path dir = temp_dir();
  const fs::path pipeline = tiny_pipeline(dir, 60, 0);  // no periodic checkpoints: the signal makes the only one
  // An override the resume must repeat (the printed command carries it).
  const std::vector<std::string> set = {"--set", "train.lr=0.03"};
  auto args = std::vector<std::string>{"run", pipeline.string(), "--output", (dir / "whole").string()};
  args.insert(args.end(), set.begin(), set.end());
  const auto whole = run_loom(args);
  ASSERT_EQ(whole.exit_code, 0) << whole.err;

  args = {"run", pipeline.string(), "--output", (dir / "stopped").string()};
  args.insert(args.end(), set.begin(), set.end());
  const int pid = start_loom(args, dir / "s.out", dir / "s.err");
  wait_until([&] { return fs::exists(dir / "stopped/metrics.jsonl") && training_rows(dir / "stopped/metrics.jsonl").size() >= 3; },
             std::chrono::seconds(120), std::chrono::milliseconds(2));
  kill(pid, SIGTERM);
  ASSERT_EQ(wait_child(pid), 128 + SIGTERM) << read_file(dir / "s.err");
  const std::string out = read_file(dir / "s.out");
  EXPECT_NE(out.find("stopped by SIGTERM after step "), std::string::npos) << out;
  const std::string command = "loom run " + pipeline.string() + " --set train.lr=0.03 --output " + (dir / "stopped").string() + " --resume\n";
  ASSERT_NE(out.find("continue with:\n  " + command), std::string::npos) << out;
  const auto rows = training_rows(dir / "stopped/metrics.jsonl");
  ASSERT_LT(rows.size(), 60u) << "the run finished before the signal; make it longer";
  const std::string latest = read_file(dir / "stopped/checkpoints/latest");
  EXPECT_EQ(std::stoll(latest.substr(5)), rows.back()["step"].get<std::int64_t>()) << latest;

  // The printed command, word for word (the temp paths need no quoting).
  std::istringstream words(command);
  std::vector<std::string> resume_args;
  for (std::string w; words >> w;) resume_args.push_back(w);
  const auto resumed = run_loom(std::vector<std::string>(resume_args.begin() + 1, resume_args.end()));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(training_rows(dir / "stopped/metrics.jsonl"), training_rows(dir / "whole/metrics.jsonl"));
  EXPECT_EQ(read_file(dir / "stopped/adapter/adapter_model.safetensors"), read_file(dir / "whole/adapter/adapter_model.safetensors"));
}

// [train] keep_checkpoints keeps the newest checkpoints and the best by best_metric (named in
// checkpoints/best), whose weights become the outputs (and `loom eval` of them gives the run's
// final evaluation); early stopping ends the run after `patience` evaluations without improving by
// the threshold; --resume may raise max_steps, and a checkpoint past a lowered max_steps is one
// clear error (issue 55).
TEST(Training, KeepsNewestAndBestCheckpointsStopsEarlyAndExtendsOnResume) {
  const fs::path dir = temp_dir();
  const fs::path pipeline = tiny_pipeline(dir, 30, 5);
  const auto best_of = [&](const fs::path& out) {
    std::string best;
    double lowest = 1e300;
    // With best_metric every evaluation is at a checkpoint (the last step's too); the first lowest wins.
    for (const auto& row : metrics_rows(out / "metrics.jsonl", false))
      if (row.contains("eval") && !row.contains("weights_of") && row["eval_loss"].get<double>() < lowest) {
        lowest = row["eval_loss"].get<double>();
        char name[32];
        std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(row["step"].get<std::int64_t>()));
        best = name;
      }
    return best;
  };
  const auto names = [](const fs::path& checkpoints) {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(checkpoints))
      if (e.is_directory()) out.insert(e.path().filename().string());
    return out;
  };
  const std::vector<std::string> keep = {"--set", "train.eval_every=5", "--set", "train.keep_checkpoints=2", "--set", "train.best_metric=eval_loss"};
  auto args = std::vector<std::string>{"run", pipeline.string(), "--output", (dir / "kept").string()};
  args.insert(args.end(), keep.begin(), keep.end());
  const auto kept = run_loom(args);
  ASSERT_EQ(kept.exit_code, 0) << kept.err;
  const std::string best = best_of(dir / "kept");
  EXPECT_EQ(read_file(dir / "kept/checkpoints/best"), best + "\n");
  std::set<std::string> expected = {"step-00000025", "step-00000030", best};
  EXPECT_EQ(names(dir / "kept/checkpoints"), expected);
  EXPECT_EQ(read_file(dir / "kept/adapter/adapter_model.safetensors"), read_file(dir / "kept/checkpoints" / best / "adapter/adapter_model.safetensors"));
  // `loom eval` of the run's outputs on its held-out data gives the run's final evaluation.
  const auto evaluated = run_loom({"eval", pipeline.string(), "--adapter", (dir / "kept").string(), "--json"});
  ASSERT_EQ(evaluated.exit_code, 0) << evaluated.err;
  const auto measured = nlohmann::json::parse(evaluated.out);
  const auto final_row = metrics_rows(dir / "kept/metrics.jsonl", false).back();
  EXPECT_EQ(measured["samples"], 12);
  EXPECT_NEAR(measured["loss"].get<double>(), final_row["eval_loss"].get<double>(), 1e-4);
  EXPECT_NEAR(measured["perplexity"].get<double>(), std::exp(final_row["eval_loss"].get<double>()), 1e-2);
  EXPECT_EQ(measured["exact_match"], final_row["exact_match"]);

  // Early stopping: no evaluation improves by 100, so the third evaluation (step 15) stops the run;
  // the outputs are the best checkpoint's.
  args = {"run", pipeline.string(), "--output", (dir / "early").string(), "--set", "train.early_stopping_patience=2", "--set",
          "train.early_stopping_threshold=100"};
  args.insert(args.end(), keep.begin(), keep.end());
  const auto early = run_loom(args);
  ASSERT_EQ(early.exit_code, 0) << early.err;
  EXPECT_NE(early.out.find("done: 15 steps"), std::string::npos) << early.out;
  EXPECT_NE(early.out.find("stopped early: eval_loss did not improve by more than 100.0000 in 2 evaluations in a row"), std::string::npos) << early.out;
  EXPECT_EQ(training_rows(dir / "early/metrics.jsonl").back()["step"], 15);
  const std::string early_best = best_of(dir / "early");
  EXPECT_EQ(read_file(dir / "early/adapter/adapter_model.safetensors"),
            read_file(dir / "early/checkpoints" / early_best / "adapter/adapter_model.safetensors"));
  if (early_best != "step-00000015") {
    EXPECT_NE(early.out.find("best:      " + (dir / "early/checkpoints" / early_best).string()), std::string::npos);
  }
  // Resumed, a run that early stopping ended ends again at once (its checkpoint holds the count).
  args.push_back("--resume");
  const auto again = run_loom(args);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find("done: 15 steps"), std::string::npos) << again.out;

  // A run of 20 steps goes on to 30 with a raised max_steps; lowered below its checkpoint it cannot.
  ASSERT_EQ(run_loom({"run", pipeline.string(), "--output", (dir / "longer").string(), "--set", "train.max_steps=20"}).exit_code, 0);
  const auto shorter = run_loom({"run", pipeline.string(), "--output", (dir / "longer").string(), "--set", "train.max_steps=10", "--resume"});
  EXPECT_EQ(shorter.exit_code, 2);
  EXPECT_NE(shorter.err.find("step-00000020 is at step 20, past this run's 10 steps ([train] max_steps or epochs): raise them"), std::string::npos)
      << shorter.err;
  const auto longer = run_loom({"run", pipeline.string(), "--output", (dir / "longer").string(), "--resume"});
  ASSERT_EQ(longer.exit_code, 0) << longer.err;
  EXPECT_NE(longer.err.find("resumed from"), std::string::npos) << longer.err;
  EXPECT_EQ(training_rows(dir / "longer/metrics.jsonl").back()["step"], 30);
}

// A disk that fills while a checkpoint is written (a file size limit stands in for it): one clear
// error, nothing half-written, and --resume (with room again) finishes the run as if nothing happened.
TEST(Training, FullDiskDuringACheckpointIsOneClearErrorAndResumable) {
  const fs::path dir = temp_dir();
  const fs::path pipeline = tiny_pipeline(dir, 30, 10);
  const auto whole = run_loom({"run", pipeline.string(), "--output", (dir / "whole").string()});
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  // Room for run.json, metrics and logs, not for the optimizer state of a checkpoint.
  const auto optimizer_state = fs::file_size(dir / "whole/checkpoints/step-00000010/optimizer-pipeline0-tensor0.safetensors");
  const auto full = run_loom_with_file_limit({"run", pipeline.string(), "--output", (dir / "full").string()}, optimizer_state / 2);
  EXPECT_EQ(full.exit_code, 2) << full.err;
  EXPECT_NE(full.err.find("loom: error: cannot write the checkpoint at step 10 ("), std::string::npos) << full.err;
  EXPECT_NE(full.err.find("File too large"), std::string::npos) << full.err;
  EXPECT_NE(full.err.find("there is no earlier checkpoint: free space and continue with --resume"), std::string::npos) << full.err;
  EXPECT_FALSE(fs::exists(dir / "full/checkpoints/latest"));
  EXPECT_TRUE(fs::is_empty(dir / "full/checkpoints")) << "a half-written checkpoint was left";
  const auto resumed = run_loom({"run", pipeline.string(), "--output", (dir / "full").string(), "--resume"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(training_rows(dir / "full/metrics.jsonl"), training_rows(dir / "whole/metrics.jsonl"));
}

// Damaged run state is a user error with the file named, never an internal error.
TEST(Training, DamagedRunStateIsAClearError) {
  const fs::path dir = temp_dir();
  const fs::path pipeline = tiny_pipeline(dir, 10, 5);
  ASSERT_EQ(run_loom({"run", pipeline.string(), "--output", (dir / "o").string()}).exit_code, 0);
  write_file(dir / "o/checkpoints/step-00000010/trainer.json", "{\"step\": 10}");
  auto r = run_loom({"run", pipeline.string(), "--output", (dir / "o").string(), "--resume"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("trainer.json: optimizer_steps is missing (an integer from 0 to 10 expected)"), std::string::npos) << r.err;
  write_file(dir / "o/checkpoints/step-00000010/trainer.json", "not json");
  r = run_loom({"run", pipeline.string(), "--output", (dir / "o").string(), "--resume"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("trainer.json:1:2: not valid JSON: at \"ot json\""), std::string::npos) << r.err;
  // Optimizer state of another shape, or one that would broadcast into the parameter's, or not
  // floating point: refused, naming the tensor.
  write_file(dir / "o/checkpoints/latest", "step-00000005\n");
  const fs::path state = dir / "o/checkpoints/step-00000005/optimizer-pipeline0-tensor0.safetensors";
  std::vector<std::pair<std::string, at::Tensor>> original;
  {
    const kit::SafetensorsFile f(state);
    for (const auto& info : f.tensors()) original.emplace_back(info.name, f.tensor(info.name).clone());
  }
  for (const auto& [what, damage] : std::vector<std::pair<std::string, std::function<at::Tensor(const at::Tensor&)>>>{
           {"another shape", [](const at::Tensor&) { return at::zeros({3, 5}); }},
           {"broadcastable", [](const at::Tensor& t) { return at::zeros({t.size(-1)}); }},
           {"integer", [](const at::Tensor& t) { return at::zeros(t.sizes(), at::kLong); }}}) {
    SCOPED_TRACE(what);
    std::vector<std::pair<std::string, at::Tensor>> damaged;
    std::string victim;
    for (const auto& [name, t] : original) {
      const bool hit = victim.empty() && name.rfind("adam_v/", 0) == 0 && t.dim() == 2;
      if (hit) victim = name;
      damaged.emplace_back(name, hit ? damage(t) : t);
    }
    kit::write_safetensors(state, damaged);
    r = run_loom({"run", pipeline.string(), "--output", (dir / "o").string(), "--resume"});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("optimizer-pipeline0-tensor0.safetensors: " + victim + " is "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("the checkpoint is damaged or from another model"), std::string::npos) << r.err;
  }
  write_file(dir / "o/run.json", "[1]");
  r = run_loom({"run", pipeline.string(), "--output", (dir / "o").string(), "--resume"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("run.json: not a run manifest (expected a JSON object)"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace loom::test
