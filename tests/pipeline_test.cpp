#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "config/pipeline.hpp"
#include "plugins/plugin_guard.hpp"
#include "config/session.hpp"
#include "test_support.hpp"

namespace loom::core {
namespace {
namespace fs = std::filesystem;

PluginRegistry builtin_registry() {
  PluginRegistry registry;
  registry.scan_directory(test::builtin_plugin_dir(), true);
  return registry;
}

// The diagnostics a pipeline text produces, as printed.
std::vector<std::string> problems(const std::string& toml, Purpose purpose = Purpose::kRun, const std::vector<std::string>& sets = {},
                                  bool open = false) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "data.jsonl", "{\"text\": \"hi\"}\n");
  test::write_file(dir / "p.toml", toml);
  auto registry = builtin_registry();
  try {
    auto spec = load_pipeline(dir / "p.toml", sets, registry, purpose);
    if (open) open_session(std::move(spec), registry);
  } catch (const PipelineError& e) {
    std::vector<std::string> out;
    for (const auto& d : e.diagnostics()) {
      std::string s = d.str();
      const std::string prefix = (dir / "p.toml").string();
      if (s.rfind(prefix, 0) == 0) s = "p.toml" + s.substr(prefix.size());
      out.push_back(s);
    }
    return out;
  }
  return {};
}

const std::string kMinimal = R"([model]
plugin = "llama"
init = "random"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
vocab_size = 300

[tokenizer]
plugin = "bytes"

[data]
train = "data.jsonl"

[placement]
plugin = "single"
)";

// Keys from transformers' TrainingArguments, TRL, axolotl and torchtune, and loom's own keys in
// the wrong section, are answered with loom's name for them (issue 55).
TEST(Pipeline, KeysFromOtherToolsGetLoomsName) {
  const auto found = problems(kMinimal + R"(lora_r = 8
[train]
learning_rate = 1e-4
gradient_accumulation_steps = 4
num_epochs = 2
eval_steps = 50
seed = 3
max_seq_length = 512
bf16 = true
[run]
lr = 1e-4
)");
  const std::vector<std::string> expected = {
      "p.toml:18:1: [placement] unknown key 'lora_r' (placement plugin 'single'); loom's is [adapter] r",
      "p.toml:20:1: [train] unknown key 'learning_rate'; loom calls it lr",
      "p.toml:21:1: [train] unknown key 'gradient_accumulation_steps'; loom calls it grad_accum",
      "p.toml:22:1: [train] unknown key 'num_epochs'; loom calls it epochs",
      "p.toml:23:1: [train] unknown key 'eval_steps'; loom calls it eval_every",
      "p.toml:24:1: [train] unknown key 'seed'; loom's is [run] seed",
      "p.toml:25:1: [train] unknown key 'max_seq_length'; loom's is [data] max_length",
      "p.toml:26:1: [train] unknown key 'bf16'; loom's is [run] dtype = \"bf16\"",
      "p.toml:28:1: [run] unknown key 'lr'; loom's is [train] lr",
  };
  EXPECT_EQ(found, expected);
}

TEST(Pipeline, QuickstartIsValid) {
  auto registry = builtin_registry();
  const auto spec = load_pipeline(test::source_dir() / "configs/quickstart.toml", {}, registry, Purpose::kRun);
  const auto resolved = spec.resolved();
  EXPECT_EQ(resolved["model"]["plugin"], "llama");
  EXPECT_EQ(resolved["train"]["grad_accum"], 1);  // default filled in
  EXPECT_EQ(resolved["data"]["train"], (test::source_dir() / "configs/data/arith-train.jsonl").lexically_normal().string());
  EXPECT_EQ(resolved["run"]["output_dir"], "runs/quickstart");
  // Validation's read of the data's first records is kept for the checks before the first step.
  ASSERT_EQ(spec.data_heads.count("train"), 1u);
  EXPECT_EQ(spec.data_heads.at("train").samples.size(), kRecordsChecked);
  EXPECT_EQ(spec.data_heads.count("eval"), 1u);
  EXPECT_TRUE(load_pipeline(test::source_dir() / "configs/quickstart.toml", {}, registry, Purpose::kPlan).data_heads.empty());
}

// The typed configuration every part reads: the quickstart's keys as the spec resolved them, and
// activation_checkpointing's forms, a bad one a problem at its key.
TEST(RunConfig, ReadsTheSpecOnceWithItsForms) {
  auto registry = builtin_registry();
  const auto spec = load_pipeline(test::source_dir() / "configs/quickstart.toml", {"train.activation_checkpointing=every-3", "data.truncation=left"},
                                  registry, Purpose::kRun);
  Diagnostics none;
  const RunConfig c = read_run_config(spec, none);
  EXPECT_TRUE(none.empty());
  const auto resolved = spec.resolved();
  EXPECT_EQ(c.recompute_every, 3);
  EXPECT_EQ(c.collate.truncation, Truncation::kLeft);
  EXPECT_EQ(c.collate.max_length, resolved["data"]["max_length"].get<std::int64_t>());
  EXPECT_EQ(c.batch_size, resolved["train"]["batch_size"].get<std::int64_t>());
  EXPECT_EQ(c.seed, resolved["run"]["seed"].get<std::uint64_t>());
  EXPECT_EQ(dtype_name(c.dtype), resolved["run"]["dtype"].get<std::string>());
  EXPECT_EQ(c.output_dir, "runs/quickstart");
  ASSERT_TRUE(c.train_file.has_value());
  EXPECT_EQ(c.train_file->string(), resolved["data"]["train"].get<std::string>());
  EXPECT_EQ(c.eval_file.has_value(), resolved["data"].contains("eval"));
  EXPECT_FALSE(c.merge_adapter);
  for (const auto& [form, every] : std::vector<std::pair<std::string, std::int64_t>>{{"none", 0}, {"every-layer", 1}, {"every-1", 1}}) {
    Diagnostics d;
    EXPECT_EQ(read_run_config(load_pipeline(test::source_dir() / "configs/quickstart.toml", {"train.activation_checkpointing=" + form}, registry,
                                            Purpose::kPlan),
                              d)
                  .recompute_every,
              every)
        << form;
    EXPECT_TRUE(d.empty()) << form;
  }
  EXPECT_EQ(problems(kMinimal + "[train]\nactivation_checkpointing = \"every-0\"\n", Purpose::kPlan, {}, /*open=*/true),
            std::vector<std::string>{"p.toml:19:28: [train] activation_checkpointing = \"every-0\": use \"none\", \"every-layer\", \"offload\" or \"every-N\" with N "
                                     "a whole number from 1 (e.g. \"every-2\")"});
}

// A [train] key for an optimizer or schedule the run does not use, two warm-ups, a best_metric no
// checkpoint can be compared by and early stopping without one are each one problem at the key
// (issue 55).
TEST(RunConfig, OptimizerScheduleAndCheckpointKeysMustApply) {
  const auto found = problems(kMinimal + R"([train]
momentum = 0.5
cycles = 3
warmup_ratio = 0.1
warmup_steps = 10
best_metric = "eval_loss"
early_stopping_threshold = 0.1
)", Purpose::kPlan, {}, /*open=*/true);
  const std::vector<std::string> expected = {
      "p.toml:19:12: [train] momentum is used by optimizer = \"sgd\" only; this run trains with optimizer = \"adamw\": remove it",
      "p.toml:20:10: [train] cycles is used by scheduler = \"cosine_with_restarts\" only; this run has scheduler = \"cosine\": remove it",
      "p.toml:21:16: [train] warmup_ratio and warmup_steps both set the warm-up; keep one",
      "p.toml:23:15: [train] best_metric compares evaluations on [data] eval, which this pipeline lacks: add it (or [data] eval_split)",
      "p.toml:24:28: [train] early_stopping_threshold is used by early stopping (early_stopping_patience above 0) only; this run stops at no "
      "patience: remove it",
  };
  EXPECT_EQ(found, expected);
  // best_metric needs every checkpoint evaluated: checkpoint_every a multiple of eval_every.
  const std::string with_eval = kMinimal + "[train]\nbest_metric = \"eval_loss\"\neval_every = 4\ncheckpoint_every = 6\nearly_stopping_patience = 2\n";
  const auto sets = std::vector<std::string>{"data.eval=data.jsonl"};
  EXPECT_EQ(problems(with_eval, Purpose::kPlan, sets, true),
            std::vector<std::string>{"p.toml:19:15: [train] best_metric compares checkpoints by the evaluation at their step: set checkpoint_every (now 6) "
                                     "to a multiple of eval_every (now 4), both above 0"});
  EXPECT_EQ(problems(with_eval, Purpose::kPlan, {"data.eval=data.jsonl", "train.checkpoint_every=8"}, true), std::vector<std::string>{});
  // Every optimizer and schedule by name, and what the trainer builds from them.
  for (const char* optimizer : {"adamw", "adamw_8bit", "lion", "adafactor", "sgd"})
    EXPECT_EQ(problems(kMinimal, Purpose::kPlan, {std::string("train.optimizer=") + optimizer}, true), std::vector<std::string>{}) << optimizer;
  EXPECT_EQ(problems(kMinimal + "[train]\nscheduler = \"wsd\"\ndecay_ratio = 0.2\ndecay_shape = \"1-sqrt\"\nmin_lr_ratio = 0.1\n", Purpose::kPlan, {}, true),
            std::vector<std::string>{});
}

TEST(Pipeline, MinimalPipelineIsValid) { EXPECT_EQ(problems(kMinimal), std::vector<std::string>{}); }

TEST(Pipeline, ReportsEveryProblemWithPosition) {
  const auto found = problems(R"([run]
seed = "forty-two"
dtype = "fp64"
outptu_dir = "x"

[modle]
plugin = "llama"

[model]
plugin = "lama"

[tokenizer]
plugin = "bytes"
padding_side = "middle"
pad_token = 3.5

[data]
train = "missing.jsonl"
max_length = 0

[placement]
device = "cuda:0"

[train]
lr = "fast"
batch_size = [1, 2]
)");
  const std::vector<std::string> expected = {
      "p.toml:2:8: [run] seed: expected an integer, got a string (\"forty-two\")",
      "p.toml:3:9: [run] dtype: \"fp64\" is not one of \"fp32\", \"bf16\", \"fp16\", \"auto\"; did you mean \"fp32\"?",
      "p.toml:4:1: [run] unknown key 'outptu_dir', did you mean 'output_dir'?",
      "p.toml:6:2: unknown section [modle], did you mean [model]? (sections: 'run', 'model', 'tokenizer', 'data', 'objective', 'reward', 'collator', "
      "'adapter', 'placement', 'parallel', 'train', 'plugins')",
      "p.toml:10:10: [model] unknown model plugin 'lama', did you mean 'llama'? (known: 'cohere', 'deepseek_v3', 'gemma2', 'gemma3', 'gpt_neox', 'gpt_oss', 'granite', 'llama', 'mixtral', 'olmo2', 'olmoe', 'phi3', 'qwen2_moe', 'qwen3', 'qwen3_moe', 'stablelm', 'starcoder2')",
      "p.toml:14:16: [tokenizer] padding_side: \"middle\" is not one of \"left\", \"right\"",
      "p.toml:15:13: [tokenizer] pad_token: expected an integer or string, got a float (3.5)",
      "p.toml:18:9: [data] train: data file missing.jsonl: cannot open: No such file or directory",
      "p.toml:19:14: [data] max_length: 0 is out of range: must be at least 1",
      "p.toml:21:1: [placement] needs plugin = \"NAME\" (known placement plugins: 'auto', 'manual', 'pipeline', 'single', 'tensor-parallel')",
      "p.toml:25:6: [train] lr: expected a float, got a string (\"fast\")",
      "p.toml:26:14: [train] batch_size: expected an integer, got an array",
  };
  ASSERT_EQ(found.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (i == 7) {  // the unreadable path is absolute (resolved against the pipeline's folder)
      EXPECT_EQ(found[i].rfind("p.toml:18:9: [data] train: data file /", 0), 0u) << found[i];
      EXPECT_NE(found[i].find("missing.jsonl: cannot open: No such file or directory"), std::string::npos) << found[i];
      continue;
    }
    EXPECT_EQ(found[i], expected[i]);
  }
}

TEST(Pipeline, SyntaxErrorHasPosition) {
  const auto found = problems("[model\nplugin = 1\n");
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rfind("p.toml:1:7: TOML syntax error:", 0), 0u) << found[0];
}

TEST(Pipeline, MissingSectionsDependOnPurpose) {
  EXPECT_EQ(problems("", Purpose::kRun),
            (std::vector<std::string>{"p.toml: missing section [model] (known model plugins: 'cohere', 'deepseek_v3', 'gemma2', 'gemma3', 'gpt_neox', 'gpt_oss', 'granite', 'llama', 'mixtral', 'olmo2', 'olmoe', 'phi3', 'qwen2_moe', 'qwen3', 'qwen3_moe', 'stablelm', 'starcoder2')",
                                      "p.toml: missing section [tokenizer] (known tokenizer plugins: 'bytes', 'hf-json')",
                                      "p.toml: missing section [data]",
                                      "p.toml: missing section [placement] (known placement plugins: 'auto', 'manual', 'pipeline', 'single', 'tensor-parallel')"}));
  EXPECT_EQ(problems("", Purpose::kPlan),
            (std::vector<std::string>{"p.toml: missing section [model] (known model plugins: 'cohere', 'deepseek_v3', 'gemma2', 'gemma3', 'gpt_neox', 'gpt_oss', 'granite', 'llama', 'mixtral', 'olmo2', 'olmoe', 'phi3', 'qwen2_moe', 'qwen3', 'qwen3_moe', 'stablelm', 'starcoder2')",
                                      "p.toml: missing section [placement] (known placement plugins: 'auto', 'manual', 'pipeline', 'single', 'tensor-parallel')"}));
}

TEST(Pipeline, MissingRequiredKeyAndBadListElement) {
  const auto found = problems(kMinimal + "\n[plugins]\npaths = [\"ok\", 3]\n", Purpose::kRun);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0], "p.toml:20:16: [plugins] paths: every element must be a string, got an integer (3)");
  const auto missing = problems("[data]\nformat = \"{x}\"\n[model]\nplugin=\"llama\"\n[placement]\nplugin=\"single\"\n[tokenizer]\nplugin=\"bytes\"\n");
  ASSERT_EQ(missing.size(), 1u);
  EXPECT_EQ(missing[0], "p.toml:1:1: [data] missing required key 'train' (training data: JSON lines, a JSON array of records, CSV/TSV with a header row (.csv, .tsv), "
            "Parquet (.parquet), Arrow IPC (.arrow) or a datasets save_to_disk folder; a list of files trains on all of them, mixed by `weights`)");
}

TEST(Pipeline, SetOverridesAreTypedAndValidated) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "data.jsonl", "{\"text\": \"hi\"}\n");
  test::write_file(dir / "p.toml", kMinimal);
  auto registry = builtin_registry();
  const auto spec = load_pipeline(dir / "p.toml",
                                  {"train.lr=1e-4", "train.batch_size=8", "run.output_dir=out/x", "run.dtype=\"bf16\"",
                                   "tokenizer.add_bos=false", "train.warmup_steps=3"},
                                  registry, Purpose::kRun);
  const auto& train = spec.section("train").options;
  EXPECT_DOUBLE_EQ(train.get_float("lr"), 1e-4);
  EXPECT_EQ(train.get_int("batch_size"), 8);
  EXPECT_EQ(spec.section("run").options.get_string("output_dir"), "out/x");
  EXPECT_EQ(spec.section("run").options.get_string("dtype"), "bf16");
  EXPECT_FALSE(spec.section("tokenizer").options.get_bool("add_bos"));

  EXPECT_EQ(problems(kMinimal, Purpose::kRun, {"train.batch_size=abc"}),
            std::vector<std::string>{"--set train.batch_size: [train] batch_size: expected an integer, got a string (\"abc\")"});
  EXPECT_EQ(problems(kMinimal, Purpose::kRun, {"trainlr=1"}),
            std::vector<std::string>{"--set trainlr=1: expected --set SECTION.KEY=VALUE, e.g. --set train.lr=1e-4"});
  EXPECT_EQ(problems(kMinimal, Purpose::kRun, {"train.lrr=1"}),
            std::vector<std::string>{"--set train.lrr: [train] unknown key 'lrr', did you mean 'lr'?"});
  const auto negative = problems(kMinimal, Purpose::kRun, {"run.check_replicas_every=-1"});
  ASSERT_EQ(negative.size(), 1u);
  EXPECT_TRUE(test::contains(negative[0], "--set run.check_replicas_every: [run] check_replicas_every")) << negative[0];
  EXPECT_EQ(load_pipeline(dir / "p.toml", {}, registry, Purpose::kRun).section("run").options.get_int("check_replicas_every"), 100);
}

TEST(Pipeline, IntegerWidensToFloat) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "data.jsonl", "{\"text\": \"hi\"}\n");
  test::write_file(dir / "p.toml", kMinimal + "\n[train]\nlr = 1\n");
  auto registry = builtin_registry();
  const auto spec = load_pipeline(dir / "p.toml", {}, registry, Purpose::kRun);
  EXPECT_DOUBLE_EQ(spec.section("train").options.get_float("lr"), 1.0);
}

TEST(Pipeline, PluginPathsLoadPluginsAndReportRefusals) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "data.jsonl", "{\"text\": \"hi\"}\n");
  const std::string with_collator = kMinimal + "\n[collator]\nplugin = \"echo\"\nmask_promt = true\n\n[plugins]\npaths = [\"" +
                                    test::test_plugin_dir("good").string() + "\"]\n";
  EXPECT_EQ(problems(with_collator),
            std::vector<std::string>{"p.toml:21:1: [collator] unknown key 'mask_promt' (collator plugin 'echo'), did you mean 'mask_prompt'?"});
  const std::string with_broken = kMinimal + "\n[plugins]\npaths = [\"" + test::test_plugin_dir("sdk_major").string() + "\"]\n";
  const auto found = problems(with_broken);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_NE(found[0].find("test_plugin_sdk_major.so: refused: built against loom SDK 1."), std::string::npos) << found[0];
  EXPECT_EQ(problems(kMinimal + "\n[plugins]\npaths = [\"no/such/folder\"]\n")[0].substr(0, 40),
            "p.toml:20:9: [plugins] paths: plugin fol");
}

TEST(Pipeline, RelativePathsResolveAgainstPipelineFolder) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "data.jsonl", "{\"text\": \"hi\"}\n");
  test::write_file(dir / "models/tiny/config.json",
                   R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "vocab_size": 300})");
  test::write_file(dir / "p.toml", "[model]\nplugin = \"llama\"\npath = \"models/tiny\"\n[placement]\nplugin = \"single\"\n");
  auto registry = builtin_registry();
  auto spec = load_pipeline(dir / "p.toml", {}, registry, Purpose::kPlan);
  EXPECT_EQ(spec.section("model").options.get_string("path"), (dir / "models/tiny").string());
  const auto session = open_session(std::move(spec), registry);
  EXPECT_EQ(session.structure.blocks.size(), 5u);
  // One rule (issue 55): in the file relative to the file, output_dir included; on the command
  // line relative to the current folder; a file not found says which rule read its path.
  test::write_file(dir / "q.toml", kMinimal + "[run]\noutput_dir = \"out\"\n");
  const auto q = load_pipeline(dir / "q.toml", {}, registry, Purpose::kRun);
  EXPECT_EQ(q.section("run").options.get_string("output_dir"), (dir / "out").string());
  EXPECT_EQ(q.section("data").options.get_string("train"), (dir / "data.jsonl").string());
  const auto given = load_pipeline(dir / "q.toml", {"run.output_dir=elsewhere", "data.train=" + (dir / "data.jsonl").string()}, registry, Purpose::kRun);
  EXPECT_EQ(given.section("run").options.get_string("output_dir"), "elsewhere");
  const auto on_command_line = problems(kMinimal, Purpose::kRun, {"data.train=data.jsonl"});  // not in the test's current folder
  ASSERT_EQ(on_command_line.size(), 1u);
  EXPECT_TRUE(test::contains(on_command_line[0], "(a path given on the command line is relative to the current folder)")) << on_command_line[0];
  std::string missing_in_file = kMinimal;
  missing_in_file.replace(missing_in_file.find("data.jsonl"), 10, "nope.jsonl");
  const auto in_file = problems(missing_in_file);
  ASSERT_EQ(in_file.size(), 1u);
  EXPECT_TRUE(test::contains(in_file[0], "(a path in a pipeline is relative to the pipeline's folder, ")) << in_file[0];
}

// [model] with a path and no plugin: the folder's config.json model_type picks the plugin that
// declares it (SDK 3.8's descriptor); none or two readers, a missing or unnamed model_type are one
// error at the path, naming what to write.
TEST(Pipeline, ConfigJsonPicksTheModelPlugin) {
  const fs::path dir = test::temp_dir();
  const auto pick = [&](const std::string& folder, const std::string& extra = "") {
    test::write_file(dir / "p.toml", "[model]\npath = \"" + folder + "\"\n[placement]\nplugin = \"single\"\n" + extra);
    auto registry = builtin_registry();
    return load_pipeline(dir / "p.toml", {}, registry, Purpose::kPlan);
  };
  const fs::path fixtures = test::source_dir() / "tests/fixtures/parity";
  for (const auto& [folder, plugin] : std::vector<std::pair<std::string, std::string>>{{"llama", "llama"}, {"qwen2", "llama"}, {"qwen3", "qwen3"}}) {
    const auto spec = pick((fixtures / folder).string());
    EXPECT_EQ(spec.section("model").plugin, plugin) << folder;
    EXPECT_EQ(spec.resolved()["model"]["plugin"], plugin) << "the manifest records the plugin taken";
  }
  const auto refusal = [&](const std::string& folder, const std::string& extra = "") {
    try {
      pick(folder, extra);
    } catch (const PipelineError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  test::write_file(dir / "phi/config.json", R"({"model_type": "phimoe"})");
  auto r = refusal("phi");
  EXPECT_TRUE(test::contains(r, "p.toml:2:8: [model] names no plugin, and no model plugin reads model_type \"phimoe\"")) << r;
  EXPECT_TRUE(test::contains(r, "cohere (cohere); deepseek_v3 (deepseek_v3); gemma2 (gemma2); gemma3 (gemma3_text, gemma3); gpt_neox (gpt_neox); gpt_oss (gpt_oss); granite (granite); llama (llama, mistral, "
                                  "qwen2); mixtral (mixtral); olmo2 (olmo2); olmoe (olmoe); phi3 (phi3); qwen2_moe (qwen2_moe); qwen3 (qwen3); qwen3_moe "
                                  "(qwen3_moe); stablelm (stablelm); starcoder2 (starcoder2)")) << r;
  test::write_file(dir / "untyped/config.json", R"({"hidden_size": 8})");
  EXPECT_TRUE(test::contains(refusal("untyped"), "has no \"model_type\" string to choose a model plugin by")) << refusal("untyped");
  EXPECT_TRUE(test::contains(refusal("missing"), "so it is chosen by the folder's config.json")) << refusal("missing");
  // Two plugins reading the same model_type: neither is taken. A plugin built before SDK 3.8
  // declares none and is never taken.
  r = refusal((fixtures / "llama").string(), "[plugins]\npaths = [\"" + test::test_plugin_dir("claims_llama").string() + "\", \"" +
                                                 test::test_plugin_dir("contract_model").string() + "\"]\n");
  EXPECT_TRUE(test::contains(r, "model_type \"llama\" is read by both 'llama' (")) << r;
  EXPECT_TRUE(test::contains(r, "and 'llama-claimant' (")) << r;
  EXPECT_TRUE(test::contains(r, "name one with plugin = \"NAME\"")) << r;
  test::write_file(dir / "contract/config.json", R"({"model_type": "contract"})");
  auto registry = builtin_registry();
  registry.scan_directory(test::test_plugin_dir("claims_llama"), true);
  registry.scan_directory(test::test_plugin_dir("contract_model"), true);
  EXPECT_EQ(registry.find("model", "contract-model")->model_types, std::vector<std::string>{});
  EXPECT_EQ(registry.find("model", "llama-claimant")->model_types, (std::vector<std::string>{"llama", "contract"}));
  r = refusal("contract", "[plugins]\npaths = [\"" + test::test_plugin_dir("contract_model").string() + "\"]\n");
  EXPECT_TRUE(test::contains(r, "contract-model (declares none)")) << r;
  // Without a path there is nothing to choose by.
  EXPECT_TRUE(test::contains(problems("[model]\ninit = \"random\"\n[placement]\nplugin = \"single\"\n", Purpose::kPlan)[0],
                             "[model] needs plugin = \"NAME\" (known model plugins: 'cohere', 'deepseek_v3', 'gemma2', 'gemma3', 'gpt_neox', 'gpt_oss', 'granite', 'llama', 'mixtral', 'olmo2', 'olmoe', 'phi3', 'qwen2_moe', 'qwen3', 'qwen3_moe', 'stablelm', 'starcoder2'), or path = a model folder whose config.json names its model_type"));
}

TEST(Pipeline, FactoryErrorsPointAtThePluginKey) {
  EXPECT_EQ(problems("[model]\nplugin = \"llama\"\n[placement]\nplugin = \"single\"\ndevice = \"gpu0\"\n", Purpose::kPlan, {}, true),
            (std::vector<std::string>{
                "p.toml:2:10: model plugin 'llama': needs path = \"MODEL_FOLDER\" (an HF folder with config.json), or init = \"random\" "
                "with shape keys",
                "p.toml:4:10: placement plugin 'single': unknown device \"gpu0\": use \"cpu\", \"cuda\" or \"cuda:N\""}));
  // A factory failing otherwise is the plugin's bug, not a problem in the pipeline.
  const fs::path thrower = test::test_plugin_dir("factory_throws");
  EXPECT_THROW(problems(kMinimal + "\n[collator]\nplugin = \"thrower\"\n[plugins]\npaths = [\"" + thrower.string() + "\"]\n", Purpose::kRun, {}, true),
               PluginFault);
}

TEST(Pipeline, TokenizerMustFitModelVocabulary) {
  std::string small_vocab = kMinimal;
  small_vocab.replace(small_vocab.find("vocab_size = 300"), 16, "vocab_size = 100");
  EXPECT_EQ(problems(small_vocab, Purpose::kRun, {}, true),
            std::vector<std::string>{"p.toml:11:10: tokenizer 'bytes' has 259 tokens but the model's vocab_size is 100: its ids would "
                                     "index past the embedding; use a model with vocab_size >= 259"});
}

TEST(Pipeline, PluginVersionsCanBePinned) {
  // The built-in plugins are 0.1.0 (llama 0.2.0, a description of the kit's decoder).
  EXPECT_EQ(problems(kMinimal + "[plugins]\nversions = { llama = \"0.2.0\", \"tokenizer/bytes\" = \"0.1\", single = \"0\" }\n"),
            std::vector<std::string>{});
  EXPECT_EQ(problems(kMinimal + "[plugins]\nversions = { llama = \"0.3\", lama = \"0.1\", bytes = \"x.1\", lora = \"0.1.0\" }\n"),
            (std::vector<std::string>{
                "p.toml:19:22: [plugins] versions: the pipeline needs model plugin 'llama' 0.3, but the one found is 0.2.0 (" +
                    (fs::path(LOOM_BUILTIN_PLUGIN_DIR) / "loom_model_llama.so").string() + "); install that version or change the requirement",
                "p.toml:19:36: [plugins] versions: this pipeline uses no plugin 'lama', did you mean 'llama'? (it uses 'llama', 'bytes', 'all-tokens', 'single', 'sft')",
                "p.toml:19:51: [plugins] versions: bytes = \"x.1\" is not a version requirement; write \"1.2.3\" (that version), \"1.2\" or \"1\" "
                "(any version starting so)",
                "p.toml:19:65: [plugins] versions: this pipeline uses no plugin 'lora' (it uses 'llama', 'bytes', 'all-tokens', 'single', 'sft')",
            }));
}

TEST(Pipeline, HostileFilesAreRefusedCleanly) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "huge.toml", std::string(5u << 20, '#'));
  auto registry = builtin_registry();
  try {
    load_pipeline(dir / "huge.toml", {}, registry, Purpose::kRun);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline " + (dir / "huge.toml").string() + " is larger than the 4.00 MiB such a file may be"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_pipeline(dir, {}, registry, Purpose::kRun), UserError);  // a folder
  test::write_file(dir / "binary.toml", std::string("\x00\xff\xfe[model]", 10));
  EXPECT_THROW(load_pipeline(dir / "binary.toml", {}, registry, Purpose::kRun), PipelineError);
}

}  // namespace
}  // namespace loom::core
