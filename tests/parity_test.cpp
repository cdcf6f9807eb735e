// loom against the Python ecosystem: fixtures made by tests/parity/make_fixtures.py with HF
// transformers and PEFT (tiny random models, their logits, PEFT adapters and theirs).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <nlohmann/json.hpp>

#include "runtime/executor.hpp"
#include "runtime/folded_adapters.hpp"
#include "loom/adapter.hpp"
#include "loom/error.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/loss.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/layers.hpp"
#include "plugins/plugin_guard.hpp"
#include "plugins/plugin_registry.hpp"
#include "test_support.hpp"

namespace loom::core {
namespace {
namespace fs = std::filesystem;

fs::path fixture(const std::string& name) { return test::parity_fixture(name); }
std::string test_name(const std::string& name) { return test::fixture_test_name(name); }

std::unique_ptr<Executor> load_fixture_model(const fs::path& dir) {
  auto model = test::make_plugin<Model>("model", test::model_plugin_of(dir), {{"path", dir.string()}});
  Plan plan;
  for (const auto& b : model->structure().blocks) plan.blocks.push_back({b.name, "cpu"});
  return load_executor(*model, plan, DType::kFloat32, 0);
}

class Parity : public ::testing::TestWithParam<std::string> {};

// A long row's MLP in slices of rows (kit::mlp_over_row_chunks) gives the whole MLP's loss and
// every weight's gradient: 2 rows of 150 tokens in slices of 128 rows, every weight training, for
// the kit's own layer (separate and fused gate/up, GeGLU, norms after the MLP) and families
// written as blocks (plain MLPs, a parallel block, DeepSeek's dense layers).
class LongRows : public ::testing::TestWithParam<std::string> {};

TEST_P(LongRows, AnMlpInSlicesGivesTheWholeMlpsLossAndGradients) {
  const fs::path dir = fixture(GetParam());
  auto executor = load_fixture_model(dir);
  const auto config = nlohmann::json::parse(test::read_file(dir / "config.json"));
  const std::int64_t rows = 2, len = 150;
  at::manual_seed(3);
  const at::Tensor ids = at::randint(config["vocab_size"].get<std::int64_t>(), {rows, len}, at::kLong);
  const at::Tensor positions = at::arange(len, at::kLong).view({1, len}).expand({rows, len}).contiguous(), mask = at::ones({rows, len}, at::kLong);
  for (auto& p : executor->model().parameters()) p.tensor.set_requires_grad(true);
  const auto run = [&](std::map<std::string, at::Tensor>& grads) {
    for (auto& p : executor->model().parameters()) p.tensor.mutable_grad() = at::Tensor();
    const at::Tensor loss = executor->loss_sum(executor->head_output(ids, positions, mask), ids);
    loss.backward();
    for (const auto& p : executor->model().parameters())
      if (p.tensor.grad().defined()) grads[p.name] = p.tensor.grad().clone();
    return loss.item<double>();
  };
  std::map<std::string, at::Tensor> whole, sliced;
  const double whole_loss = run(whole);
  const std::int64_t budget = kit::mlp_slice_bytes();
  kit::set_mlp_slice_bytes(1);
  EXPECT_TRUE(kit::mlp_runs_in_chunks(rows * len, config["intermediate_size"].get<std::int64_t>(), 4));
  const double sliced_loss = run(sliced);
  kit::set_mlp_slice_bytes(budget);
  EXPECT_NEAR(sliced_loss, whole_loss, 1e-6 * whole_loss);
  ASSERT_EQ(sliced.size(), whole.size());
  for (const auto& [name, g] : whole) {
    const double scale = 1 + g.abs().max().item<double>();
    EXPECT_LT((sliced.at(name) - g).abs().max().item<double>(), 1e-5 * scale) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, LongRows,
                         ::testing::Values("llama", "phi3", "gemma3", "olmo2", "families/gpt_neox", "families/starcoder2", "families/cohere",
                                           "families/gemma2", "families/granite", "families/stablelm", "families/deepseek_v3"),
                         [](const auto& info) { return test_name(info.param); });

TEST_P(Parity, BaseLogitsMatchTransformers) {
  const fs::path dir = fixture(GetParam());
  const test::ParityInputs in = test::read_parity_inputs(dir);
  auto executor = load_fixture_model(dir);
  at::NoGradGuard no_grad;
  const at::Tensor logits = executor->forward(in.ids, in.positions, in.mask);
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
  ASSERT_EQ(logits.sizes(), expected.sizes());
  EXPECT_LE(test::max_real_error(logits, expected, in.mask), 1e-4);
}

// The unpadded row alone takes the plain-causal attention path (no mask); it must agree too.
TEST_P(Parity, UnpaddedRowMatchesWithoutAMask) {
  const fs::path dir = fixture(GetParam());
  const test::ParityInputs in = test::read_parity_inputs(dir);
  auto executor = load_fixture_model(dir);
  at::NoGradGuard no_grad;
  const at::Tensor logits = executor->forward(in.ids.narrow(0, 0, 1), in.positions.narrow(0, 0, 1), in.mask.narrow(0, 0, 1));
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits").narrow(0, 0, 1);
  EXPECT_LE((logits - expected).abs().max().item<double>(), 1e-4);
}

std::unique_ptr<Adapter> lora_plugin() { return test::make_plugin<Adapter>("adapter", "lora"); }

void expect_adapter_parity(const fs::path& dir, const std::string& adapter, const std::string& logits_file) {
  const test::ParityInputs in = test::read_parity_inputs(dir);
  auto executor = load_fixture_model(dir);
  auto lora = lora_plugin();
  lora->load(executor->model(), dir / adapter);
  at::NoGradGuard no_grad;
  executor->model().set_training(false);
  const at::Tensor logits = executor->forward(in.ids, in.positions, in.mask);
  const at::Tensor expected = kit::SafetensorsFile(dir / logits_file).tensor("logits");
  const at::Tensor base = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
  EXPECT_GT(test::max_real_error(expected, base, in.mask), 1e-2) << "the fixture's adapter should change the logits";
  EXPECT_LE(test::max_real_error(logits, expected, in.mask), 1e-4);
}

// DeepSeek-V3's fixture adapter gives its experts their own rank (rank_pattern, which loom refuses:
// FamilyConfigs.RankPatternsNamingAnAdaptedModuleAreRefused); its expert adapter stands in.
TEST_P(Parity, PeftAdapterLogitsMatch) {
  if (GetParam() == "families/deepseek_v3") return expect_adapter_parity(fixture(GetParam()), "adapter-experts", "logits_adapter_experts.safetensors");
  expect_adapter_parity(fixture(GetParam()), "adapter", "logits_adapter.safetensors");
}

// An adapter loom saves is PEFT's file back: every tensor of PEFT's adapter `name` of fixture
// `dir` under its key, shape and values, and the same config lists (`keys`), so PEFT loads what
// loom writes as loom loads what PEFT writes. The adapter stays loaded on the returned executor.
std::unique_ptr<Executor> expect_saved_as_peft_wrote(const fs::path& dir, const std::string& name, std::unique_ptr<Adapter>& lora,
                                                     const std::vector<const char*>& keys) {
  auto executor = load_fixture_model(dir);
  lora = lora_plugin();
  lora->load(executor->model(), dir / name);
  const fs::path out = test::temp_dir() / "adapter";
  lora->save(executor->model(), out);
  const kit::SafetensorsFile peft(dir / name / "adapter_model.safetensors"), ours(out / "adapter_model.safetensors");
  EXPECT_EQ(ours.tensors().size(), peft.tensors().size());
  for (const auto& info : peft.tensors()) {
    const auto* saved = ours.find(info.name);
    if (saved == nullptr) {
      ADD_FAILURE() << "not saved: " << info.name;
      continue;
    }
    EXPECT_EQ(saved->shape, info.shape) << info.name;
    EXPECT_TRUE(at::equal(ours.tensor(info.name), peft.tensor(info.name))) << info.name;
  }
  const auto field = [](const fs::path& file, const char* key) {
    auto t = nlohmann::json::parse(test::read_file(file))[key].get<std::vector<std::string>>();
    std::sort(t.begin(), t.end());
    return t;
  };
  for (const char* key : keys) EXPECT_EQ(field(out / "adapter_config.json", key), field(dir / name / "adapter_config.json", key)) << key;
  return executor;
}

// Phi-3's fused qkv_proj and gate_up_proj as one A and one B each.
TEST(ParityFused, PhiAdapterSavesAsPeftWroteIt) {
  std::unique_ptr<Adapter> lora;
  expect_saved_as_peft_wrote(fixture("phi3"), "adapter", lora, {"target_modules"});
  EXPECT_NE(kit::SafetensorsFile(fixture("phi3") / "adapter/adapter_model.safetensors").find("base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"),
            nullptr);
}

TEST(ParityRsLora, AllLinearRankStabilisedAdapterMatches) {
  expect_adapter_parity(fixture("llama"), "adapter-rslora", "logits_adapter_rslora.safetensors");
}

// PEFT's LoRA on every expert (target_parameters, beside attention; PEFT 0.21's lora_A [E*r, in]
// expert-major, lora_B [out, E*r] rank-major, gate_up_proj's under "base_layer.") loads into loom
// and gives PEFT's logits; saved back it is PEFT's file (every key, shape and value, the same
// target_modules and target_parameters); merged into the experts it gives those logits again.
class ParityExperts : public ::testing::TestWithParam<std::string> {};

TEST_P(ParityExperts, PeftExpertAdapterLoadsSavesAndMerges) {
  const fs::path dir = fixture(GetParam());
  expect_adapter_parity(dir, "adapter-experts", "logits_adapter_experts.safetensors");
  std::unique_ptr<Adapter> lora;
  auto executor = expect_saved_as_peft_wrote(dir, "adapter-experts", lora, {"target_modules", "target_parameters"});
  // PEFT's nesting: gate_up_proj's A and B under base_layer (the first sparse layer's: DeepSeek-V3's layer 0 is dense).
  const kit::SafetensorsFile expert_file(dir / "adapter-experts/adapter_model.safetensors");
  const std::string nested = dir.filename() == "deepseek_v3" ? "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"
                                                              : "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight";
  EXPECT_NE(expert_file.find(nested), nullptr) << nested;
  lora->merge(executor->model());
  // Each expert's W + scale B A is PEFT's merge_and_unload()'s (tests/parity/make_fixtures.py).
  const kit::SafetensorsFile merged(dir / "merged_experts.safetensors");
  std::size_t compared = 0;
  for (const auto& p : executor->model().parameters())
    if (merged.find(p.name) != nullptr) {
      const at::Tensor want = merged.tensor(p.name);
      // gpt-oss's stacked experts are held [E, out, in] and saved [E, in, out].
      const at::Tensor held = p.tensor.sizes() == want.sizes() ? p.tensor : p.tensor.transpose(1, 2);
      EXPECT_LE((held - want).abs().max().item<double>(), 1e-6 * want.abs().max().item<double>()) << p.name;
      ++compared;
    }
  EXPECT_EQ(compared, merged.tensors().size());
  const test::ParityInputs in = test::read_parity_inputs(dir);
  at::NoGradGuard no_grad;
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits_adapter_experts.safetensors").tensor("logits");
  EXPECT_LE(test::max_real_error(executor->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Experts, ParityExperts,
                         ::testing::Values("mixtral", "qwen3_moe", "families/olmoe", "families/qwen2_moe", "families/deepseek_v3", "families/gpt_oss"),
                         [](const auto& info) { return test_name(info.param); });


// The lora plugin computes a layer whole over a frozen base (WholeProduct: one autograd node, one
// input gradient), else adds its delta inside its second product (DeltaAddedInPlace): a layer's
// output and every gradient (input, A, B) equal the base's output plus delta()'s.
TEST(LoraInPlace, TheDeltaAddedInPlaceGivesTheSumsValuesAndGradients) {
  const fs::path dir = fixture("llama");
  auto executor = load_fixture_model(dir);
  auto lora = lora_plugin();
  lora->load(executor->model(), dir / "adapter");  // B is not zero: the delta counts
  for (const auto& l : executor->model().linears()) {
    if (l.layer != nullptr && l.layer->adapter()) {
      EXPECT_NE(dynamic_cast<DeltaAddedInPlace*>(l.layer->adapter().get()), nullptr) << l.name;
      EXPECT_NE(dynamic_cast<WholeProduct*>(l.layer->adapter().get()), nullptr) << l.name;
    }
  }
  EXPECT_GT(test::expect_adapted_layers_equal_their_sums(executor->model(), 1e-5), 0);
}

std::unique_ptr<Adapter> lora_with(std::map<std::string, OptionValue> given) { return test::make_plugin<Adapter>("adapter", "lora", given); }

// modules_to_save trains whole modules beside the LoRA ones and saves them under PEFT's names.
TEST(LoraModulesToSave, SavedModulesRoundTripAndMayNotAlsoBeTargets) {
  const fs::path dir = fixture("llama");
  auto executor = load_fixture_model(dir);
  auto lora = lora_with({{"target_modules", StringList{"q_proj"}}, {"modules_to_save", StringList{"down_proj"}}});
  const auto trainable = lora->attach(executor->model(), 1);
  std::size_t saved = 0;
  for (const auto& p : trainable) saved += p.name.find("mlp.down_proj.weight") != std::string::npos;
  EXPECT_EQ(saved, 2u);  // one per layer
  {
    at::NoGradGuard no_grad;
    int changed = 0;
    for (auto& p : executor->model().parameters())
      if (p.name == "model.layers.1.mlp.down_proj.weight") p.tensor.add_(0.5), ++changed;
    ASSERT_EQ(changed, 1) << "the model has no parameter model.layers.1.mlp.down_proj.weight";
  }
  const fs::path out = test::temp_dir() / "adapter";
  lora->save(executor->model(), out);
  const kit::SafetensorsFile file(out / "adapter_model.safetensors");
  ASSERT_NE(file.find("base_model.model.model.layers.1.mlp.down_proj.weight"), nullptr);
  auto fresh = load_fixture_model(dir);
  lora_with({})->load(fresh->model(), out);
  bool found = false;
  for (const auto& p : fresh->model().parameters()) {
    if (p.name == "model.layers.1.mlp.down_proj.weight") {
      found = true;
      EXPECT_TRUE(at::equal(p.tensor, file.tensor("base_model.model.model.layers.1.mlp.down_proj.weight")));
    }
  }
  EXPECT_TRUE(found) << "the model has no parameter model.layers.1.mlp.down_proj.weight";
  auto both = lora_with({{"target_modules", StringList{"down_proj"}}, {"modules_to_save", StringList{"down_proj"}}});
  EXPECT_THROW(both->attach(load_fixture_model(dir)->model(), 1), UserError);
}

// Merging folds the adapter into the base weights: the logits stay those of base + adapter.
TEST(ParityMerge, MergedWeightsGivePeftAdapterLogits) {
  const fs::path dir = fixture("llama");
  const test::ParityInputs in = test::read_parity_inputs(dir);
  auto executor = load_fixture_model(dir);
  auto lora = lora_plugin();
  lora->load(executor->model(), dir / "adapter");
  lora->merge(executor->model());
  EXPECT_TRUE(executor->model().linears().front().layer->adapter() == nullptr);
  at::NoGradGuard no_grad;
  const at::Tensor logits = executor->forward(in.ids, in.positions, in.mask);
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits_adapter.safetensors").tensor("logits");
  EXPECT_LE(test::max_real_error(logits, expected, in.mask), 1e-4);
  // And the merged folder loads back as a plain HF model with the same logits.
  const fs::path merged = test::temp_dir() / "merged";
  executor->model().save_pretrained(merged);
  test::write_file(merged / "inputs.json", test::read_file(dir / "inputs.json"));
  auto reloaded = load_fixture_model(merged);
  EXPECT_LE(test::max_real_error(reloaded->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
}

// Evaluation folds a LoRA whose products cost a good share of its layers' into the dense float32
// weights (D = scale B A): the logits stay PEFT's, and when the fold goes every weight is back bit
// for bit with its adapter attached as before. A LoRA too small to pay for a product and a 16-bit
// base stay apart; `loom generate` chooses alike and folds for good, keeping no copy.
TEST(FoldedAdapters, GiveThePeftLogitsAndPutEveryWeightBack) {
  const fs::path dir = fixture("llama");
  const test::ParityInputs in = test::read_parity_inputs(dir);
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits_adapter.safetensors").tensor("logits");
  auto executor = load_fixture_model(dir);
  auto& model = executor->model();
  lora_plugin()->load(model, dir / "adapter");  // r = 8 on every projection of a 64-wide model
  at::NoGradGuard no_grad;
  model.set_training(false);
  std::vector<std::pair<std::string, at::Tensor>> before;
  for (const auto& p : model.parameters()) before.emplace_back(p.name, p.tensor.clone());
  std::vector<std::pair<AdaptableLinear*, LinearAdapter*>> adapted;
  for (const auto& l : model.linears())
    if (l.layer && l.layer->adapter()) adapted.emplace_back(l.layer, l.layer->adapter().get());
  ASSERT_EQ(adapted.size(), 14u);
  const auto names_of = [](AdaptableLinear& layer) {
    std::vector<std::string> names;
    for (const auto& p : layer.named_parameters()) names.push_back(p.key());
    return names;
  };
  const auto names_before = names_of(*adapted.front().first);
  {
    const core::FoldedAdapters folded(model, core::FoldFor::kWhileEvaluating);
    EXPECT_EQ(folded.layers(), adapted.size());
    EXPECT_GT(folded.copied_bytes(), 0u);
    for (const auto& [layer, adapter] : adapted) EXPECT_EQ(layer->adapter(), nullptr);
    EXPECT_LE(test::max_real_error(executor->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
    model.set_training(true);  // as the evaluator does before its fold goes: the adapters follow (dropout)
  }
  for (const auto& [layer, adapter] : adapted) {
    EXPECT_EQ(layer->adapter().get(), adapter);
    EXPECT_TRUE(adapter->is_training());
  }
  model.set_training(false);
  EXPECT_EQ(names_of(*adapted.front().first), names_before);
  const auto after = model.parameters();
  ASSERT_EQ(after.size(), before.size());
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i].tensor, before[i].second)) << after[i].name;
  EXPECT_LE(test::max_real_error(executor->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);

  {  // another rank of a tensor group keeps the first layer apart: so does this one
    std::size_t asked = 0;
    const core::FoldedAdapters folded(model, core::FoldFor::kWhileEvaluating, [&](std::vector<double> fold) {
      asked = fold.size();
      fold[0] = 0;
      return fold;
    });
    EXPECT_EQ(asked, model.linears().size());
    EXPECT_EQ(folded.layers(), adapted.size() - 1);
    EXPECT_EQ(model.linears().front().layer->adapter().get(), adapted.front().second);
    EXPECT_LE(test::max_real_error(executor->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
  }
  {  // r = 1: the LoRA's products are a 32nd of q_proj's at most; nothing folds
    auto small = load_fixture_model(dir);
    test::make_plugin<Adapter>("adapter", "lora", {{"r", std::int64_t{1}}, {"target_modules", StringList{"q_proj", "k_proj", "up_proj"}}})
        ->attach(small->model(), 1);
    EXPECT_EQ(core::FoldedAdapters(small->model(), core::FoldFor::kWhileEvaluating).layers(), 0u);
    EXPECT_EQ(core::FoldedAdapters(small->model(), core::FoldFor::kGood).layers(), 0u);  // generate chooses alike
  }
  {  // a bfloat16 base would round D to 8 bits: the adapters stay apart
    auto plugin = test::make_plugin<Model>("model", test::model_plugin_of(dir), {{"path", dir.string()}});
    Plan plan;
    for (const auto& b : plugin->structure().blocks) plan.blocks.push_back({b.name, "cpu"});
    auto bf16 = load_executor(*plugin, plan, DType::kBFloat16, 0);
    lora_plugin()->load(bf16->model(), dir / "adapter");
    EXPECT_EQ(core::FoldedAdapters(bf16->model(), core::FoldFor::kGood).layers(), 0u);
  }
  {  // for good: every layer, no copy, the adapters stay off
    const core::FoldedAdapters folded(model, core::FoldFor::kGood);
    EXPECT_EQ(folded.layers(), adapted.size());
    EXPECT_EQ(folded.copied_bytes(), 0u);
  }
  for (const auto& [layer, adapter] : adapted) EXPECT_EQ(layer->adapter(), nullptr);
  EXPECT_LE(test::max_real_error(executor->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
}

// A checkpoint split into shards with an index loads to the same logits.
TEST(ParityShards, ShardedCheckpointLoads) {
  const fs::path dir = fixture("qwen2");
  const fs::path sharded = test::temp_dir() / "sharded";
  const kit::SafetensorsFile whole(dir / "model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> first, second;
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
  for (std::size_t i = 0; i < whole.tensors().size(); ++i) {
    const auto& name = whole.tensors()[i].name;
    (i % 2 ? second : first).emplace_back(name, whole.tensor(name));
    index["weight_map"][name] = i % 2 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  fs::create_directories(sharded);
  kit::write_safetensors(sharded / "model-00001-of-00002.safetensors", first);
  kit::write_safetensors(sharded / "model-00002-of-00002.safetensors", second);
  test::write_file(sharded / "model.safetensors.index.json", index.dump());
  test::write_file(sharded / "config.json", test::read_file(dir / "config.json"));
  const test::ParityInputs in = test::read_parity_inputs(dir);
  at::NoGradGuard no_grad;
  const at::Tensor logits = load_fixture_model(sharded)->forward(in.ids, in.positions, in.mask);
  EXPECT_LE(test::max_real_error(logits, kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits"), in.mask), 1e-4);
  // A shard that goes missing is named in the error.
  fs::remove(sharded / "model-00002-of-00002.safetensors");
  try {
    load_fixture_model(sharded);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model-00002-of-00002.safetensors: cannot open"), std::string::npos) << e.what();
  }
}

// Greedy generation through loom's cache made once (a prompt pass, then one token a step) gives
// transformers' tokens for the windowed models (Gemma 3's too): 12 prompt positions and 10 new ones
// wrap a sliding layer's ring of 4 or 5 slots several times, and the ring holds only the window.
class ParityGreedy : public ::testing::TestWithParam<std::string> {};

TEST_P(ParityGreedy, TokensThroughTheCacheMatchTransformers) {
  const fs::path dir = fixture(GetParam());
  const test::ParityInputs in = test::read_parity_inputs(dir);
  const auto expected = nlohmann::json::parse(test::read_file(dir / "greedy.json"))["new_tokens"];
  const auto config = nlohmann::json::parse(test::read_file(dir / "config.json"));
  auto executor = load_fixture_model(dir);
  at::NoGradGuard no_grad;
  const std::int64_t rows = in.ids.size(0), prompt = in.ids.size(1), steps = static_cast<std::int64_t>(expected[0].size());
  StaticKVCache cache;
  cache.rows = rows;
  cache.capacity = prompt + steps;
  CachedPass first{&cache, at::Tensor(), at::arange(prompt, at::kLong).view({1, prompt}).expand({rows, prompt}), true};
  at::Tensor next = executor->forward(in.ids, in.positions, in.mask, &first).select(1, prompt - 1).argmax(-1);
  at::Tensor seen = at::constant_pad_nd(in.mask, {0, steps});
  at::Tensor position = in.positions.select(1, prompt - 1) + 1;
  std::vector<std::vector<std::int64_t>> tokens(static_cast<std::size_t>(rows));
  for (std::int64_t step = 0; step < steps; ++step) {
    for (std::int64_t r = 0; r < rows; ++r) tokens[static_cast<std::size_t>(r)].push_back(next[r].item<std::int64_t>());
    if (step + 1 == steps) break;
    seen.select(1, prompt + step).fill_(1);
    CachedPass pass{&cache, at::Tensor(), at::full({rows, 1}, prompt + step, at::kLong), false};
    next = executor->forward(next.view({rows, 1}), position.view({rows, 1}), seen, &pass).select(1, 0).argmax(-1);
    position = position + 1;
  }
  for (std::int64_t r = 0; r < rows; ++r)
    EXPECT_EQ(nlohmann::json(tokens[static_cast<std::size_t>(r)]), expected[static_cast<std::size_t>(r)]) << "row " << r;
  // Mistral's folders may leave layer_types out: every layer slides. Without a window (the mixtures
  // of experts) every layer keeps every position.
  const std::int64_t window = config.value("sliding_window", nlohmann::json()).is_number() ? config["sliding_window"].get<std::int64_t>() : 0;
  const std::int64_t layers = config["num_hidden_layers"].get<std::int64_t>();
  const auto kinds = config.contains("layer_types") ? config["layer_types"]
                                                    : nlohmann::json(std::vector<std::string>(layers, window > 0 ? "sliding_attention" : "full_attention"));
  ASSERT_LT(window, cache.capacity);
  ASSERT_EQ(cache.keys.size(), kinds.size());
  for (std::size_t l = 0; l < cache.keys.size(); ++l)
    EXPECT_EQ(cache.keys[l].size(2), kinds[l] == "sliding_attention" ? window : cache.capacity) << "layer " << l;
  // DeepSeek-V3's cache holds each token's latent and rotary key (kv_lora_rank + qk_rope_head_dim
  // values), not every head's keys and values, and the plan counts that.
  if (!config.contains("kv_lora_rank")) return;
  const std::int64_t latent = config["kv_lora_rank"].get<std::int64_t>() + config["qk_rope_head_dim"].get<std::int64_t>();
  for (std::size_t l = 0; l < cache.keys.size(); ++l) {
    EXPECT_EQ(cache.keys[l].sizes(), (std::vector<std::int64_t>{rows, 1, cache.capacity, latent})) << "layer " << l;
    EXPECT_FALSE(cache.values[l].defined()) << "layer " << l;
  }
  auto model = test::make_plugin<Model>("model", test::model_plugin_of(dir), {{"path", dir.string()}});
  const auto* sizing = capability<StaticCacheSizing>(*model);
  ASSERT_NE(sizing, nullptr);
  EXPECT_EQ(sizing->cache_values_per_position(1, 1), static_cast<std::uint64_t>(latent));
  EXPECT_EQ(sizing->cache_values_per_position(1, 2), static_cast<std::uint64_t>(latent));
}

// A new family saves the folder transformers wrote: every tensor under its name and shape with its
// values (StableLM's per-head norms one tensor a head, Cohere's and StarCoder 2's tied heads left
// out), and the saved folder gives the same logits; the plan counts each value of the folder once.
// GPT-NeoX's own config keys are written in both spellings of its rotary.
class FamilyBlocks : public ::testing::TestWithParam<std::string> {};
TEST_P(FamilyBlocks, SaveTheFolderTransformersWrote) {
  const fs::path dir = fixture(GetParam()), out = test::temp_dir() / "saved";
  const test::ParityInputs in = test::read_parity_inputs(dir);
  auto executor = load_fixture_model(dir);
  executor->model().save_pretrained(out);
  const std::uint64_t values = test::expect_same_checkpoint(out, dir);
  ASSERT_FALSE(HasFailure());
  const auto config = nlohmann::json::parse(test::read_file(out / "config.json")), theirs_config = nlohmann::json::parse(test::read_file(dir / "config.json"));
  EXPECT_EQ(config["architectures"], theirs_config["architectures"]);
  if (GetParam() == "families/gpt_neox") {
    EXPECT_EQ(config["use_parallel_residual"], true);
    EXPECT_EQ(config["rotary_pct"], 0.25);
    EXPECT_EQ(config["partial_rotary_factor"], 0.25);
    EXPECT_EQ(config["layer_norm_eps"], 1e-5);
  }
  at::NoGradGuard no_grad;
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
  EXPECT_LE(test::max_real_error(load_fixture_model(out)->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
  auto model = test::make_plugin<Model>("model", test::model_plugin_of(dir), {{"path", dir.string()}});
  std::uint64_t planned = 0;
  std::set<std::string> groups;  // tied blocks count once
  for (const auto& block : model->structure().blocks)
    if (block.tied_group.empty() || groups.insert(block.tied_group).second) planned += block.parameters;
  EXPECT_EQ(planned, values);
}
INSTANTIATE_TEST_SUITE_P(Families, FamilyBlocks,
                         ::testing::Values("families/gpt_neox", "families/starcoder2", "families/granite", "families/cohere", "families/gemma2",
                                           "families/stablelm", "families/deepseek_v3", "families/gpt_oss"),
                         [](const auto& info) { return test_name(info.param); });

// transformers 4's spellings (rotary_pct, rotary_emb_base; no rope_parameters) and an older
// folder's causal-mask buffers (attention.bias, attention.masked_bias) read as 5's folder.
TEST(FamilyConfigs, GptNeoxReadsTransformers4Folders) {
  const fs::path dir = fixture("families/gpt_neox"), old = test::temp_dir() / "v4";
  fs::create_directories(old);
  auto config = nlohmann::json::parse(test::read_file(dir / "config.json"));
  config.erase("rope_parameters");
  config["rotary_pct"] = 0.25;
  config["rotary_emb_base"] = 10000;
  config["transformers_version"] = "4.46.0";
  test::write_file(old / "config.json", config.dump(2));
  const kit::SafetensorsFile file(dir / "model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& info : file.tensors()) tensors.emplace_back(info.name, file.tensor(info.name));
  for (int layer = 0; layer < 2; ++layer) {
    const std::string prefix = "gpt_neox.layers." + std::to_string(layer) + ".attention.";
    tensors.emplace_back(prefix + "bias", at::ones({1, 1, 128, 128}, at::kBool).tril());
    tensors.emplace_back(prefix + "masked_bias", at::scalar_tensor(-1e9));
  }
  kit::write_safetensors(old / "model.safetensors", tensors, {});
  const test::ParityInputs in = test::read_parity_inputs(dir);
  at::NoGradGuard no_grad;
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
  EXPECT_LE(test::max_real_error(load_fixture_model(old)->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
}

// Training with a frozen head, the families whose logits are scaled (Granite's logits_scaling,
// Cohere's logit_scale) or soft-capped (Gemma 2) leave the head's product to the loss as the others
// do (never whole logits), and the loss is transformers' logits' loss: the multiplier and the cap
// applied a slice of rows at a time. Positions a padding token predicts from are left out (their
// logits differ by design, max_real_error).
TEST(FamilyConfigs, ScaledAndSoftCappedHeadsTakeTheLossFromTheHeadsInput) {
  for (const std::string family : {"families/granite", "families/cohere", "families/gemma2"}) {
    SCOPED_TRACE(family);
    const fs::path dir = fixture(family);
    const test::ParityInputs in = test::read_parity_inputs(dir);
    auto executor = load_fixture_model(dir);
    for (auto& p : executor->model().parameters())
      p.tensor.set_requires_grad(p.name.find("embed") == std::string::npos && p.name.find("lm_head") == std::string::npos);
    const at::Tensor out = executor->head_output(in.ids, in.positions, in.mask);
    const auto config = nlohmann::json::parse(test::read_file(dir / "config.json"));
    ASSERT_EQ(out.size(2), config["hidden_size"].get<std::int64_t>()) << "the head made its logits whole";
    const at::Tensor first_real = at::cat({in.mask.narrow(1, 1, in.mask.size(1) - 1) - in.mask.narrow(1, 0, in.mask.size(1) - 1) > 0,
                                           at::zeros({in.mask.size(0), 1}, at::kBool)}, 1).roll(1, 1);
    const at::Tensor labels = in.ids.masked_fill(in.mask == 0, -100).masked_fill(first_real, -100);
    const at::Tensor loss = executor->loss_sum(out, labels);
    const at::Tensor theirs = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
    const double want = kit::next_token_loss_sum(theirs, labels).item<double>();
    EXPECT_NEAR(loss.item<double>(), want, 1e-5 * want);
    loss.backward();  // the gradient reaches the layers through the cap
    std::size_t with_gradient = 0;
    for (const auto& p : executor->model().parameters()) with_gradient += p.tensor.grad().defined() ? 1 : 0;
    EXPECT_GT(with_gradient, 4u);
  }
}

// gpt-oss reads swiglu_limit where config.json has it (5.17's class hard-codes 7, as the fixture
// ran): a lower one moves the logits, one not above 0 is one error naming the key.
TEST(FamilyConfigs, GptOssReadsItsSwigluLimit) {
  const fs::path dir = fixture("families/gpt_oss");
  const auto with_limit = [&](const nlohmann::json& limit) {
    const fs::path copy = test::temp_dir() / "limit";
    fs::create_directories(copy);
    fs::copy_file(dir / "model.safetensors", copy / "model.safetensors", fs::copy_options::overwrite_existing);
    auto config = nlohmann::json::parse(test::read_file(dir / "config.json"));
    config["swiglu_limit"] = limit;
    test::write_file(copy / "config.json", config.dump());
    return copy;
  };
  const test::ParityInputs in = test::read_parity_inputs(dir);
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
  at::NoGradGuard no_grad;
  EXPECT_LE(test::max_real_error(load_fixture_model(with_limit(7.0))->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
  EXPECT_GT(test::max_real_error(load_fixture_model(with_limit(0.5))->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-3);
  try {
    load_fixture_model(with_limit(0));
    ADD_FAILURE() << "swiglu_limit 0 was accepted";
  } catch (const UserError& e) {
    EXPECT_TRUE(test::contains(e.what(), "config.json: swiglu_limit: is not above 0")) << e.what();
  }
}

// PEFT 0.21 writes rank_pattern and alpha_pattern. DeepSeek-V3's fixture adapter gives the experts'
// gate_up_proj rank 16 beside 8 (".*\\.gate_up_proj"): one error naming the key and the parameter,
// as loom gives every module one rank. A key naming no module the adapter adapts passes: the
// expert adapter with such a key gives PEFT's logits.
TEST(FamilyConfigs, RankPatternsNamingAnAdaptedModuleAreRefused) {
  const fs::path dir = fixture("families/deepseek_v3");
  auto executor = load_fixture_model(dir);
  try {
    lora_plugin()->load(executor->model(), dir / "adapter");
    ADD_FAILURE() << "a rank_pattern naming an adapted parameter was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("rank_pattern \".*\\.gate_up_proj\" gives model.layers.1.mlp.experts.gate_up_proj its own rank or alpha"),
              std::string::npos)
        << e.what();
  }
  const fs::path adapter = test::temp_dir() / "adapter";
  fs::create_directories(adapter);
  fs::copy_file(dir / "adapter-experts/adapter_model.safetensors", adapter / "adapter_model.safetensors");
  auto config = nlohmann::json::parse(test::read_file(dir / "adapter-experts/adapter_config.json"));
  config["rank_pattern"] = {{"lm_head", 4}};
  test::write_file(adapter / "adapter_config.json", config.dump());
  expect_adapter_parity(dir, adapter.string(), "logits_adapter_experts.safetensors");
}

INSTANTIATE_TEST_SUITE_P(Models, Parity, ::testing::Values("llama", "llama3-rope", "llama-yarn", "qwen2", "qwen3", "mistral-window", "qwen2-window", "gemma3", "olmo2", "phi3",
                                                           "mixtral", "qwen3_moe"),
                         [](const auto& info) { return test_name(info.param); });
INSTANTIATE_TEST_SUITE_P(Windowed, ParityGreedy, ::testing::Values("mistral-window", "qwen2-window", "gemma3", "phi3", "mixtral", "qwen3_moe"),
                         [](const auto& info) { return test_name(info.param); });
// The families written as blocks (DecoderFamily::block): logits, the unpadded row, PEFT's adapter
// and greedy tokens through loom's cache (12 new ones each row) against transformers 5.17.
const auto kFamilies = ::testing::Values("families/gpt_neox", "families/starcoder2", "families/granite", "families/cohere", "families/gemma2", "families/olmoe",
                                      "families/qwen2_moe", "families/stablelm", "families/deepseek_v3", "families/gpt_oss");
INSTANTIATE_TEST_SUITE_P(Families, Parity, kFamilies, [](const auto& info) { return test_name(info.param); });
INSTANTIATE_TEST_SUITE_P(Families, ParityGreedy, kFamilies, [](const auto& info) { return test_name(info.param); });

}  // namespace
}  // namespace loom::core
