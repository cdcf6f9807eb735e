#include <gtest/gtest.h>

#include "runtime/executor.hpp"
#include "loom/adapter.hpp"
#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/placement.hpp"
#include "runtime/optimizer.hpp"
#include "plugins/plugin_registry.hpp"
#include "planner/planner.hpp"
#include "test_support.hpp"

namespace loom::core {
namespace {

ModelStructure toy_model(bool tied) {
  ModelStructure m;
  m.architecture = "toy";
  m.vocab_size = 10;
  const std::string group = tied ? "embed_tokens" : "";
  m.blocks = {{"embed", BlockKind::kEmbedding, 100, 0, 5, 0, group, {}},
              {"layers.0", BlockKind::kDecoderLayer, 1000, 20, 7, 2000, "", {}},
              {"head", BlockKind::kHead, 100, 3, 50, 200, group, {}}};
  return m;
}

PlacementRequest toy_request(bool tied, DType dtype) {
  PlacementRequest r;
  r.model = toy_model(tied);
  r.dtype = dtype;
  r.batch_size = 2;
  r.seq_len = 8;
  r.ranks = {parse_inventory("cpu=1GiB,cuda:0=1MiB")};
  return r;
}

TEST(BlockMemory, CountsWeightsStateActivationsWorking) {
  const auto r = toy_request(false, DType::kBFloat16);
  const auto m = kit::block_memory(r, 1);
  EXPECT_EQ(m.weights, 2000u);                  // 1000 params x 2 bytes
  EXPECT_EQ(m.trainable_state, 1000u * (2 + 8 + 4));  // full fine-tune: bf16 gradient, two fp32 moments, fp32 master copy
  EXPECT_EQ(m.activations, 20u * 16 * 2);             // 20 values/token x 16 tokens x 2 bytes
  EXPECT_EQ(m.working, 1000u * (4 + 4));              // the optimizer's step: fp32 gradients and denominators
  auto with_adapter = r;
  with_adapter.adapter_trainable = {0, 40, 0};
  EXPECT_EQ(kit::block_memory(with_adapter, 1).trainable_state, 40u * (2 + 2 + 8 + 4));  // weight, gradient, moments, master copy
  EXPECT_EQ(kit::block_memory(with_adapter, 1).working, 40u * (4 + 4));                  // the step over its 40 values: more than the layer's 7 x 16 x 2
  EXPECT_EQ(kit::block_memory(with_adapter, 0).trainable_state, 0u);
  // fp32 values need no master copy, and their gradients no fp32 copy in the step.
  const auto full32 = kit::block_memory(toy_request(false, DType::kFloat32), 1);
  EXPECT_EQ(full32.trainable_state, 1000u * (4 + 8));
  EXPECT_EQ(full32.working, 1000u * 4);
}

// What the planner counts as optimizer state is what loom's optimizers allocate: moments and master
// copies to the byte for AdamW, Lion and SGD, and 8-bit AdamW's codes and block maxima for a LoRA
// whose matrices are all quantized; within 1% for its full fine-tune (norm weights keep float32
// moments); an upper bound for Adafactor's factored statistics. For bf16 and fp32 values, LoRA
// and a full fine-tune of a small Llama.
TEST(BlockMemory, OptimizerStateIsWhatTheOptimizerHolds) {
  const auto model = test::make_plugin<Model>("model", "llama",
                                              {{"init", std::string("random")}, {"hidden_size", std::int64_t{128}}, {"intermediate_size", std::int64_t{256}},
                                               {"num_hidden_layers", std::int64_t{2}}, {"num_attention_heads", std::int64_t{4}},
                                               {"num_key_value_heads", std::int64_t{2}}, {"vocab_size", std::int64_t{259}}});
  Plan plan;
  for (const auto& b : model->structure().blocks) plan.blocks.push_back({b.name, "cpu"});
  for (const char* name : {"adamw", "adamw_8bit", "lion", "adafactor", "sgd"})
    for (const DType dtype : {DType::kBFloat16, DType::kFloat32})
      for (const bool lora : {false, true}) {
        SCOPED_TRACE(std::string(name) + ", " + dtype_name(dtype) + (lora ? ", LoRA" : ", full"));
        core::OptimizerSettings settings;
        settings.kind = core::parse_optimizer(name);
        kit::count_optimizer_as(core::optimizer_memory(settings));
        auto executor = load_executor(*model, plan, dtype, 1, false, 0, nullptr);
        std::vector<NamedParameter> trainable = executor->model().parameters();
        // Rank 64: every LoRA matrix has 4096 values or more, so 8-bit AdamW quantizes them all.
        auto adapter = test::make_plugin<Adapter>("adapter", "lora", {{"target_modules", std::string("all-linear")}, {"r", std::int64_t{64}}});
        if (lora) trainable = adapter->attach(executor->model(), 1);
        core::Optimizer optimizer(trainable, settings);
        PlacementRequest r;
        r.model = model->structure();
        r.dtype = dtype;
        if (lora) r.adapter_trainable = adapter->trainable_parameters(r.model);
        const std::uint64_t counted = kit::device_usage(r, plan.blocks).front().trainable_state;
        std::uint64_t values = 0;
        for (const auto& p : trainable) values += static_cast<std::uint64_t>(p.tensor.numel());
        // trainable_state = the trainable values' gradients (and an adapter's weights) + the optimizer's state.
        const std::uint64_t bytes = dtype_bytes(dtype), grads = values * bytes * (lora ? 2 : 1);
        const auto held = static_cast<double>(optimizer.state_bytes()), state = static_cast<double>(counted - grads);
        const std::string kind = name;
        if (kind == "adafactor") {
          EXPECT_GE(state, held);
        } else if (kind == "adamw_8bit" && !lora) {
          EXPECT_NEAR(state, held, 0.01 * held);
        } else {
          EXPECT_EQ(counted - grads, optimizer.state_bytes());
        }
        if (kind == "adamw") {
          EXPECT_EQ(optimizer.state_bytes(), values * (dtype == DType::kFloat32 ? 8 : 12));
        }
      }
  kit::count_optimizer_as({});
}

TEST(DeviceUsage, TiedGroupCountedOncePerDeviceAndWorkingIsMax) {
  const auto r = toy_request(true, DType::kFloat32);
  const auto usage = kit::device_usage(r, {{"embed", "cpu"}, {"layers.0", "cpu"}, {"head", "cpu"}});
  ASSERT_EQ(usage.size(), 1u);
  EXPECT_EQ(usage[0].weights, (100u + 1000u) * 4);  // the head shares the embedding's weights
  // The largest block's transient, not a sum; here the optimizer's step over the 1100 distinct
  // trainable values (fp32: their denominators) is larger still.
  EXPECT_EQ(usage[0].working, std::max<std::uint64_t>(50u * 16 * 4, 1100u * 4));
  EXPECT_EQ(usage[0].activations, (20u + 3u) * 16 * 4);
  EXPECT_EQ(usage[0].capacity, 1ull << 30);
}

// [train] activation_checkpointing = "offload": a recomputed layer's input is counted in host
// memory (one per micro-batch in flight), and on its device only the one in use and the one being
// brought back.
TEST(DeviceUsage, OffloadedCheckpointInputsAreCountedOnTheHost) {
  auto r = toy_request(false, DType::kBFloat16);
  r.model.hidden_size = 4;
  r.checkpoint_every = 1;
  r.adapter_trainable = {0, 0, 0};
  r.micro_batches_in_flight = 3;
  const auto kept = kit::block_memory(r, 1);
  kit::count_checkpoints_offloaded(true);
  const auto offloaded = kit::block_memory(r, 1);
  const auto usage = kit::device_usage(r, {{"embed", "cuda:0"}, {"layers.0", "cuda:0"}, {"head", "cuda:0"}});
  kit::count_checkpoints_offloaded(false);
  const std::uint64_t input = 4u * 16 * 2;  // hidden 4 x 16 tokens x 2 bytes
  EXPECT_EQ(kept.activations, 3 * input);
  EXPECT_EQ(offloaded.activations, 0u);
  EXPECT_EQ(offloaded.working, kept.working + 2 * input);
  ASSERT_EQ(usage.size(), 2u);
  EXPECT_EQ(usage[0].device, "cuda:0");
  EXPECT_EQ(usage[0].activations, 3u * 16 * 2 * 3);  // the head's, per micro-batch in flight
  EXPECT_EQ(usage[1].device, "cpu");
  EXPECT_EQ(usage[1].activations, 3 * input);
  EXPECT_EQ(usage[1].weights + usage[1].working + usage[1].trainable_state, 0u);
  EXPECT_EQ(usage[1].capacity, 1ull << 30);
  // Not recomputed, nothing goes to the host.
  r.checkpoint_every = 0;
  kit::count_checkpoints_offloaded(true);
  EXPECT_EQ(kit::device_usage(r, {{"embed", "cuda:0"}, {"layers.0", "cuda:0"}, {"head", "cuda:0"}}).size(), 1u);
  kit::count_checkpoints_offloaded(false);
}

void expect_bad_plan(const PlacementRequest& r, const Plan& plan, const std::string& fragment) {
  try {
    check_plan(r, plan, "test");
    FAIL() << "accepted a plan that should fail with: " << fragment;
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

// Evaluation's generation takes the rows whose cache fits what a device has left (here host RAM's
// MemAvailable: 2.5 rows' worth leaves room for 2), and a cache of which not one row fits is one
// error naming the settings that shrink it.
TEST(CheckPlan, EvaluationGeneratesTheRowsWhoseCacheFits) {
  const Inventory here = detect_inventory();
  const auto* host = here.find("cpu");
  if (host == nullptr || host->capacity_bytes == 0) GTEST_SKIP() << "no MemAvailable here";
  MeshPlan plan;
  plan.generation_cache.push_back({0, "cpu", host->capacity_bytes / 5 * 2});
  EXPECT_EQ(generation_rows_that_fit(plan, 0, 64, 1), 2);
  EXPECT_EQ(generation_rows_that_fit(plan, 0, 1, 1), 1);
  EXPECT_EQ(generation_rows_that_fit(plan, 1, 64, 1), 64);  // another rank's devices
  plan.generation_cache.front().bytes_per_position = host->capacity_bytes;
  try {
    generation_rows_that_fit(plan, 0, 64, 4);
    FAIL() << "a cache of which no row fits was taken";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("lower [data] max_length or [train] max_new_tokens"), std::string::npos) << e.what();
  }
}

TEST(CheckPlan, RefusesBrokenPlans) {
  auto r = toy_request(true, DType::kFloat32);
  Plan good;
  good.blocks = {{"embed", "cpu"}, {"layers.0", "cpu"}, {"head", "cpu"}};
  good.devices = kit::device_usage(r, good.blocks);
  EXPECT_NO_THROW(check_plan(r, good, "test"));

  Plan missing = good;
  missing.blocks.pop_back();
  expect_bad_plan(r, missing, "placed 2 blocks of the model's 3");
  Plan reordered = good;
  std::swap(reordered.blocks[0], reordered.blocks[1]);
  expect_bad_plan(r, reordered, "placed 'layers.0' where block 'embed' comes");
  Plan unknown = good;
  unknown.blocks[1].device = "cuda:7";
  expect_bad_plan(r, unknown, "put block 'layers.0' on cuda:7, which is not among the devices (cpu, cuda:0)");
  Plan split = good;
  split.blocks[2].device = "cuda:0";
  expect_bad_plan(r, split, "split the tied weights 'embed_tokens' across cpu and cuda:0");
  Plan over = good;
  over.blocks = {{"embed", "cuda:0"}, {"layers.0", "cuda:0"}, {"head", "cuda:0"}};
  r.batch_size = 4096;
  over.devices = kit::device_usage(r, over.blocks);
  expect_bad_plan(r, over, "on cuda:0, which has 1.00 MiB");
}

std::unique_ptr<Placement> single_on(const std::string& device) {
  PluginRegistry registry;
  registry.scan_directory(test::builtin_plugin_dir(), true);
  Options o;
  o.set("device", device);
  auto object = registry.create(*registry.find("placement", "single"), o);
  return std::unique_ptr<Placement>(dynamic_cast<Placement*>(object.release()));
}

ModelStructure structure_of(const std::string& config_json) { return test::llama_from_config(config_json)->structure(); }

const char* kLlama405B = R"({"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
  "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
  "max_position_embeddings": 131072, "rope_theta": 500000.0})";

TEST(SinglePlacement, RefusesWhatDoesNotFitAndSaysWhy) {
  PlacementRequest r;
  r.model = structure_of(kLlama405B);
  EXPECT_EQ(r.model.total_parameters(), 405853388800ull);  // Llama 3.1 405B's published count
  r.dtype = DType::kBFloat16;
  r.batch_size = 1;
  r.seq_len = 2048;
  r.ranks = {parse_inventory("cuda:0=141GiB,cpu=2TiB")};
  try {
    single_on("cuda:0")->plan(r);
    FAIL();
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("the model needs "), std::string::npos) << msg;
    EXPECT_NE(msg.find("but cuda:0 has 141.00 GiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("lower [train] batch_size"), std::string::npos) << msg;
  }
  // Weights alone are 756 GiB in bf16; a (simulated) host with 20 TiB holds the full fine-tune.
  r.ranks = {parse_inventory("cpu=20TiB")};
  const Plan plan = single_on("cpu")->plan(r);
  ASSERT_EQ(plan.devices.size(), 1u);
  EXPECT_EQ(plan.devices[0].weights, 405853388800ull * 2);
  EXPECT_NO_THROW(check_plan(r, plan, "single"));
}

TEST(SinglePlacement, AdapterFootprintMakesAn8BFitOne80GiBGpu) {
  PlacementRequest r;
  r.model = structure_of(R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256})");
  r.dtype = DType::kBFloat16;
  r.batch_size = 4;
  r.seq_len = 1024;
  r.ranks = {parse_inventory("cuda:0=80GiB")};
  EXPECT_THROW(single_on("cuda:0")->plan(r), UserError);  // full fine-tune: 16 B/param of weights, gradients, moments and master copies
  r.adapter_trainable.assign(r.model.blocks.size(), 0);
  for (std::size_t i = 1; i + 2 < r.model.blocks.size(); ++i) r.adapter_trainable[i] = 16 * (4096 + 4096) * 4;  // r=16 on 4 projections
  const Plan plan = single_on("cuda:0")->plan(r);
  EXPECT_EQ(plan.devices[0].weights, 8030261248ull * 2);
  EXPECT_LT(plan.devices[0].total(), 80ull << 30);
}

TEST(SinglePlacement, UnknownDeviceIsAnError) {
  auto r = toy_request(false, DType::kFloat32);
  try {
    single_on("cuda:3")->plan(r);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "device cuda:3 is not available here (devices: cpu, cuda:0)");
  }
}

}  // namespace
}  // namespace loom::core
