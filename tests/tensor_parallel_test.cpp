// Tensor parallelism: the model split over 2 and 4 ranks (Gloo on the CPU) computes what one
// process computes: transformers' logits for the parity fixture with and without its PEFT adapter,
// gradients, generation, an adapter trained split that one device reloads, and generation over
// launched processes. (Training against one process: mesh_matrix_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "distributed/distributed.hpp"
#include "runtime/executor.hpp"
#include "generation/generate.hpp"
#include "runtime/rank_runtime.hpp"
#include "loom/adapter.hpp"
#include "loom/error.hpp"
#include "loom/kit/loss.hpp"
#include "loom/kit/memory.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/kit/tensor_parallel.hpp"
#include "loom/placement.hpp"
#include "loom/tokenizer.hpp"
#include "plugins/plugin_guard.hpp"
#include "runtime/replica_check.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;
using core::Executor;

// The loss and each position's log-probability from the head's input over a vocabulary split by
// rows over 2 and 3 ranks equal one rank's (uneven parts; a family's multiplier and biting cap, a
// temperature, slices of 3 rows): the values on every rank, and the head input's gradient once
// summed over the group; no rank makes its part's logits whole.
TEST(TensorParallel, LossAndLogProbabilitiesFromTheHeadsInputOverASplitVocabulary) {
  at::manual_seed(3);
  const std::int64_t batch = 2, length = 7, width = 8, vocab = 31, slice = 3 * vocab;
  const at::Tensor hidden = at::randn({batch, length, width}) * 2, weight = at::randn({vocab, width});
  at::Tensor labels = at::randint(0, vocab, {batch, length}, at::kLong);
  labels.narrow(1, 0, 2).fill_(-100);
  const at::Tensor upstream = at::randn({batch, length});
  const kit::HeadLogits head{1.5, 4.0};
  const double temperature = 0.8;
  const auto one = [&](bool logps) {
    const at::Tensor h = hidden.clone().requires_grad_(true);
    const at::Tensor value = logps ? kit::next_token_logps_from_hidden(h, weight, labels, head, temperature, slice)
                                   : kit::next_token_loss_sum_from_hidden(h, weight, labels, head, slice);
    const at::Tensor grad = torch::autograd::grad({logps ? (value * upstream).sum() : value}, {h})[0];
    return std::pair<at::Tensor, at::Tensor>{value.detach(), grad};
  };
  const auto whole_loss = one(false), whole_logps = one(true);
  for (const int tensor : {2, 3}) {
    SCOPED_TRACE("tensor " + std::to_string(tensor));
    Mesh mesh;
    mesh.tensor = tensor;
    on_ranks(mesh, [&](Parallel& parallel) {
      Communicator& group = parallel.tensor();
      const kit::ShardRange rows = kit::shard_range(vocab, group.rank(), group.size());
      const at::Tensor part = weight.narrow(0, rows.start, rows.length);
      for (const bool logps : {false, true}) {
        const at::Tensor h = hidden.clone().requires_grad_(true);
        const at::Tensor value = logps ? kit::vocab_parallel_logps_from_hidden(h, part, rows.start, vocab, labels, head, temperature, group, slice)
                                       : kit::vocab_parallel_loss_sum_from_hidden(h, part, rows.start, vocab, labels, head, group, slice);
        const at::Tensor grad = torch::autograd::grad({logps ? (value * upstream).sum() : value}, {h})[0];
        const auto& want = logps ? whole_logps : whole_loss;
        EXPECT_LT((value.detach() - want.first).abs().max().item<double>(), 1e-5 * (1 + want.first.abs().max().item<double>())) << (logps ? "logps" : "loss");
        EXPECT_LT((grad - want.second).abs().max().item<double>(), 1e-5 * (1 + want.second.abs().max().item<double>())) << (logps ? "logps" : "loss");
      }
    });
  }
}

TEST(TensorParallel, ShardRangesCoverTheWholeOnce) {
  for (std::int64_t full : {1, 7, 8, 259, 320, 50257})
    for (int size : {1, 2, 3, 4}) {
      std::int64_t next = 0;
      for (int r = 0; r < size; ++r) {
        const auto s = kit::shard_range(full, r, size);
        EXPECT_EQ(s.start, next);
        next += s.length;
      }
      EXPECT_EQ(next, full);
    }
  EXPECT_EQ(kit::shard_range(259, 3, 4).length, 64);
}

// The model says how it splits, or names the counts that do not.
// [run] check_replicas' comparison: silent while the copies are equal or the drifted one is left
// out, and one message naming the weight, the rank and the step once a copy moved by one ulp.
TEST(TensorParallel, ReplicaCheckNamesTheCopyThatDrifted) {
  on_ranks(Mesh{1, 1, 2}, [](Parallel& parallel) {
    std::vector<NamedParameter> params{{"a.weight", 0, at::ones({4})}, {"b.weight", 0, at::ones({3, 2})}, {"c.weight", 0, at::ones({2})}};
    core::check_replicas(parallel.tensor(), "tensor", params, {true, true, true}, 0, at::kCPU);
    if (parallel.tensor().rank() == 1) params[1].tensor[2][1] = std::nextafter(1.0f, 2.0f);
    core::check_replicas(parallel.tensor(), "tensor", params, {true, false, true}, 1, at::kCPU);
    try {
      core::check_replicas(parallel.tensor(), "tensor", params, {true, true, true}, 2, at::kCPU);
      ADD_FAILURE() << "the drifted copy was not found";
    } catch (const std::logic_error& e) {
      EXPECT_TRUE(contains(e.what(), "step 3: weight 'b.weight' is whole on every tensor rank, but tensor rank 1's copy differs from rank 0's (sum 6"))
          << e.what();
      EXPECT_TRUE(contains(e.what(), "the model plugin must mark where each rank uses its part (kit::copy_to_tensor_region)")) << e.what();
    }
  });
}

// A model plugin whose tensor ranks each use their part of a whole weight and never sum its
// gradient (tests/plugins/contract_model.cpp, TEST_FORGETS_SUM) trained with everything at its
// default: the run stops after step 1 naming the weight. With the check off it trains on,
// its copies drifting apart, and says nothing (what issue 51 found).
TEST(TensorParallel, AForgottenGradientSumStopsTheRunAtStepOneByDefault) {
  const fs::path dir = temp_dir();
  std::string pipeline = copy_task(dir);
  pipeline.replace(0, pipeline.find("[tokenizer]"), "[model]\nplugin = \"forgets-sum\"\n");
  pipeline.replace(pipeline.find("[placement]"), std::string::npos, "");
  write_file(dir / "p.toml", pipeline + "[placement]\nplugin = \"tensor-parallel\"\n[parallel]\ntensor = 2\n"
                                        "[train]\nbatch_size = 4\nlr = 5e-2\nlog_every = 1\nthreads = 1\nmax_steps = 3\ncheckpoint_every = 0\n"
                                        "[plugins]\npaths = [\"" + test_plugin_dir("forgets_sum").string() + "\"]\n");
  const auto stopped = run_loom_ranks({"run", (dir / "p.toml").string(), "--output", (dir / "default").string()}, 2);
  EXPECT_NE(stopped.exit_code, 0);
  EXPECT_TRUE(contains(stopped.err, "step 1: weight 'model.layers.0.mlp.scale' is whole on every tensor rank, but tensor rank 1's copy differs"))
      << stopped.out << stopped.err;
  const auto silent = run_loom_ranks({"run", (dir / "p.toml").string(), "--output", (dir / "off").string(), "--set", "run.check_replicas_every=0"}, 2);
  EXPECT_FALSE(contains(silent.err, "differs")) << silent.err;
  EXPECT_EQ(metrics_rows(dir / "off/metrics.jsonl", true).size(), 3u) << "with the check off the drift goes unseen: " << silent.out << silent.err;
}

// The weights a split-mlp model saved (tests/plugins/split_mlp_model.cpp's own JSON), by name.
std::map<std::string, at::Tensor> split_mlp_weights(const fs::path& dir) {
  std::map<std::string, at::Tensor> out;
  const auto j = nlohmann::json::parse(read_file(dir / "weights.json"));
  for (const auto& [name, w] : j.items())
    out[name] = at::tensor(w["values"].get<std::vector<double>>(), at::kDouble).view(w["shape"].get<std::vector<std::int64_t>>());
  return out;
}

// A model of the SDK alone (tests/plugins/split_mlp_model.cpp: no kit, no TensorParallelModel, no
// collective; its linears declare column and row) is split by the host over tensor 2 and trains as
// one process does: a full fine-tune (every replica checked each step; the saved weights gathered
// whole), LoRA on its linears and QLoRA on a 4-bit base each rank stores its part of. The plan
// says what the host splits.
TEST(TensorParallel, AModelOfTheSdkAloneIsSplitByTheHost) {
  const fs::path dir = temp_dir();
  std::string pipeline = copy_task(dir);
  pipeline.replace(0, pipeline.find("[tokenizer]"), "[model]\nplugin = \"split-mlp\"\n");
  pipeline.replace(pipeline.find("[placement]"), std::string::npos, "");
  const std::string base = pipeline + "[plugins]\npaths = [\"" + test_plugin_dir("split_mlp").string() + "\"]\n" +
                           "[train]\nbatch_size = 8\nlr = 1e-2\nlog_every = 1\nthreads = 1\nmax_steps = 20\ncheckpoint_every = 0\n";
  const std::string tensor = "[placement]\nplugin = \"tensor-parallel\"\n[parallel]\ntensor = 2\n";
  const std::string lora = "[adapter]\nplugin = \"lora\"\nr = 4\nalpha = 8\ntarget_modules = \"all-linear\"\ndropout = 0.0\n";
  const std::string qlora = "[adapter]\nplugin = \"qlora\"\nr = 4\nalpha = 8\ntarget_modules = \"all-linear\"\ndropout = 0.0\nblocksize = 16\n"
                            "double_quant = false\n";
  const auto run = [&](const std::string& name, const std::string& sections, int world) {
    write_file(dir / (name + ".toml"), base + sections);
    const std::vector<std::string> args{"run", (dir / (name + ".toml")).string(), "--output", (dir / name).string(), "--set", "run.check_replicas=true"};
    const auto r = world > 1 ? run_loom_ranks(args, world) : run_loom(args);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return dir / name;
  };
  const fs::path whole = run("whole", "[placement]\nplugin = \"single\"\n", 1);
  const fs::path split = run("split", tensor, 2);
  const fs::path adapted = run("adapted", "[placement]\nplugin = \"single\"\n" + lora, 1);
  const fs::path adapted_split = run("adapted-split", tensor + lora, 2);
  const fs::path four_bit = run("four-bit", "[placement]\nplugin = \"single\"\n" + qlora, 1);
  const fs::path four_bit_split = run("four-bit-split", tensor + qlora, 2);
  ASSERT_FALSE(HasFailure());
  const auto rows = metrics_rows(whole / "metrics.jsonl", true);
  ASSERT_GE(rows.size(), 20u);
  EXPECT_LT(rows.back()["loss"].get<double>(), 0.8 * rows.front()["loss"].get<double>()) << "the model did not learn";
  for (const auto& [one, two] : {std::pair{whole, split}, std::pair{adapted, adapted_split}, std::pair{four_bit, four_bit_split}}) {
    SCOPED_TRACE(two.filename().string());
    expect_same_losses(two / "metrics.jsonl", one / "metrics.jsonl", 1e-5);
  }
  expect_close_in_norm(adapted_split / "adapter", adapted / "adapter", kReorderedNorm);
  expect_close_in_norm(four_bit_split / "adapter", four_bit / "adapter", kReorderedNorm);
  // Saved whole from the split ranks: every weight under its name and whole shape, near one process's.
  const auto mine = split_mlp_weights(split / "model"), theirs = split_mlp_weights(whole / "model");
  ASSERT_EQ(mine.size(), theirs.size());
  for (const auto& [name, t] : theirs) {
    ASSERT_TRUE(mine.count(name)) << name;
    ASSERT_EQ(mine.at(name).sizes(), t.sizes()) << name;
    EXPECT_LE((mine.at(name) - t).norm().item<double>(), kReorderedNorm * t.norm().item<double>()) << name;
  }
  write_file(dir / "plan.toml", base + tensor);
  const auto plan = run_loom({"plan", (dir / "plan.toml").string(), "--devices", "cpu=64GiB", "--nproc-per-node", "2"});
  EXPECT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_TRUE(contains(plan.out, "split by the host as the model declares: 2 linears by column, 2 by row")) << plan.out;
}

// What a model says of a split over `tensor` ranks, through the capability the host asks for.
TensorParallelSupport split_of(const Model& model, int tensor) {
  const auto* splittable = core::capability<TensorParallelModel>(model);
  if (!splittable) return {"the model offers no TensorParallelModel", {}};
  return splittable->tensor_parallel(tensor);
}

TEST(TensorParallel, TheModelSaysHowItSplitsOrWhyNot) {
  const auto model = [](int heads, int kv, int intermediate, int vocab) {
    return llama_from_config(R"({"model_type": "llama", "hidden_size": 96, "intermediate_size": )" + std::to_string(intermediate) +
                             R"(, "num_hidden_layers": 2, "num_attention_heads": )" + std::to_string(heads) +
                             R"(, "num_key_value_heads": )" + std::to_string(kv) + R"(, "vocab_size": )" + std::to_string(vocab) + "}");
  };
  const auto joined = [](const TensorParallelSupport& s) {
    std::string all = s.refusal;
    for (const auto& n : s.notes) all += "\n" + n;
    return all;
  };
  const auto split = split_of(*model(4, 2, 64, 259), 2);
  EXPECT_EQ(split.refusal, "");
  EXPECT_NE(joined(split).find("key/value: 2 heads split, 1 per tensor rank"), std::string::npos) << joined(split);
  const auto replicated = split_of(*model(4, 2, 64, 259), 4);
  EXPECT_EQ(replicated.refusal, "");
  EXPECT_NE(joined(replicated).find("k_proj and v_proj replicated on every rank"), std::string::npos) << joined(replicated);
  EXPECT_NE(split_of(*model(6, 6, 64, 259), 4).refusal.find("its 6 attention heads do not split over 4 tensor ranks"), std::string::npos);
  EXPECT_NE(split_of(*model(4, 2, 66, 259), 4).refusal.find("intermediate_size 66 does not split over 4"), std::string::npos);
  EXPECT_NE(split_of(*model(4, 2, 64, 5), 4).refusal.find("vocabulary of 5 is too small"), std::string::npos);
  // Multi-query attention (one K/V head) replicates it on every rank.
  EXPECT_EQ(split_of(*model(8, 1, 64, 259), 4).refusal, "");
}

// An 8B shape split over 2 ranks holds about half the weights per rank (norms whole), and the
// split activations shrink while the residual stream stays whole.
TEST(TensorParallel, ThePlannerCountsWhatEachRankHolds) {
  PlacementRequest r;
  r.model = llama_from_config(R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256})")->structure();
  r.dtype = DType::kBFloat16;
  r.batch_size = 4;
  r.seq_len = 1024;
  const auto whole = kit::block_memory(r, 1), embed_whole = kit::block_memory(r, 0);
  r.mesh.tensor = 2;
  const auto half = kit::block_memory(r, 1), embed_half = kit::block_memory(r, 0);
  EXPECT_NEAR(static_cast<double>(half.weights) / static_cast<double>(whole.weights), 0.5, 0.001);
  EXPECT_EQ(embed_half.weights * 2, embed_whole.weights);
  // The residual stream and its normed copies (4 of 13 values a token saved, at this shape) stay whole.
  EXPECT_LT(half.activations, whole.activations * 65 / 100);
  EXPECT_GT(half.activations, whole.activations / 2);
  EXPECT_LT(half.trainable_state, whole.trainable_state);  // full fine-tune: gradients and moments of the parts
}

fs::path fixture(const std::string& name = "llama") { return parity_fixture(name); }
// Llama, and Qwen3: per-head q/k norms every rank applies whole to its own heads; the families of
// kit 4 (tests/fixtures/families), blocks among them, whose K/V heads split over 2 ranks only:
// GPT-NeoX's per-head fused qkv, StableLM's and Cohere's per-head norms split with their heads,
// Granite's multipliers, Gemma 2's soft-caps, the shared expert of Qwen2-MoE.
const std::vector<std::string> kSplitFixtures{"llama", "qwen3", "families/gpt_neox", "families/stablelm", "families/cohere", "families/starcoder2",
                                              "families/granite", "families/gemma2", "families/olmoe", "families/qwen2_moe", "families/deepseek_v3",
                                              "families/gpt_oss"};

std::int64_t group_size(const Communicator* group) { return group ? group->size() : 1; }

// The tensor sizes a fixture splits over: the families' two K/V heads split over 2 ranks only.
std::vector<int> split_sizes(const std::string& family) { return family.rfind("families/", 0) == 0 ? std::vector<int>{2} : std::vector<int>{2, 4}; }

std::unique_ptr<Executor> load_split(const Model& model, Parallel* parallel) {
  Plan plan;
  for (const auto& b : model.structure().blocks) plan.blocks.push_back({b.name, "cpu"});
  return core::load_executor(model, plan, DType::kFloat32, 0, false, 0, parallel);
}

// The parity fixtures' models (4 heads, 2 K/V heads, vocabulary 320) over 2 ranks (K/V split) and
// 4 (K/V replicated) give the logits transformers gave, with and without the PEFT adapter, and
// after merging the adapter into the split weights.
TEST(TensorParallel, SplitModelGivesTransformersLogits) {
 for (const auto& family : kSplitFixtures) {
  const fs::path dir = fixture(family);
  const ParityInputs in = read_parity_inputs(dir);
  const at::Tensor base = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
  const at::Tensor adapted = kit::SafetensorsFile(dir / "logits_adapter.safetensors").tensor("logits");
  for (int tensor : split_sizes(family)) {
    SCOPED_TRACE(family + ", tensor " + std::to_string(tensor));
    Mesh mesh;
    mesh.tensor = tensor;
    std::vector<double> errors(static_cast<std::size_t>(tensor) * 3, 1.0);
    on_ranks(mesh, [&](Parallel& parallel) {
      auto model = make_plugin<Model>("model", model_plugin_of(dir), {{"path", dir.string()}});
      auto executor = load_split(*model, &parallel);
      torch::NoGradGuard no_grad;
      const auto logits = [&] { return executor->logits(executor->forward(in.ids, in.positions, in.mask)); };
      const auto slot = static_cast<std::size_t>(parallel.rank()) * 3;
      errors[slot] = max_real_error(logits(), base, in.mask);
      // DeepSeek-V3's adapters hold its experts, whose LoRA does not split over tensor ranks yet.
      if (family == "families/deepseek_v3") {
        errors[slot + 1] = errors[slot + 2] = 0;
        return;
      }
      auto lora = make_plugin<Adapter>("adapter", "lora");
      lora->load(executor->model(), dir / "adapter");
      executor->model().set_training(false);
      errors[slot + 1] = max_real_error(logits(), adapted, in.mask);
      lora->merge(executor->model());
      errors[slot + 2] = max_real_error(logits(), adapted, in.mask);
    });
    for (double e : errors) EXPECT_LE(e, 1e-4);
  }
 }
}

// Generation from the split model (the last position's logits gathered over the vocabulary shards)
// gives one device's text, greedy and with nucleus sampling (every rank draws alike from the seed).
TEST(TensorParallel, GenerationFromSplitLogitsEqualsOneDevice) {
  const std::vector<std::string> prompts = {"Q:ab A:", "hello", "x"};
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes");
  // A random model (each rank draws every tensor whole from its name's seed and keeps its part) of
  // the bytes tokenizer's vocabulary, 259: uneven over 2 and 4 ranks.
  std::mutex init;  // random init seeds the process's generator: the rank threads take turns
  const auto answers = [&](Parallel* parallel, double temperature) {
    auto model = make_plugin<Model>("model", "llama",
                                    {{"init", std::string("random")}, {"hidden_size", std::int64_t{64}}, {"intermediate_size", std::int64_t{128}},
                                     {"num_hidden_layers", std::int64_t{2}}, {"num_attention_heads", std::int64_t{4}},
                                     {"num_key_value_heads", std::int64_t{2}}, {"vocab_size", std::int64_t{259}}});
    std::unique_ptr<Executor> executor;
    {
      std::lock_guard<std::mutex> lock(init);
      executor = load_split(*model, parallel);
    }
    core::GenerationSettings g;
    g.max_new_tokens = 12;
    g.temperature = temperature;
    g.top_p = 0.9;
    g.seed = 5;
    executor->model().set_training(false);
    core::RankRuntime runtime(*executor);
    return core::generate([&](const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask,
                              CachedPass& pass) { return runtime.last_logits(ids, positions, mask, pass); },
                          *tokenizer, prompts, g);
  };
  for (double temperature : {0.0, 1.0}) {
    const auto one = answers(nullptr, temperature);
    for (int tensor : {2, 4}) {
      SCOPED_TRACE("temperature " + std::to_string(temperature) + ", tensor " + std::to_string(tensor));
      Mesh mesh;
      mesh.tensor = tensor;
      std::vector<std::vector<std::string>> split(static_cast<std::size_t>(tensor));
      on_ranks(mesh, [&](Parallel& parallel) { split[static_cast<std::size_t>(parallel.rank())] = answers(&parallel, temperature); });
      for (const auto& mine : split) EXPECT_EQ(mine, one);
    }
  }
}

// Gives every lora_B of `trainable` values drawn whole from one seed (each rank keeping its part), so
// the adapter changes the logits and every rank's part is a part of one device's tensor.
void randomize_lora_b(Adapter& lora, LoadedModel& model, const std::vector<NamedParameter>& trainable, Communicator* group) {
  torch::NoGradGuard no_grad;
  // A generator of its own: the ranks here are threads of one process, sharing the global one.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (const auto& p : trainable) {
    if (p.name.find("lora_B") == std::string::npos) continue;
    const int dim = group ? lora.shard_dim(model, p.name) : -1;
    auto shape = p.tensor.sizes().vec();
    if (dim >= 0) shape[static_cast<std::size_t>(dim)] *= group->size();
    const at::Tensor whole = at::randn(shape, gen) * 0.1;
    p.tensor.copy_(dim < 0 ? whole : whole.narrow(dim, group->rank() * p.tensor.size(dim), p.tensor.size(dim)));
  }
}

// An adapter trained (here: given random B) at tensor 2 is saved whole, once, with the keys and
// shapes of a one-device adapter, and one device loading it computes the same logits.
TEST(TensorParallel, AdapterSavedFromSplitRanksLoadsOnOneDevice) {
  const ParityInputs in = read_parity_inputs(fixture());
  const fs::path dir = temp_dir() / "adapter";
  Mesh mesh;
  mesh.tensor = 2;
  std::vector<at::Tensor> split_logits(2);
  on_ranks(mesh, [&](Parallel& parallel) {
    auto model = make_plugin<Model>("model", "llama", {{"path", fixture().string()}});
    auto executor = load_split(*model, &parallel);
    auto lora = make_plugin<Adapter>("adapter", "lora", {{"target_modules", std::string("all-linear")}, {"r", std::int64_t{4}},
                                                         {"modules_to_save", StringList{"embed_tokens"}}});
    const auto trainable = lora->attach(executor->model(), 3);
    randomize_lora_b(*lora, executor->model(), trainable, &parallel.tensor());
    torch::NoGradGuard no_grad;
    executor->model().set_training(false);
    split_logits[static_cast<std::size_t>(parallel.rank())] = executor->logits(executor->forward(in.ids, in.positions, in.mask));
    const auto tensors = lora->saved_tensors(executor->model());
    if (parallel.rank() == 0) lora->write(tensors, dir);
  });
  ASSERT_TRUE(fs::exists(dir / "adapter_model.safetensors"));
  auto model = make_plugin<Model>("model", "llama", {{"path", fixture().string()}});
  auto one = load_split(*model, nullptr);
  auto lora = make_plugin<Adapter>("adapter", "lora");
  lora->load(one->model(), dir);
  torch::NoGradGuard no_grad;
  one->model().set_training(false);
  const at::Tensor logits = one->logits(one->forward(in.ids, in.positions, in.mask));
  const at::Tensor base = kit::SafetensorsFile(fixture() / "logits.safetensors").tensor("logits");
  EXPECT_GT(max_real_error(logits, base, in.mask), 1e-2) << "the adapter should change the logits";
  // Split products sum in another order (test_support.hpp's bound, of the logits' magnitude).
  const double bound = float32_path_bound(fixture() / "config.json", in.ids.size(1)) * logits.abs().max().item<double>();
  for (const auto& l : split_logits) EXPECT_LE(max_real_error(l, logits, in.mask), bound);
  // The same keys and shapes a one-device adapter has.
  const kit::SafetensorsFile saved(dir / "adapter_model.safetensors");
  const auto fresh = make_plugin<Adapter>("adapter", "lora", {{"target_modules", std::string("all-linear")}, {"r", std::int64_t{4}},
                                                              {"modules_to_save", StringList{"embed_tokens"}}});
  auto reference = load_split(*model, nullptr);
  fresh->attach(reference->model(), 3);
  const auto expected = fresh->saved_tensors(reference->model());
  ASSERT_EQ(saved.tensors().size(), expected.size());
  for (const auto& [name, t] : expected) {
    ASSERT_NE(saved.find(name), nullptr) << name;
    EXPECT_EQ(saved.tensor(name).sizes(), t.sizes()) << name;
  }
}

// Adam normalises each parameter's step, so equal losses alone would not see a gradient off by a
// constant factor: the gradients themselves, gathered from the split ranks, equal one device's,
// for every parameter of a full fine-tune and every LoRA tensor (K/V split at 2 ranks, replicated
// at 4; the vocabulary-parallel loss and embedding included).
// (Qwen3's q/k norms too: whole on every rank, each rank's gradient of them only its heads' part.)
TEST(TensorParallel, GradientsEqualOneDevice) {
 for (const auto& family : kSplitFixtures) {
  const fs::path dir = fixture(family);
  const ParityInputs in = read_parity_inputs(dir);
  const at::Tensor labels = in.ids.masked_fill(in.mask == 0, -100);
  const auto gradients = [&](Parallel* parallel, bool lora) {
    auto model = make_plugin<Model>("model", model_plugin_of(dir), {{"path", dir.string()}});
    auto executor = load_split(*model, parallel);
    Communicator* group = parallel ? &parallel->tensor() : nullptr;
    std::unique_ptr<Adapter> adapter;
    std::vector<NamedParameter> trainable;
    if (lora) {
      for (auto& p : executor->model().parameters()) p.tensor.set_requires_grad(false);
      adapter = make_plugin<Adapter>("adapter", "lora", {{"target_modules", std::string("all-linear")}, {"r", std::int64_t{4}}});
      trainable = adapter->attach(executor->model(), 3);
      randomize_lora_b(*adapter, executor->model(), trainable, group);
    } else {
      trainable = executor->model().parameters();
      for (auto& p : trainable) p.tensor.set_requires_grad(true);
    }
    executor->loss_sum(executor->head_output(in.ids, in.positions, in.mask), labels).backward();
    std::map<std::string, at::Tensor> out;
    for (const auto& p : trainable) {
      if (!p.tensor.grad().defined()) continue;  // DeepSeek-V3's correction bias only picks experts: no gradient reaches it
      const int dim = !group ? -1 : adapter ? adapter->shard_dim(executor->model(), p.name) : executor->model().shard_dim(p.name);
      const at::Tensor& g = p.tensor.grad();
      // Stacked experts' gate_up [E, 2I, H] is split as two pieces (each expert's gate units, then its
      // up units); gpt-oss's, whose gate and up rows alternate, as one run of pairs.
      const bool fused = g.dim() == 3 && p.name.size() > 13 && p.name.compare(p.name.size() - 13, 13, ".gate_up_proj") == 0 && family != "families/gpt_oss";
      const std::int64_t half = g.dim() == 3 ? g.size(1) / 2 * group_size(group) : 0;
      out[p.name] = dim < 0 ? g.clone() : fused ? kit::gather_pieces(g, dim, {half, half}, *group) : kit::gather_shards(g, dim, -1, *group);
    }
    return out;
  };
  for (bool lora : {false, true}) {
    const auto one = gradients(nullptr, lora);
    for (int tensor : split_sizes(family)) {
      SCOPED_TRACE(family + ", " + (lora ? "lora" : "full") + ", tensor " + std::to_string(tensor));
      Mesh mesh;
      mesh.tensor = tensor;
      std::vector<std::map<std::string, at::Tensor>> split(static_cast<std::size_t>(tensor));
      on_ranks(mesh, [&](Parallel& parallel) { split[static_cast<std::size_t>(parallel.rank())] = gradients(&parallel, lora); });
      for (const auto& per_rank : split) {
        ASSERT_EQ(per_rank.size(), one.size());
        for (const auto& [name, g] : one) {
          const at::Tensor mine = per_rank.at(name);
          ASSERT_EQ(mine.sizes(), g.sizes()) << name;
          // gpt-oss's layer-0 q and k LoRA gradients reach 36 (its fixture's sinks of sigma 1), summed in
          // another order over the ranks: 1.2e-5 of the largest apart.
          const double tolerance = family == "families/gpt_oss" ? 3e-5 : 1e-5;
          EXPECT_LE((mine - g).abs().max().item<double>(), tolerance * std::max(1e-3, g.abs().max().item<double>())) << name;
        }
      }
    }
  }
 }
}

const std::string kSingle = "[placement]\nplugin = \"single\"\n";
const std::string kTensorParallel = "[placement]\nplugin = \"tensor-parallel\"\n";
const std::string kLora = "[adapter]\nplugin = \"lora\"\nr = 8\nalpha = 16\ntarget_modules = \"all-linear\"\ndropout = 0.0\n";
const std::string kLoraWithEmbedding = kLora + "modules_to_save = [\"embed_tokens\"]\n";

std::string steps() {
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  return "max_steps = 6\nbatch_size = 4\ngrad_accum = 2\n";  // several times slower under ASan: same comparison, fewer steps
#endif
#endif
  return "max_steps = 20\nbatch_size = 4\ngrad_accum = 2\n";
}

// (Training split over 2 and 4 ranks, tied and untied, LoRA and full, with activation
// checkpointing, and with data or pipeline ranks, against one process: mesh_matrix_test.cpp.)

// `loom generate --nproc-per-node N` splits the model as [parallel] says (tensor, or pipeline
// stages: here ranks as threads) and prints what one process prints, once.
TEST(TensorParallel, GenerateOverProcessesPrintsOneProcesssText) {
  const fs::path dir = temp_dir();
  // On the CPU everywhere: a GPU machine's one process would otherwise sample on its GPU, and two
  // processes cannot share its one GPU.
  const auto p = copy_task_pipeline(dir, 2, true, kTensorParallel + "device = \"cpu\"\n", kLora, steps());
  const std::vector<std::string> common = {"generate", p.string(), "--prompt", "Q:abab A:", "--prompt", "Q:cd A:", "--max-new-tokens", "8",
                                           "--temperature", "1.0", "--top-p", "0.9"};
  const auto one = run_loom(common);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  ASSERT_NE(one.out.find("Q:abab A:"), std::string::npos) << one.out;
  auto split = common;
  for (const std::string arg : {"--set", "parallel.tensor=2", "--nproc-per-node", "2"}) split.push_back(arg);
  // The launcher prefixes its workers' lines with their rank; only rank 0 prints.
  const auto unprefixed = [](std::string text) {
    for (std::size_t at; (at = text.find("[rank 0] ")) != std::string::npos;) text.erase(at, 9);
    return text;
  };
  const auto tp = run_loom_process(split);
  ASSERT_EQ(tp.exit_code, 0) << tp.err;
  EXPECT_EQ(unprefixed(tp.out), one.out);
  auto staged = common;
  for (const std::string arg : {"--set", "parallel.pipeline=2", "--set", "placement.plugin=\"pipeline\""}) staged.push_back(arg);
  const auto pp = run_loom_ranks(staged, 2);
  ASSERT_EQ(pp.exit_code, 0) << pp.err;
  EXPECT_EQ(unprefixed(pp.out), one.out);
}

// What cannot be split is refused before anything loads, naming the counts; the plan shows the split.
TEST(TensorParallel, PlanShowsTheSplitAndRefusesWhatCannotSplit) {
  const fs::path dir = temp_dir();
  const auto p = copy_task_pipeline(dir, 2, true, kTensorParallel, kLora, steps(), "[parallel]\ntensor = 2\n");
  const auto plan = run_loom({"plan", p.string()});
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_NE(plan.out.find("tensor parallel, key/value: 2 heads split, 1 per tensor rank"), std::string::npos) << plan.out;
  EXPECT_NE(plan.out.find("tensor parallel, vocabulary: 259 rows"), std::string::npos) << plan.out;
  const auto three = run_loom({"plan", copy_task_pipeline(dir / "c", 2, true, kTensorParallel, kLora, steps(), "[parallel]\ntensor = 3\n").string()});
  EXPECT_NE(three.exit_code, 0);
  EXPECT_NE(three.err.find("p.toml:"), std::string::npos) << three.err;
  EXPECT_NE(three.err.find(": [parallel] tensor = 3: model plugin 'llama' cannot split this model"), std::string::npos) << three.err;
  EXPECT_NE(three.err.find("its 4 attention heads do not split over 3 tensor ranks"), std::string::npos) << three.err;
  // One process (loom generate's, or tensor = 1) holds the model whole.
  const auto alone = run_loom({"plan", copy_task_pipeline(dir / "b", 2, true, kTensorParallel, kLora, steps()).string()});
  EXPECT_EQ(alone.exit_code, 0) << alone.err;
  EXPECT_NE(alone.out.find("whole: one tensor rank splits nothing"), std::string::npos) << alone.out;
}

}  // namespace
}  // namespace loom::test
