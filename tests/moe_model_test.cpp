// The mixture-of-experts families (mixtral, qwen3_moe) as whole models against transformers 5.17
// (tests/parity/make_fixtures.py; the logits and the attention adapter: parity_test.cpp's Parity
// suite): the training loss with the routers' load-balancing term, the folder saved back as
// transformers wrote it, and damaged expert tensors refused with one clear error.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "config/session.hpp"
#include "loom/adapter.hpp"
#include "loom/error.hpp"
#include "loom/kit/loss.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/safetensors.hpp"
#include "plugins/plugin_guard.hpp"
#include "runtime/executor.hpp"
#include "test_support.hpp"

namespace loom::core {
namespace {
namespace fs = std::filesystem;

fs::path fixture(const std::string& name) { return test::parity_fixture(name); }

std::unique_ptr<Executor> load(const fs::path& dir, std::map<std::string, OptionValue> options = {}) {
  options["path"] = dir.string();
  auto model = test::make_plugin<Model>("model", test::model_plugin_of(dir), options);
  Plan plan;
  for (const auto& b : model->structure().blocks) plan.blocks.push_back({b.name, "cpu"});
  return load_executor(*model, plan, DType::kFloat32, 0);
}

class MoeFamily : public ::testing::TestWithParam<std::string> {};

// transformers' loss with output_router_logits: the mean cross-entropy plus router_aux_loss_coef x
// load_balancing_loss_func over every sparse layer's router (padding masked). The term comes from
// the pass (AuxiliaryLoss) as the trainer takes it, and it has a gradient.
TEST_P(MoeFamily, LossWithTheRoutersTermEqualsTransformers) {
  const fs::path dir = fixture(GetParam());
  const auto want = nlohmann::json::parse(test::read_file(dir / "aux.json"));
  const test::ParityInputs in = test::read_parity_inputs(dir);
  auto executor = load(dir, {{"output_router_logits", true}});
  auto* aux = capability<AuxiliaryLoss>(executor->model());
  ASSERT_NE(aux, nullptr);
  EXPECT_EQ(aux->auxiliary_loss_name(), "aux_loss");
  EXPECT_DOUBLE_EQ(aux->auxiliary_loss_weight(), want["router_aux_loss_coef"].get<double>());
  ForwardState state{in.ids, in.positions, in.mask, nullptr, {}};
  executor->run_blocks(0, executor->model().block_count() - 1, state);
  // transformers' cross-entropy, from its own logits, is the fixture's; loom's against it leaves out
  // what a padding position predicts (the first real token of a left-padded row), whose logits
  // differ by design (max_real_error).
  const at::Tensor labels = in.ids.masked_fill(in.mask == 0, -100);
  const at::Tensor theirs = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
  const auto mean_loss = [](const at::Tensor& sum, const at::Tensor& l) { return sum.item<double>() / (l.narrow(1, 1, l.size(1) - 1) != -100).sum().item<double>(); };
  EXPECT_NEAR(mean_loss(kit::next_token_loss_sum(theirs, labels), labels), want["ce_loss"].get<double>(), 1e-5 * want["ce_loss"].get<double>());
  const at::Tensor first_real = at::cat({in.mask.narrow(1, 1, in.mask.size(1) - 1) - in.mask.narrow(1, 0, in.mask.size(1) - 1) > 0,
                                         at::zeros({in.mask.size(0), 1}, at::kBool)}, 1).roll(1, 1);
  const at::Tensor real_labels = labels.masked_fill(first_real, -100);
  ASSERT_GT(first_real.sum().item<int>(), 0);
  const double ce = mean_loss(executor->loss_sum(state.hidden, real_labels), real_labels);
  EXPECT_NEAR(ce, mean_loss(kit::next_token_loss_sum(theirs, real_labels), real_labels), 1e-5 * ce);
  const at::Tensor term = aux->auxiliary_loss(state);
  ASSERT_TRUE(term.defined());
  ASSERT_TRUE(term.requires_grad()) << "the load-balancing term has no gradient";
  EXPECT_NEAR(term.item<double>(), want["aux_loss"].get<double>(), 1e-5 * want["aux_loss"].get<double>());
  EXPECT_NEAR(want["ce_loss"].get<double>() + aux->auxiliary_loss_weight() * want["aux_loss"].get<double>(), want["loss"].get<double>(), 1e-6);

  // Without output_router_logits (the folders' own setting) the model adds no term.
  auto plain = load(dir);
  EXPECT_EQ(capability<AuxiliaryLoss>(plain->model())->auxiliary_loss_name(), "");
}

// save_pretrained writes what transformers 5.17 wrote: every tensor under its name on disk (one per
// expert's linear, the router under the family's name), the same values, a config.json that loads
// back to the same logits.
TEST_P(MoeFamily, SavedFolderIsTheCheckpointAsPublished) {
  const fs::path dir = fixture(GetParam()), out = test::temp_dir() / "saved";
  const test::ParityInputs in = test::read_parity_inputs(dir);
  auto executor = load(dir);
  executor->model().save_pretrained(out);
  test::expect_same_checkpoint(out, dir);
  ASSERT_FALSE(HasFailure());
  const auto config = nlohmann::json::parse(test::read_file(out / "config.json")), original = nlohmann::json::parse(test::read_file(dir / "config.json"));
  for (const char* key : {"num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits", "intermediate_size",
                          "model_type"})
    if (original.contains(key)) EXPECT_EQ(config.value(key, nlohmann::json()), original[key]) << key;
  at::NoGradGuard no_grad;
  const at::Tensor expected = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
  EXPECT_LE(test::max_real_error(load(out)->forward(in.ids, in.positions, in.mask), expected, in.mask), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Families, MoeFamily, ::testing::Values("mixtral", "qwen3_moe", "families/olmoe", "families/qwen2_moe", "families/gpt_oss"),
                         [](const auto& info) { return test::fixture_test_name(info.param); });

// gpt-oss's released checkpoints hold the experts in MXFP4 (each stacked weight's "_blocks"
// [E, out, in / 32, 16] and "_scales" [E, out, in / 32], config.json's quantization_config naming
// mxfp4): they load as their values (kit::dequantize_mxfp4, held to the OCP table in
// quantize_test.cpp) saved as transformers saves the dequantized model, [E, in, out]; the folder
// loom saves from them is that folder, without the quantization; half a pair is one error.
TEST(GptOss, Mxfp4ExpertsLoadAsTheirValues) {
  const fs::path dir = fixture("families/gpt_oss"), packed = test::temp_dir() / "mxfp4", plain = test::temp_dir() / "plain";
  fs::create_directories(packed);
  fs::create_directories(plain);
  // Experts of 32 units (the fixture's 24 are no whole MXFP4 group), drawn here; the rest the fixture's.
  const std::int64_t units = 32;
  auto config = nlohmann::json::parse(test::read_file(dir / "config.json"));
  config["intermediate_size"] = units;
  test::write_file(plain / "config.json", config.dump(2));
  config["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"model.layers.*.self_attn", "model.layers.*.mlp.router"}}};
  test::write_file(packed / "config.json", config.dump(2));
  const kit::SafetensorsFile file(dir / "model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> as_mxfp4, as_values;
  at::manual_seed(3);
  const auto ends = [](const std::string& name, const std::string& end) { return name.size() > end.size() && name.compare(name.size() - end.size(), end.size(), end) == 0; };
  for (const auto& info : file.tensors()) {
    at::Tensor t = file.tensor(info.name);
    const std::int64_t experts = t.size(0), hidden = config["hidden_size"].get<std::int64_t>();
    if (ends(info.name, ".gate_up_proj_bias")) t = at::randn({experts, 2 * units}) * 0.1;
    const bool gate_up = ends(info.name, ".gate_up_proj");
    if (!gate_up && !ends(info.name, ".down_proj")) {
      as_mxfp4.emplace_back(info.name, t);
      as_values.emplace_back(info.name, t);
      continue;
    }
    // [E, out, in] as the blocks hold it: gate_up's 2I rows of H, down's H rows of I.
    const std::int64_t out = gate_up ? 2 * units : hidden, in = gate_up ? hidden : units;
    const at::Tensor blocks = at::randint(0, 256, {experts, out, in / 32, 16}, at::kByte);
    const at::Tensor scales = at::randint(121, 125, {experts, out, in / 32}, at::kByte);
    as_mxfp4.emplace_back(info.name + "_blocks", blocks);
    as_mxfp4.emplace_back(info.name + "_scales", scales);
    as_values.emplace_back(info.name, kit::dequantize_mxfp4(blocks, scales, at::kFloat).transpose(1, 2).contiguous());  // saved [E, in, out]
  }
  kit::write_safetensors(packed / "model.safetensors", as_mxfp4, {});
  kit::write_safetensors(plain / "model.safetensors", as_values, {});
  const test::ParityInputs in = test::read_parity_inputs(dir);
  auto executor = load(packed);
  {
    at::NoGradGuard no_grad;
    const at::Tensor got = executor->forward(in.ids, in.positions, in.mask), want = load(plain)->forward(in.ids, in.positions, in.mask);
    EXPECT_TRUE(at::equal(got, want));
    const at::Tensor fixture_logits = kit::SafetensorsFile(dir / "logits.safetensors").tensor("logits");
    EXPECT_GT(test::max_real_error(got, fixture_logits, in.mask), 1e-2) << "the experts' values should move the logits";
  }
  const fs::path saved = test::temp_dir() / "saved";
  executor->model().save_pretrained(saved);
  test::expect_same_checkpoint(saved, plain);
  EXPECT_FALSE(nlohmann::json::parse(test::read_file(saved / "config.json")).contains("quantization_config"));
  // Blocks without their scales.
  as_mxfp4.erase(std::remove_if(as_mxfp4.begin(), as_mxfp4.end(), [](const auto& p) { return p.first == "model.layers.1.mlp.experts.down_proj_scales"; }),
                 as_mxfp4.end());
  kit::write_safetensors(packed / "model.safetensors", as_mxfp4, {});
  try {
    load(packed);
    ADD_FAILURE() << "MXFP4 blocks without their scales loaded";
  } catch (const UserError& e) {
    EXPECT_TRUE(test::contains(e.what(), "holds model.layers.1.mlp.experts.down_proj_blocks without its _scales")) << e.what();
  }
}

// The checkpoint of a Qwen3-MoE with one tensor changed, loaded: the error, or "" where it loads.
std::string load_error(const std::function<void(std::vector<std::pair<std::string, at::Tensor>>&)>& damage) {
  const fs::path dir = fixture("qwen3_moe"), copy = test::temp_dir() / "damaged";
  fs::create_directories(copy);
  fs::copy_file(dir / "config.json", copy / "config.json");
  const kit::SafetensorsFile file(dir / "model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& info : file.tensors()) tensors.emplace_back(info.name, file.tensor(info.name));
  damage(tensors);
  kit::write_safetensors(copy / "model.safetensors", tensors, {});
  try {
    load(copy);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}
void rename(std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& from, const std::string& to) {
  for (auto& [name, t] : tensors)
    if (name == from) name = to;
}

TEST(MoeCheckpoint, DamagedExpertsAreOneClearError) {
  // An expert the config does not have.
  std::string e = load_error([](auto& t) { rename(t, "model.layers.0.mlp.experts.7.up_proj.weight", "model.layers.0.mlp.experts.8.up_proj.weight"); });
  EXPECT_TRUE(test::contains(e, "'model.layers.0.mlp.experts.8.up_proj.weight' is expert 8's; the config has 8 (num_experts)")) << e;
  // One expert's linear missing: the stacked tensor it belongs to is named.
  e = load_error([](auto& t) {
    t.erase(std::remove_if(t.begin(), t.end(), [](const auto& p) { return p.first == "model.layers.2.mlp.experts.3.gate_proj.weight"; }), t.end());
  });
  EXPECT_TRUE(test::contains(e, "lacks 1 tensor(s) the config needs: model.layers.2.mlp.experts.gate_up_proj")) << e;
  // An expert's weight in a layer mlp_only_layers keeps dense.
  e = load_error([](auto& t) { t.emplace_back("model.layers.1.mlp.experts.0.down_proj.weight", at::zeros({64, 32})); });
  EXPECT_TRUE(test::contains(e, "is an expert's weight, but layer 1 is dense in this config")) << e;
  // A wrong shape.
  e = load_error([](auto& t) {
    for (auto& [name, tensor] : t)
      if (name == "model.layers.0.mlp.experts.2.down_proj.weight") tensor = at::zeros({32, 64});
  });
  EXPECT_TRUE(test::contains(e, "has shape [32, 64], the config implies [64, 32]")) << e;
  // Stacked experts (transformers 5's names in memory) load as well as per-expert ones.
  e = load_error([](auto& t) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (int layer : {0, 2}) {
      const std::string prefix = "model.layers." + std::to_string(layer) + ".mlp.experts.";
      std::vector<at::Tensor> gate_up, down;
      for (int expert = 0; expert < 8; ++expert) {
        const auto find = [&](const std::string& name) {
          for (const auto& [n, tensor] : t)
            if (n == prefix + std::to_string(expert) + "." + name + ".weight") return tensor;
          return at::Tensor();
        };
        gate_up.push_back(at::cat({find("gate_proj"), find("up_proj")}, 0));
        down.push_back(find("down_proj"));
      }
      out.emplace_back(prefix + "gate_up_proj", at::stack(gate_up));
      out.emplace_back(prefix + "down_proj", at::stack(down));
    }
    for (auto& p : t)
      if (!test::contains(p.first, ".mlp.experts.")) out.push_back(p);
    t = out;
  });
  EXPECT_EQ(e, "");
}

// A config.json whose experts cannot be is one error at its key: more picks than experts, a dense
// layer past the last, the two spellings of the count disagreeing, a missing expert width.
TEST(MoeCheckpoint, BadExpertConfigsAreOneErrorAtTheirKey) {
  const auto original = nlohmann::json::parse(test::read_file(fixture("qwen3_moe") / "config.json"));
  const auto error_of = [&](const std::function<void(nlohmann::json&)>& damage) {
    nlohmann::json config = original;
    damage(config);
    const fs::path dir = test::temp_dir();
    test::write_file(dir / "config.json", config.dump());
    try {
      test::make_plugin<Model>("model", "qwen3_moe", {{"path", dir.string()}});
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::string e = error_of([](auto& c) { c["num_experts_per_tok"] = 9; });
  EXPECT_TRUE(test::contains(e, "num_experts_per_tok = 9 must be between 1 and num_experts (8)")) << e;
  e = error_of([](auto& c) { c["mlp_only_layers"] = {3}; });
  EXPECT_TRUE(test::contains(e, "mlp_only_layers[0]")) << e;
  EXPECT_TRUE(test::contains(e, "is not a layer of the 3 (num_hidden_layers)")) << e;
  e = error_of([](auto& c) { c["num_experts"] = 4; });
  EXPECT_TRUE(test::contains(e, "num_local_experts")) << e;
  EXPECT_TRUE(test::contains(e, "differs from num_experts 4")) << e;
  e = error_of([](auto& c) { c.erase("moe_intermediate_size"); });
  EXPECT_TRUE(test::contains(e, "moe_intermediate_size")) << e;
}

// The planner counts every expert's weights, and a token's routed activations.
TEST(MoeCheckpoint, StructureCountsEveryExpert) {
  auto model = test::make_plugin<Model>("model", "qwen3_moe", {{"path", fixture("qwen3_moe").string()}});
  const ModelStructure s = model->structure();
  std::uint64_t sum = 0;
  for (const auto& b : s.blocks) sum += b.parameters;
  const kit::SafetensorsFile file(fixture("qwen3_moe") / "model.safetensors");
  std::uint64_t stored = 0;
  for (const auto& info : file.tensors()) {
    std::uint64_t n = 1;
    for (const auto d : info.shape) n *= static_cast<std::uint64_t>(d);
    stored += n;
  }
  EXPECT_EQ(sum, stored);
  // Layer 1 is dense (mlp_only_layers): its linears include the MLP's; the sparse ones do not.
  ASSERT_EQ(s.blocks.size(), 6u);
  EXPECT_EQ(s.blocks[2].linears.size(), 7u);
  EXPECT_EQ(s.blocks[1].linears.size(), 4u);
  EXPECT_GT(s.blocks[1].parameters, s.blocks[2].parameters);
}

// The published configs of Qwen3-30B-A3B and Qwen3-235B-A22B (config.json alone: planning reads
// no weight) count every expert: 30,532,122,624 and 235,093,634,560 parameters (Qwen3-MoE's "30.5B" and "235B" in total).
TEST(MoeCheckpoint, PublishedConfigsCountTheirParameters) {
  const auto count = [](int hidden, int intermediate, int expert, int layers, int heads) {
    const fs::path dir = test::temp_dir();
    test::write_file(dir / "config.json",
                     nlohmann::json{{"model_type", "qwen3_moe"}, {"hidden_size", hidden}, {"intermediate_size", intermediate},
                                    {"moe_intermediate_size", expert}, {"num_hidden_layers", layers}, {"num_attention_heads", heads},
                                    {"num_key_value_heads", 4}, {"head_dim", 128}, {"num_experts", 128}, {"num_experts_per_tok", 8},
                                    {"norm_topk_prob", true}, {"decoder_sparse_step", 1}, {"mlp_only_layers", nlohmann::json::array()},
                                    {"vocab_size", 151936}, {"max_position_embeddings", 40960}, {"rope_theta", 1e6}, {"tie_word_embeddings", false}}
                         .dump());
    return test::make_plugin<Model>("model", "qwen3_moe", {{"path", dir.string()}})->structure().total_parameters();
  };
  EXPECT_EQ(count(2048, 6144, 768, 48, 32), 30532122624ull);
  EXPECT_EQ(count(4096, 12288, 1536, 94, 64), 235093634560ull);
}

// The plan counts LoRA on the experts (target_parameters: E r (in + out) a stacked weight) beside
// LoRA on linears, block by block, as many as attach() then makes.
TEST(MoeCheckpoint, PlanCountsTheExpertsAdapterAsAttachMakesIt) {
  const fs::path dir = fixture("qwen3_moe");
  auto model = test::make_plugin<Model>("model", "qwen3_moe", {{"path", dir.string()}});
  auto lora = test::make_plugin<Adapter>("adapter", "lora",
                                         {{"r", std::int64_t{4}}, {"target_modules", StringList{"q_proj"}}, {"target_parameters", StringList{"mlp.experts.down_proj"}}});
  const auto counts = adapter_trainable(*model, *lora, model->structure());
  ASSERT_EQ(counts.size(), 6u);
  EXPECT_EQ(counts[1], 4u * (64 + 96) + 4u * 8 * (32 + 64));  // layer 0: q_proj, and every expert's down_proj
  EXPECT_EQ(counts[2], 4u * (64 + 96));                        // layer 1 is dense
  auto executor = load(dir);
  std::vector<std::uint64_t> made(counts.size(), 0);
  for (const auto& p : lora->attach(executor->model(), 0)) made[p.block] += static_cast<std::uint64_t>(p.tensor.numel());
  EXPECT_EQ(made, counts);
  // The experts alone, by their bare names (PEFT takes them so): planned, attached and saved with no
  // linear among target_modules.
  auto bare = test::make_plugin<Adapter>("adapter", "lora", {{"target_modules", StringList{}}, {"target_parameters", StringList{"gate_up_proj", "down_proj"}}});
  EXPECT_EQ(adapter_trainable(*model, *bare, model->structure())[1], 8u * 8 * (64 + 64) + 8u * 8 * (32 + 64));
  auto plain = load(dir);
  bare->attach(plain->model(), 0);
  const fs::path saved = test::temp_dir() / "bare";
  bare->save(plain->model(), saved);
  const auto config = nlohmann::json::parse(test::read_file(saved / "adapter_config.json"));
  EXPECT_EQ(config["target_modules"], nlohmann::json::array());
  EXPECT_EQ(config["target_parameters"], nlohmann::json({"gate_up_proj", "down_proj"}));
  auto wrong = test::make_plugin<Adapter>("adapter", "lora", {{"target_parameters", StringList{"mlp.experts.w9"}}});
  try {
    adapter_trainable(*model, *wrong, model->structure());
    ADD_FAILURE() << "a target_parameters entry naming no experts weight was taken";
  } catch (const UserError& e) {
    EXPECT_TRUE(test::contains(e.what(), "names no stacked experts weight of this model")) << e.what();
  }
}

}  // namespace
}  // namespace loom::core
