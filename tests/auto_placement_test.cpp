#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/placement.hpp"
#include "plugins/plugin_registry.hpp"
#include "planner/planner.hpp"
#include "test_support.hpp"

namespace loom::core {
namespace {

const char* kLlama8B = R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256})";
const char* kQwenTied = R"({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
  "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": true})";

std::unique_ptr<Placement> placement(const std::string& name, std::map<std::string, OptionValue> given) {
  return test::make_plugin<Placement>("placement", name, given);
}

PlacementRequest lora_request(const char* config, const std::string& devices, std::int64_t batch = 1) {
  PlacementRequest r;
  r.model = test::llama_from_config(config)->structure();
  r.dtype = DType::kFloat16;
  r.batch_size = batch;
  r.seq_len = 1024;
  r.ranks = {parse_inventory(devices)};
  r.adapter_trainable.assign(r.model.blocks.size(), 0);
  for (std::size_t i = 1; i + 2 < r.model.blocks.size(); ++i) r.adapter_trainable[i] = 16 * 8192 * 4;
  return r;
}

// Blocks go to devices in order, each device one contiguous run (the head of a tied model excepted).
void expect_contiguous(const Plan& plan) {
  std::vector<std::string> seen;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    if (plan.blocks[i].block == "head") continue;
    if (seen.empty() || seen.back() != plan.blocks[i].device) {
      EXPECT_EQ(std::find(seen.begin(), seen.end(), plan.blocks[i].device), seen.end()) << "device revisited at " << plan.blocks[i].block;
      seen.push_back(plan.blocks[i].device);
    }
  }
}

TEST(AutoPlacement, BalancedSplitsAnEightBillionModelOverTwoCappedGpus) {
  const auto r = lora_request(kLlama8B, "cuda:0=141GiB,cuda:1=141GiB,cpu=200GiB");
  const Plan plan = placement("auto", {{"max_memory", StringMap{{"cuda:0", "15GiB"}, {"cuda:1", "15GiB"}}}})->plan(r);
  EXPECT_NO_THROW(check_plan(r, plan, "auto"));
  ASSERT_EQ(plan.devices.size(), 2u);
  for (const auto& d : plan.devices) EXPECT_LE(d.total(), 14ull << 30) << d.device;  // 15 GiB cap less the 1 GiB reserve
  const double a = static_cast<double>(plan.devices[0].total()), b = static_cast<double>(plan.devices[1].total());
  EXPECT_LT(std::abs(a - b) / std::max(a, b), 0.15) << "balanced split is uneven: " << a << " vs " << b;
  expect_contiguous(plan);
  EXPECT_EQ(plan.blocks.front().device, "cuda:0");
  EXPECT_EQ(plan.blocks.back().device, "cuda:1");
}

TEST(AutoPlacement, SequentialFillsTheFirstGpuFirst) {
  const auto r = lora_request(kLlama8B, "cuda:0=141GiB,cuda:1=141GiB");
  const Plan plan = placement("auto", {{"strategy", std::string("sequential")}, {"max_memory", StringMap{{"cuda:0", "12GiB"}}}})->plan(r);
  ASSERT_EQ(plan.devices.size(), 2u);
  EXPECT_GT(plan.devices[0].total(), 9ull << 30);  // cuda:0 is filled close to its 11 GiB usable
  EXPECT_LE(plan.devices[0].total(), 11ull << 30);
  expect_contiguous(plan);
}

TEST(AutoPlacement, TiedHeadStaysWithTheEmbedding) {
  const auto r = lora_request(kQwenTied, "cuda:0=8GiB,cuda:1=8GiB", 4);
  const Plan plan = placement("auto", {})->plan(r);
  EXPECT_NO_THROW(check_plan(r, plan, "auto"));
  EXPECT_EQ(plan.blocks.front().device, plan.blocks.back().device);
  EXPECT_EQ(plan.blocks[plan.blocks.size() - 2].device, "cuda:1");  // the final norm sits at the end of the run
  bool noted = false;
  for (const auto& n : plan.notes) noted = noted || n.find("head shares its weights with embed") != std::string::npos;
  EXPECT_TRUE(noted);
}

TEST(AutoPlacement, RefusesWhatCannotFitAndSaysWhatWouldHelp) {
  const auto r = lora_request(kLlama8B, "cuda:0=8GiB,cuda:1=8GiB,cpu=200GiB");
  try {
    placement("auto", {})->plan(r);
    FAIL();
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("the model does not fit the GPUs (usable: cuda:0 7.00 GiB, cuda:1 7.00 GiB)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("strategy = \"cpu_offload\""), std::string::npos) << msg;
  }
}

TEST(AutoPlacement, CpuOffloadComputesTheRestOnTheCpu) {
  const auto r = lora_request(kLlama8B, "cuda:0=6GiB,cuda:1=6GiB,cpu=200GiB");
  const Plan plan = placement("auto", {{"strategy", std::string("cpu_offload")}})->plan(r);
  EXPECT_NO_THROW(check_plan(r, plan, "auto"));
  EXPECT_EQ(plan.blocks.front().device, "cuda:0");
  EXPECT_EQ(plan.blocks.back().device, "cpu");
  std::size_t on_cpu = 0;
  for (const auto& b : plan.blocks) on_cpu += b.device == "cpu";
  EXPECT_GT(on_cpu, 5u);
  expect_contiguous(plan);
}

TEST(AutoPlacement, FourHundredFiveBillionPlansFromConfigAlone) {
  PlacementRequest r = lora_request(R"({"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
    "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256})",
                                    "cuda:0=141GiB,cuda:1=141GiB,cuda:2=141GiB,cuda:3=141GiB,cuda:4=141GiB,cuda:5=141GiB,cuda:6=141GiB,cuda:7=141GiB");
  r.dtype = DType::kBFloat16;
  const Plan plan = placement("auto", {})->plan(r);
  EXPECT_NO_THROW(check_plan(r, plan, "auto"));
  // Every block once, in order over cuda:0..7, each GPU one contiguous run within its 140 GiB
  // usable (141 less the 1 GiB reserve); the balanced split evens the runs out; and the plan
  // counts every one of the 405B bf16 weights once (810 GB: it needs all 8).
  ASSERT_EQ(plan.blocks.size(), r.model.blocks.size());
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) EXPECT_EQ(plan.blocks[i].block, r.model.blocks[i].name);
  expect_contiguous(plan);
  ASSERT_EQ(plan.devices.size(), 8u);
  std::uint64_t weights = 0, least = UINT64_MAX, most = 0;
  for (std::size_t i = 0; i < plan.devices.size(); ++i) {
    const auto& d = plan.devices[i];
    EXPECT_EQ(d.device, "cuda:" + std::to_string(i));
    EXPECT_LE(d.total(), 140ull << 30) << d.device;
    weights += d.weights;
    least = std::min(least, d.total());
    most = std::max(most, d.total());
  }
  EXPECT_EQ(weights, r.model.total_parameters() * 2);
  EXPECT_GT(r.model.total_parameters(), 400'000'000'000ull);
  EXPECT_LT(static_cast<double>(most - least) / static_cast<double>(most), 0.15) << "balanced split is uneven: " << least << " vs " << most;
}

void expect_manual_error(const StringMap& map, const std::string& fragment) {
  const auto r = lora_request(kLlama8B, "cuda:0=141GiB,cuda:1=141GiB");
  try {
    placement("manual", {{"map", map}})->plan(r);
    FAIL() << fragment;
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(ManualPlacement, PlacesRangesAndRefusesIncompleteMaps) {
  const auto r = lora_request(kLlama8B, "cuda:0=141GiB,cuda:1=141GiB");
  const StringMap good = {{"embed", "cuda:0"}, {"layers.0-15", "cuda:0"}, {"layers.16-31", "cuda:1"}, {"norm", "cuda:1"}, {"head", "cuda:1"}};
  const Plan plan = placement("manual", {{"map", good}})->plan(r);
  EXPECT_EQ(plan.blocks[16].device, "cuda:0");  // layers.15
  EXPECT_EQ(plan.blocks[17].device, "cuda:1");  // layers.16
  StringMap missing = good;
  missing.erase("norm");
  expect_manual_error(missing, "the map places no device for: norm; every block must be placed");
  StringMap gap = good;
  gap.erase("layers.16-31");
  gap["layers.17-31"] = "cuda:1";
  expect_manual_error(gap, "the map places no device for: layers.16");
  StringMap twice = good;
  twice["layers.15"] = "cuda:1";
  expect_manual_error(twice, "block layers.15 is placed twice");
  StringMap beyond = good;
  beyond["layers.16-40"] = "cuda:1";
  beyond.erase("layers.16-31");
  expect_manual_error(beyond, "the model has no block layers.32 (its blocks: embed, layers.0-31, norm, head)");
  StringMap typo = good;
  typo["haed"] = "cuda:1";
  expect_manual_error(typo, "map key \"haed\" names no block");
}

TEST(ManualPlacement, SplitTiedWeightsAreRefusedByTheHost) {
  const auto r = lora_request(kQwenTied, "cuda:0=141GiB,cuda:1=141GiB");
  const Plan plan = placement("manual", {{"map", StringMap{{"embed", "cuda:0"}, {"layers.0-23", "cuda:0"}, {"norm", "cuda:1"}, {"head", "cuda:1"}}}})
                        ->plan(r);
  try {
    check_plan(r, plan, "manual");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("split the tied weights 'embed_tokens' across cuda:0 and cuda:1"), std::string::npos) << e.what();
  }
}

// `loom plan --freeze` prints a manual section that, pasted into the pipeline, plans the same.
TEST(PlanFreeze, FrozenPlanRoundTrips) {
  const auto dir = test::temp_dir();
  test::write_file(dir / "m/config.json", kLlama8B);
  const std::string model = "[model]\nplugin = \"llama\"\npath = \"m\"\n[train]\nbatch_size = 1\n[adapter]\nplugin = \"lora\"\n";
  test::write_file(dir / "auto.toml", model + "[placement]\nplugin = \"auto\"\nmax_memory = { \"cuda:0\" = \"15GiB\", \"cuda:1\" = \"15GiB\" }\n");
  const std::vector<std::string> devices = {"--devices", "cuda:0=141GiB,cuda:1=141GiB,cpu=64GiB", "--set", "run.dtype=\"fp16\""};
  auto args = std::vector<std::string>{"plan", (dir / "auto.toml").string(), "--freeze"};
  args.insert(args.end(), devices.begin(), devices.end());
  const auto frozen = test::run_loom(args);
  ASSERT_EQ(frozen.exit_code, 0) << frozen.err;
  EXPECT_NE(frozen.out.find("plugin = \"manual\""), std::string::npos) << frozen.out;
  // The last line offers version pins; uncommented under [plugins] they hold for these plugins.
  const std::string marker = "# to pin the plugins as well, under [plugins]: ";
  const auto pins_at = frozen.out.find(marker);
  ASSERT_NE(pins_at, std::string::npos) << frozen.out;
  EXPECT_NE(frozen.out.find("\"placement/manual\" = \"0.1.0\"", pins_at), std::string::npos) << frozen.out;
  test::write_file(dir / "frozen.toml", model + frozen.out + "[plugins]\n" + frozen.out.substr(pins_at + marker.size()));
  const auto plan_of = [&](const std::string& file) {
    auto a = std::vector<std::string>{"plan", (dir / file).string(), "--json"};
    a.insert(a.end(), devices.begin(), devices.end());
    const auto r = test::run_loom(a);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out)["blocks"];
  };
  const auto a = plan_of("auto.toml"), m = plan_of("frozen.toml");
  ASSERT_EQ(a.size(), m.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i]["device"], m[i]["device"]) << a[i]["block"];
}

}  // namespace
}  // namespace loom::core
