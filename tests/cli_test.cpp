#include <gtest/gtest.h>

#include <set>
#include <tuple>
#include <map>
#include <functional>
#include <cstring>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "loom/kit/hub_cache.hpp"
#include "loom/kit/kernels.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/version.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;

const std::string kQuickstart = (source_dir() / "configs/quickstart.toml").string();
// The SDK these tests were compiled against, as loom prints it ("2.4").
std::string sdk_version_text() { return std::to_string(LOOM_SDK_VERSION_MAJOR) + "." + std::to_string(LOOM_SDK_VERSION_MINOR); }


TEST(Cli, VersionNamesEveryComponent) {
  const auto r = run_loom({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_TRUE(contains(r.out, "loom 0.1.0\nSDK " + sdk_version_text() + "\nLibTorch ")) << r.out;
  // A CUDA build names the architectures its kernels were built for.
  EXPECT_EQ(contains(r.out, "CUDA kernels built for "), !kit::cuda_architectures().empty()) << r.out;
  if (!kit::cuda_architectures().empty()) {
    EXPECT_TRUE(contains(r.out, "CUDA kernels built for " + kit::cuda_architectures() + "\n")) << r.out;
  }
}

TEST(Cli, UsageErrorsExitTwo) {
  auto r = run_loom({});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "usage: loom"));
  r = run_loom({"valdate", kQuickstart});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "loom: error: unknown command 'valdate', did you mean 'validate'? (see loom --help)\n");
  r = run_loom({"plan"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "loom: error: the option '--pipeline' is required")) << r.err;
  r = run_loom({"--log-level", "loud", "plugins"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "unknown --log-level 'loud'")) << r.err;
  r = run_loom({"generate", kQuickstart, "--prompt", "1+1", "--ignore-eos=yes"});  // a switch takes no value
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "option '--ignore-eos' does not take any arguments")) << r.err;
}

TEST(Cli, ValidateReportsAllProblemsAndExitsTwo) {
  const fs::path dir = temp_dir();
  write_file(dir / "bad.toml", "[run]\nseed = -1\n[model]\nplugin = \"llama\"\nhidden = 3\n[placement]\nplugin = \"single\"\n");
  const auto r = run_loom({"validate", (dir / "bad.toml").string()});
  EXPECT_EQ(r.exit_code, 2);
  const std::string f = (dir / "bad.toml").string();
  EXPECT_TRUE(contains(r.err, f + ": missing section [tokenizer] (known tokenizer plugins: 'bytes', 'hf-json')\n")) << r.err;
  EXPECT_TRUE(contains(r.err, f + ":2:8: [run] seed: -1 is out of range: must be at least 0\n")) << r.err;
  EXPECT_TRUE(contains(r.err, f + ":5:1: [model] unknown key 'hidden' (model plugin 'llama')")) << r.err;
  EXPECT_TRUE(contains(r.err, "loom: 4 problems found; nothing was run\n")) << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST(Cli, ValidateAndPlanQuickstart) {
  auto r = run_loom({"validate", kQuickstart});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, ": ok (adapter 'lora', collator 'completion-only', model 'llama', objective 'sft', placement 'single', tokenizer 'bytes')")) << r.out;
  r = run_loom({"plan", kQuickstart, "--json", "--devices", "cpu=2GiB"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto plan = nlohmann::json::parse(r.out);
  EXPECT_EQ(plan["strategy"], "single");
  EXPECT_EQ(plan["blocks"].size(), 5u);
  EXPECT_EQ(plan["devices"][0]["device"], "cpu");
  EXPECT_EQ(plan["inventory"]["simulated"], true);
  // Activations for the run's largest micro-batch of its own data: the quickstart's sums are
  // shorter than max_length (64).
  EXPECT_GT(plan["seq_len"].get<std::int64_t>(), 20);
  EXPECT_LT(plan["seq_len"].get<std::int64_t>(), 64);
  EXPECT_TRUE(contains(plan["notes"].dump(), "activations for the run's largest micro-batch from its data: ")) << plan["notes"].dump();
  // The plan names the optimizer it counted; 8-bit AdamW's moments count a quarter of AdamW's.
  EXPECT_EQ(plan["optimizer"], "adamw");
  r = run_loom({"plan", kQuickstart, "--devices", "cpu=2GiB", "--set", "train.optimizer=\"adamw_8bit\""});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "optimizer: adamw_8bit")) << r.out;
  r = run_loom({"plan", kQuickstart, "--json", "--devices", "cpu=2GiB", "--set", "train.optimizer=\"adamw_8bit\""});
  const auto eight_bit = nlohmann::json::parse(r.out);
  EXPECT_LT(eight_bit["devices"][0]["trainable_state_bytes"].get<std::uint64_t>(), plan["devices"][0]["trainable_state_bytes"].get<std::uint64_t>());
  r = run_loom({"plan", kQuickstart, "--devices", "cpu=1KiB"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "placement 'single': the model needs")) << r.err;
  r = run_loom({"plan", kQuickstart, "--devices", "cpu=lots"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "bad memory size \"lots\"")) << r.err;
}

// [run] dtype = "auto" follows the GPUs' compute capability (bf16 from 8.0, fp16 on 7.x, fp32
// without a GPU) and the plan says what it took; "bf16" on a 7.x GPU is refused at its key, naming
// fp16. --devices names a simulated GPU's capability after @; [run] gpu_memory caps each GPU.
TEST(Cli, PlanChoosesTheDtypeByTheGpus) {
  const auto plan = [](const std::string& devices, const std::string& dtype, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"plan", kQuickstart, "--json", "--devices", devices, "--set", "run.dtype=\"" + dtype + "\""};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_loom(args);
  };
  const auto took = [&](const std::string& devices) {
    const auto r = plan(devices, "auto");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    if (r.exit_code != 0) return std::string();
    const auto json = nlohmann::json::parse(r.out);
    return json["dtype"].get<std::string>() + " | " + json["notes"].dump();
  };
  EXPECT_TRUE(contains(took("cpu=8GiB"), "fp32 | ")) << took("cpu=8GiB");
  EXPECT_TRUE(contains(took("cpu=8GiB"), "[run] dtype = \\\"auto\\\" took fp32: no GPU"));
  EXPECT_TRUE(contains(took("cuda:0=15GiB@7.5,cpu=8GiB"), "fp16 | "));
  EXPECT_TRUE(contains(took("cuda:0=15GiB@7.5,cpu=8GiB"), "took fp16 with loss scaling: cuda:0 has compute capability 7.5, which computes no bfloat16"));
  EXPECT_TRUE(contains(took("cuda:0=80GiB@8.0,cuda:1=16GiB@7.0,cpu=8GiB"), "cuda:1 has compute capability 7.0"));
  EXPECT_TRUE(contains(took("cuda:0=80GiB@9.0,cuda:1=80GiB@12.0,cpu=8GiB"), "bf16 | "));
  EXPECT_TRUE(contains(took("cuda:0=80GiB,cpu=8GiB"), "took bf16: the simulated GPUs name no compute capability"));
  auto r = plan("cuda:0=15GiB@7.5,cpu=8GiB", "bf16");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "[run] dtype = \"bf16\": cuda:0 has compute capability 7.5, which computes no bfloat16 (that needs 8.0); use \"fp16\""))
      << r.err;
  EXPECT_EQ(plan("cuda:0=80GiB@8.0,cpu=8GiB", "bf16").exit_code, 0);
  for (const char* bad : {"cuda:0=15GiB@7", "cuda:0=15GiB@sm75", "cpu=8GiB@7.5"}) {
    r = plan(bad, "auto");
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_TRUE(contains(r.err, "--devices entry")) << r.err;
  }
  // [run] gpu_memory: the plan's capacity of each GPU, not the host's.
  r = plan("cuda:0=80GiB@9.0,cpu=8GiB", "auto", {"--set", "run.gpu_memory=\"15GiB\""});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto json = nlohmann::json::parse(r.out);
  EXPECT_TRUE(contains(json["inventory"].dump(), std::to_string(15ull << 30))) << json["inventory"].dump();
  EXPECT_FALSE(contains(json["inventory"].dump(), std::to_string(80ull << 30))) << json["inventory"].dump();
  EXPECT_TRUE(contains(json["inventory"].dump(), std::to_string(8ull << 30))) << json["inventory"].dump();
  r = plan("cuda:0=80GiB,cpu=8GiB", "auto", {"--set", "run.gpu_memory=\"1MiB\""});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "[run] gpu_memory: less than 256 MiB leaves no room for a model; write e.g. \"15GiB\"")) << r.err;
  // The test switch is checked once, for every command.
  r = run_loom({"plugins"}, {{"LOOM_DEVICE_CAPABILITY", "75"}});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "LOOM_DEVICE_CAPABILITY: compute capability \"75\": write MAJOR.MINOR")) << r.err;
}

// A model named by hub id is found in the local Hugging Face cache as huggingface_hub lays it out
// (refs/<revision> -> snapshots/<commit>, files as links into blobs/), by HF_HUB_CACHE or HF_HOME;
// a folder of that name beside the pipeline wins; a missing model or revision is one error naming
// the cache and the `hf download` command.
TEST(Cli, ModelsByHubIdComeFromTheLocalCache) {
  const fs::path dir = temp_dir(), hub = dir / "home/hub", repo = hub / "models--acme--tiny-llama";
  const std::string main_commit(40, 'a'), v1_commit = std::string(39, 'b') + "1";
  const fs::path fixture = source_dir() / "tests/fixtures/parity/llama";
  for (const auto& [ref, commit] : {std::pair<std::string, std::string>{"main", main_commit}, {"v1", v1_commit}}) {
    write_file(repo / "refs" / ref, commit);
    fs::create_directories(repo / "snapshots" / commit);
    for (const char* file : {"config.json", "model.safetensors"}) {
      const fs::path blob = repo / "blobs" / (commit.substr(0, 8) + file);
      fs::create_directories(blob.parent_path());
      fs::copy_file(fixture / file, blob, fs::copy_options::overwrite_existing);
      fs::create_symlink(fs::path("../../blobs") / blob.filename(), repo / "snapshots" / commit / file);
    }
  }
  write_file(dir / "data.jsonl", "{\"text\": \"hello\"}\n");
  const auto pipeline = [&](const std::string& model) {
    write_file(dir / "p.toml", "[model]\n" + model + "\n[tokenizer]\nplugin = \"bytes\"\n[data]\ntrain = \"data.jsonl\"\nmax_length = 64\n[collator]\n"
                               "plugin = \"completion-only\"\nresponse_template = \"l\"\n[adapter]\nplugin = \"lora\"\n[placement]\nplugin = \"single\"\n");
    return (dir / "p.toml").string();
  };
  const auto plan = [&](const std::string& model, const std::map<std::string, std::string>& env) {
    return run_loom({"plan", pipeline(model), "--json", "--devices", "cpu=8GiB"}, env);
  };
  for (const auto& env : {std::map<std::string, std::string>{{"HF_HUB_CACHE", hub.string()}}, {{"HF_HUB_CACHE", ""}, {"HF_HOME", (dir / "home").string()}}}) {
    // The plugin is chosen by the cached config.json's model_type, as for a folder.
    const auto r = plan("path = \"acme/tiny-llama\"", env);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["model"]["architecture"], "llama");
  }
  const std::map<std::string, std::string> cache = {{"HF_HUB_CACHE", hub.string()}};
  EXPECT_EQ(plan("plugin = \"llama\"\npath = \"acme/tiny-llama\"\nrevision = \"v1\"", cache).exit_code, 0);
  EXPECT_EQ(plan("path = \"acme/tiny-llama\"\nrevision = \"" + v1_commit + "\"", cache).exit_code, 0) << "a commit names its snapshot";
  // The adapter names its base as the pipeline does, as PEFT records it.
  auto trained = run_loom({"run", pipeline("path = \"acme/tiny-llama\"\nrevision = \"v1\"\n[train]\nmax_steps = 2"), "--output", (dir / "run").string()}, cache);
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  const auto adapter_config = nlohmann::json::parse(read_file(dir / "run/adapter/adapter_config.json"));
  EXPECT_EQ(adapter_config["base_model_name_or_path"], "acme/tiny-llama");
  EXPECT_EQ(adapter_config["revision"], "v1");
  auto r = plan("path = \"acme/tiny-llama\"\nrevision = \"v2\"", cache);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "[model] path = \"acme/tiny-llama\": the hub cache's " + repo.string() + " has no revision \"v2\" (no refs/v2); fetch it with "
                              "`hf download acme/tiny-llama --revision v2`")) << r.err;
  r = plan("plugin = \"llama\"\npath = \"acme/other\"", cache);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "[model] path = \"acme/other\" is not a folder, and as a Hugging Face hub id it is not in the local hub cache " + hub.string() +
                              " (no models--acme--other; HF_HUB_CACHE or HF_HOME choose the cache); fetch it with `hf download acme/other`")) << r.err;
  r = plan("plugin = \"llama\"\npath = \"acme/tiny-llama\"\nrevision = \"../../x\"", cache);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "revision \"../../x\": write a branch, a tag or a 40-digit commit")) << r.err;
  // A folder of the id's name beside the pipeline is that folder, not the cached model (here it
  // has no config.json).
  fs::create_directories(dir / "acme/tiny-llama");
  r = plan("path = \"acme/tiny-llama\"", cache);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, (dir / "acme/tiny-llama/config.json").string())) << r.err;
  EXPECT_TRUE(kit::looks_like_hub_id("meta-llama/Meta-Llama-3-8B"));
  EXPECT_TRUE(kit::looks_like_hub_id("gpt2"));
  for (const char* not_id : {"a/b/c", "./x", "../x", "/abs", "a--b/c", "a/.c", "-a/b", "a b/c", ""}) EXPECT_FALSE(kit::looks_like_hub_id(not_id)) << not_id;
}

// Plain text trains with the loss on every token (the all-tokens collator), packed or padded:
// the loss falls, and with a response template evaluation still generates the answers.
TEST(Cli, PlainTextTrainsOnEveryToken) {
  const fs::path dir = temp_dir();
  std::string train, eval;
  for (int i = 0; i < 64; ++i) train += "{\"text\": \"Q: " + std::to_string(i % 8) + " A: the quick brown fox " + std::to_string(i % 8) + "\"}\n";
  for (int i = 0; i < 4; ++i) eval += "{\"text\": \"Q: " + std::to_string(i) + " A: the quick brown fox " + std::to_string(i) + "\"}\n";
  write_file(dir / "train.jsonl", train);
  write_file(dir / "eval.jsonl", eval);
  write_file(dir / "p.toml", R"([model]
plugin = "llama"
init = "random"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
vocab_size = 259
[tokenizer]
plugin = "bytes"
pad_token = "eos"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
max_length = 64
[collator]
plugin = "all-tokens"
response_template = " A:"
[placement]
plugin = "single"
[train]
max_steps = 40
batch_size = 8
lr = 3e-3
max_new_tokens = 24
)");
  for (const bool packing : {false, true}) {
    SCOPED_TRACE(packing ? "packed" : "padded");
    const fs::path out = dir / (packing ? "packed" : "padded");
    const auto r = run_loom({"run", (dir / "p.toml").string(), "--output", out.string(), "--set", std::string("data.packing=") + (packing ? "true" : "false")});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto rows = metrics_rows(out / "metrics.jsonl", true);
    ASSERT_FALSE(rows.empty());
    EXPECT_LT(rows.back()["loss"].get<double>(), 0.5 * rows.front()["loss"].get<double>());
    EXPECT_EQ(last_eval(out / "metrics.jsonl")["eval_samples"], 4);
  }
}

// `loom validate` reads every record of the data files (a bad line past the first 64 is found
// there, at its line) and says how many it read; [data] eval_split holds records out of train for
// the evaluation, and the run trains on the rest; several train files mix by their weights; plain
// text without a [collator] trains on every token; validate --json gives the problems as data, run
// --json its summary (issue 55).
TEST(Cli, ValidateReadsEveryRecordAndEvalSplitHoldsOutRecords) {
  const fs::path dir = temp_dir();
  std::string train;
  for (int i = 0; i < 120; ++i) train += i == 99 ? "{\"txt\": \"a misspelt field\"}\n" : "{\"text\": \"record " + std::to_string(i) + "\"}\n";
  write_file(dir / "train.jsonl", train);
  write_file(dir / "p.toml", R"([model]
plugin = "llama"
init = "random"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 4
vocab_size = 259
[tokenizer]
plugin = "bytes"
pad_token = "eos"
[data]
train = "train.jsonl"
max_length = 32
[placement]
plugin = "single"
[train]
max_steps = 3
batch_size = 4
eval_samples = 0
)");
  const auto bad = run_loom({"validate", (dir / "p.toml").string()});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("[data] train: " + (dir / "train.jsonl").string() + ":100: "), std::string::npos) << bad.err;
  const auto skipped = run_loom({"validate", (dir / "p.toml").string(), "--set", "data.on_bad_line=skip", "--set", "data.eval_split=0.1"});
  ASSERT_EQ(skipped.exit_code, 0) << skipped.err;
  EXPECT_NE(skipped.out.find("collator 'all-tokens'"), std::string::npos) << "plain text without a [collator] trains on every token: " << skipped.out;
  EXPECT_NE(skipped.out.find(": 119 records, 1 bad ones skipped (on_bad_line = \"skip\")\n  [data] eval_split: 12 of the training records held out"),
            std::string::npos)
      << skipped.out;
  // --json: the problems as data, each at its place; the run's summary alone on stdout.
  const auto bad_json = run_loom({"validate", (dir / "p.toml").string(), "--json"});
  EXPECT_EQ(bad_json.exit_code, 2);
  const auto problems = nlohmann::json::parse(bad_json.out);
  EXPECT_EQ(problems["ok"], false);
  ASSERT_EQ(problems["problems"].size(), 1u) << bad_json.out;
  EXPECT_EQ(problems["problems"][0]["file"], (dir / "p.toml").string());
  EXPECT_EQ(problems["problems"][0]["line"], 13);  // [data] train
  EXPECT_NE(problems["problems"][0]["message"].get<std::string>().find("train.jsonl:100: "), std::string::npos) << bad_json.out;
  const auto run = run_loom({"run", (dir / "p.toml").string(), "--output", (dir / "out").string(), "--set", "data.on_bad_line=skip", "--set",
                             "data.eval_split=7", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.err.find("112 samples"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("step 3/3"), std::string::npos) << "the progress lines go to stderr";
  const auto summary = nlohmann::json::parse(run.out);
  EXPECT_EQ(summary["steps"], 3);
  EXPECT_EQ(summary["model"], (dir / "out/model").string());
  EXPECT_TRUE(fs::exists(dir / "out/model/generation_config.json")) << "the model folder loads as a published one";
  EXPECT_TRUE(summary["adapter"].is_null());
  EXPECT_TRUE(summary["eval_loss"].is_number());
  EXPECT_EQ(summary["skipped_lines"], 1);
  EXPECT_EQ(last_eval(dir / "out/metrics.jsonl")["eval_samples"], 7);
  // Two train files (here the same one twice) mixed 3 to 1: both read whole, 238 records drawn.
  const std::string twice = "data.train=[\"" + (dir / "train.jsonl").string() + "\", \"" + (dir / "train.jsonl").string() + "\"]";
  const auto mixed = run_loom({"run", (dir / "p.toml").string(), "--output", (dir / "mixed").string(), "--set", "data.on_bad_line=skip", "--set", twice,
                               "--set", "data.weights=[3, 1]", "--set", "data.eval_split=0.05"});
  ASSERT_EQ(mixed.exit_code, 0) << mixed.err;
  EXPECT_NE(mixed.err.find("226 samples"), std::string::npos) << mixed.err;  // 119 - 6 held out of each, 226 mixed 3:1
  EXPECT_EQ(last_eval(dir / "mixed/metrics.jsonl")["eval_samples"], 12);
  const auto too_much = run_loom({"validate", (dir / "p.toml").string(), "--set", "data.on_bad_line=skip", "--set", "data.eval_split=0.9999"});
  EXPECT_NE(too_much.err.find("[data] eval_split holds out 119 of the 119 records of " + (dir / "train.jsonl").string() + ", leaving nothing to train on"),
            std::string::npos)
      << too_much.err;
  const auto uneven = run_loom({"validate", (dir / "p.toml").string(), "--set", twice, "--set", "data.weights=[3]"});
  EXPECT_NE(uneven.err.find("[data] weights has 1 entries for 2 train files; give one a file"), std::string::npos) << uneven.err;
  const auto both = run_loom({"validate", (dir / "p.toml").string(), "--set", "data.eval_split=7", "--set", "data.eval=" + (dir / "train.jsonl").string()});
  EXPECT_NE(both.err.find("[data] eval_split and eval both give the evaluation data; keep one"), std::string::npos) << both.err;
}

// `loom plan` says how far the settings stretch on the devices: the longest [data] max_length that
// [train] batch_size rows fit at and the largest batch_size at max_length, each the edge of what
// plans (one more does not); where the settings do not fit, the error says so and names
// recomputing every layer when that fits and is not set already.
TEST(Cli, PlanSaysTheLongestRowAndTheLargestBatchThatFit) {
  const std::string eight_b = (test::source_dir() / "bench/llama8b_lora.toml").string();
  const auto plan = [&](const std::string& devices, std::vector<std::string> sets) {
    std::vector<std::string> args = {"plan", eight_b, "--json", "--devices", devices};
    for (const auto& s : sets) args.insert(args.end(), {"--set", s});
    return run_loom(args);
  };
  const auto r = plan("cuda:0=80GiB", {});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto fit = nlohmann::json::parse(r.out)["fit"];
  EXPECT_EQ(fit["batch_size"], 4);
  EXPECT_EQ(fit["max_length"], 1024);
  const std::int64_t longest = fit["longest_max_length"], largest = fit["largest_batch_size"];
  EXPECT_GT(longest, 1024);
  EXPECT_LT(longest, fit["max_length_searched_to"].get<std::int64_t>());
  EXPECT_GT(largest, 4);
  EXPECT_EQ(plan("cuda:0=80GiB", {"data.max_length=" + std::to_string(longest)}).exit_code, 0);
  EXPECT_EQ(plan("cuda:0=80GiB", {"data.max_length=" + std::to_string(longest + 1)}).exit_code, 2);
  EXPECT_EQ(plan("cuda:0=80GiB", {"train.batch_size=" + std::to_string(largest)}).exit_code, 0);
  EXPECT_EQ(plan("cuda:0=80GiB", {"train.batch_size=" + std::to_string(largest + 1)}).exit_code, 2);
  const auto text = run_loom({"plan", eight_b, "--devices", "cuda:0=80GiB"});
  EXPECT_TRUE(contains(text.out, "fits: [train] batch_size 4 fits [data] max_length up to " + std::to_string(longest) +
                                     "; [data] max_length 1024 fits [train] batch_size up to " + std::to_string(largest) + "\n"))
      << text.out;
  // 24 GiB does not hold 4 x 1024 as set; recomputing every layer would.
  const auto small = plan("cuda:0=24GiB", {});
  EXPECT_EQ(small.exit_code, 2);
  EXPECT_TRUE(contains(small.err, "; with these settings [train] batch_size 4 fits [data] max_length up to ")) << small.err;
  EXPECT_TRUE(contains(small.err, "[train] activation_checkpointing = \"every-layer\" makes the settings fit")) << small.err;
  // Set already, it is not named.
  const auto tiny = plan("cuda:0=16GiB", {"train.activation_checkpointing=\"every-layer\""});
  EXPECT_EQ(tiny.exit_code, 2);
  EXPECT_FALSE(contains(tiny.err, "activation_checkpointing = \"every-layer\" makes the settings fit")) << tiny.err;
  // Its 4-bit base fits as it is set.
  EXPECT_TRUE(contains(tiny.err, "; [adapter] plugin = \"qlora\" (the base in 4 bits) makes the settings fit")) << tiny.err;
  EXPECT_FALSE(contains(tiny.err, "settings fit with [train]")) << tiny.err;
  EXPECT_TRUE(contains(tiny.err, "with these settings [train] batch_size 4 fits [data] max_length up to ")) << tiny.err;
  // 17 GiB holds it with the layers' inputs in host memory, and the plan counts them on the cpu.
  const auto recomputed = plan("cuda:0=17GiB,cpu=64GiB", {"train.activation_checkpointing=\"every-layer\""});
  EXPECT_EQ(recomputed.exit_code, 2);
  EXPECT_TRUE(contains(recomputed.err, "[train] activation_checkpointing = \"offload\" (layers' inputs in host memory) makes the settings fit"))
      << recomputed.err;
  const auto offloaded = plan("cuda:0=17GiB,cpu=64GiB", {"train.activation_checkpointing=\"offload\""});
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.err;
  std::uint64_t host = 0, gpu_activations = 0;
  const auto offloaded_plan = nlohmann::json::parse(offloaded.out);
  for (const auto& d : offloaded_plan["devices"]) (d["device"] == "cpu" ? host : gpu_activations) = d["activations_bytes"].get<std::uint64_t>();
  EXPECT_EQ(host, 32ull * 4 * 1024 * 4096 * 2);  // 32 layers' inputs of 4 x 1024 x 4096 bf16 values
  EXPECT_LT(gpu_activations, host / 8);
  const auto note = run_loom({"plan", eight_b, "--devices", "cuda:0=17GiB,cpu=64GiB", "--set", "train.activation_checkpointing=\"offload\""});
  EXPECT_TRUE(contains(note.out, "over a 25 GB/s host link the copies keep pace with a GPU doing up to 1331 TFLOP/s")) << note.out;
  // The host must hold them too.
  EXPECT_EQ(plan("cuda:0=17GiB,cpu=512MiB", {"train.activation_checkpointing=\"offload\""}).exit_code, 2);
  // 12 GiB holds no bf16 copy of the 8B base, however its activations go; its 4-bit copy fits with
  // every layer recomputed, and the error says so.
  const auto quantized = plan("cuda:0=12GiB,cpu=64GiB", {});
  EXPECT_EQ(quantized.exit_code, 2);
  EXPECT_TRUE(contains(quantized.err, "; [adapter] plugin = \"qlora\" (the base in 4 bits) makes the settings fit with [train] activation_checkpointing = "
                                      "\"every-layer\"")) << quantized.err;
}

// Training LoRA on a frozen, whole head, the kit's decoder takes the loss from the head's input
// (FrozenHeadWorkingSet): the plan counts a slice of logits there, where fp16 (whole logits) and a
// tensor-split head count every token's logits and their gradient.
TEST(Cli, PlanCountsASliceOfLogitsForAFrozenHead) {
  const std::string eight_b = (test::source_dir() / "bench/llama8b_lora.toml").string();
  const auto head_working = [&](std::vector<std::string> extra) -> std::uint64_t {
    std::vector<std::string> args = {"plan", eight_b, "--json", "--devices", "cuda:0=141GiB,cuda:1=141GiB"};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = run_loom(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const auto plan = nlohmann::json::parse(r.out);
    for (const auto& b : plan["blocks"])
      if (b["kind"] == "head") return b["working_bytes"].get<std::uint64_t>();
    ADD_FAILURE() << "no head in the plan";
    return 0;
  };
  const std::uint64_t tokens = 4 * 1024, vocab = 128256, hidden = 4096;
  const std::uint64_t sliced = head_working({});
  // The gradient of the head's input a token, and one slice: 512 rows of logits in bf16 and fp32
  // and their bf16 gradient, and backward's fp32 chunks.
  const std::uint64_t slice = 512 * vocab * (2 * 2 + 4) + 2 * (std::uint64_t{1} << 22) * 4;
  EXPECT_EQ(sliced, (hidden + (slice + tokens * 2 - 1) / (tokens * 2)) * tokens * 2);
  const std::uint64_t whole = 2 * vocab * tokens * 2;
  EXPECT_EQ(head_working({"--set", "run.dtype=\"fp16\""}), whole);
  EXPECT_LT(sliced * 3, whole);
  const auto split = head_working({"--set", "parallel.tensor=2", "--set", "placement.plugin=\"tensor-parallel\"", "--nproc-per-node", "2"});
  EXPECT_GT(split, sliced) << "a tensor-split head makes its logits whole";
}

// The plan counts generation's cache per device from the model (StaticCacheSizing): Llama-3-8B
// keeps 128 KiB a token in bf16 (32 layers x 8 K/V heads x 128 x keys and values x 2 bytes), half
// of it on each of two tensor ranks, each pipeline stage its own layers'; and evaluation's 64 rows
// of [data] max_length + [train] max_new_tokens.
TEST(Cli, PlanCountsGenerationsCache) {
  const std::string eight_b = (test::source_dir() / "bench/llama8b_lora.toml").string();
  const auto cache_of = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"plan", eight_b, "--json", "--devices", "cuda:0=80GiB,cuda:1=80GiB", "--set", "train.max_new_tokens=16"};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = run_loom(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out)["generation"];
  };
  const auto one = cache_of({});
  EXPECT_EQ(one["evaluation_rows"], 64);
  EXPECT_EQ(one["evaluation_positions"], 1024 + 16);
  ASSERT_EQ(one["devices"].size(), 1u);
  EXPECT_EQ(one["devices"][0]["device"], "cuda:0");
  EXPECT_EQ(one["devices"][0]["cache_bytes_per_position"], 131072);
  EXPECT_EQ(one["devices"][0]["evaluation_cache_bytes"], 131072ull * 64 * 1040);
  const auto split = cache_of({"--set", "parallel.tensor=2", "--set", "placement.plugin=\"tensor-parallel\"", "--nproc-per-node", "2"});
  ASSERT_GE(split["devices"].size(), 1u);
  EXPECT_EQ(split["devices"][0]["cache_bytes_per_position"], 65536);
  const auto staged = cache_of({"--set", "parallel.pipeline=2", "--set", "placement.plugin=\"pipeline\""});
  ASSERT_EQ(staged["devices"].size(), 2u);
  EXPECT_EQ(staged["devices"][0]["cache_bytes_per_position"].get<std::uint64_t>() + staged["devices"][1]["cache_bytes_per_position"].get<std::uint64_t>(),
            131072u);
  const auto text = run_loom({"plan", eight_b, "--devices", "cuda:0=80GiB"});
  EXPECT_TRUE(contains(text.out, "generation cache (keys and values, made once per request): cuda:0 128.00 KiB a position of a row")) << text.out;
}

// A sliding layer keeps only its window of a row's positions (StaticCacheWindow): the plan counts
// the copy task's model (2 K/V heads of 8 a layer, fp32: 128 bytes a position a layer) as one
// global layer's every position and one sliding layer's latest 4.
TEST(Cli, PlanCountsASlidingLayersWindowOfCache) {
  const fs::path dir = test::temp_dir();
  const auto p = test::copy_task_pipeline(dir, 2, true, "[placement]\nplugin = \"single\"\n", "", "", "");
  const auto plan_of = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"plan", p.string(), "--json", "--set", "run.dtype=\"fp32\""};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = run_loom(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out)["generation"];
  };
  const auto global = plan_of({});
  const auto windowed = plan_of({"--set", "model.sliding_window=4", "--set", "model.layer_types=[\"sliding_attention\", \"full_attention\"]"});
  ASSERT_EQ(global["devices"].size(), 1u);
  ASSERT_EQ(windowed["devices"].size(), 1u);
  const std::uint64_t layer = 2 * 2 * 8 * 4, positions = global["evaluation_positions"].get<std::uint64_t>();
  EXPECT_EQ(global["devices"][0]["cache_bytes_per_position"], 2 * layer);
  EXPECT_EQ(global["devices"][0]["evaluation_cache_bytes"], 64 * 2 * layer * positions);
  EXPECT_EQ(windowed["devices"][0]["cache_bytes_per_position"], layer);
  EXPECT_EQ(windowed["devices"][0]["cache_windowed"], nlohmann::json::parse(R"([{"window": 4, "bytes_per_position": )" + std::to_string(layer) + "}]"));
  EXPECT_EQ(windowed["devices"][0]["evaluation_cache_bytes"], 64 * layer * (positions + 4));
  const auto text = run_loom({"plan", p.string(), "--set", "run.dtype=\"fp32\"", "--set", "model.sliding_window=4", "--set",
                              "model.layer_types=[\"sliding_attention\", \"full_attention\"]"});
  EXPECT_TRUE(contains(text.out, "cpu 128 B a position of a row + 128 B a position of its latest 4 (sliding layers)")) << text.out;
}

TEST(Cli, PluginsListsDescribesAndReportsRefusals) {
  auto r = run_loom({"plugins", "--json"}, {{"LOOM_PLUGIN_PATH", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto listed = nlohmann::json::parse(r.out);
  std::vector<std::string> names;
  for (const auto& p : listed["plugins"]) names.push_back(p["kind"].get<std::string>() + "/" + p["name"].get<std::string>());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"adapter/lora", "adapter/qlora", "collator/all-tokens", "collator/completion-only", "model/cohere", "model/deepseek_v3", "model/gemma2", "model/gemma3", "model/gpt_neox", "model/gpt_oss", "model/granite", "model/llama", "model/mixtral", "model/olmo2", "model/olmoe", "model/phi3", "model/qwen2_moe", "model/qwen3", "model/qwen3_moe", "model/stablelm", "model/starcoder2", "objective/dpo", "objective/grpo", "objective/sft", "placement/auto", "placement/manual", "placement/pipeline", "placement/single", "placement/tensor-parallel", "reward/command", "reward/exact-answer", "reward/regex", "tokenizer/bytes", "tokenizer/hf-json"}));

  r = run_loom({"plugins", "describe", "llama"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_TRUE(contains(r.out, "model plugin 'llama' 0.2.0")) << r.out;
  EXPECT_TRUE(contains(r.out, "num_key_value_heads")) << r.out;
  r = run_loom({"plugins", "describe", "lama"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "loom: error: no plugin named 'lama', did you mean 'llama'? (see `loom plugins`)\n");

  r = run_loom({"plugins"}, {{"LOOM_PLUGIN_PATH", test_plugin_dir("torch_mismatch").string() + ":" + test_plugin_dir("good").string()}});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.out, "echo")) << r.out;
  EXPECT_TRUE(contains(r.out, "test_plugin_torch_mismatch.so: refused: built against LibTorch 9.")) << r.out;
  r = run_loom({"plugins"}, {{"LOOM_PLUGIN_PATH", "/no/such/folder"}});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "loom: error: plugin folder /no/such/folder does not exist or is not a folder\n");
}

TEST(Cli, RunWritesManifestAndGuardsTheOutputFolder) {
  const fs::path dir = temp_dir();
  const std::string out = (dir / "run1").string();
  auto r = run_loom({"run", kQuickstart, "--dry-run", "--output", out});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto manifest = nlohmann::json::parse(read_file(dir / "run1/run.json"));
  EXPECT_EQ(manifest["seed"], 7);
  EXPECT_EQ(manifest["pipeline"]["run"]["output_dir"], out);
  EXPECT_EQ(manifest["pipeline"]["model"]["hidden_size"], 128);
  EXPECT_EQ(manifest["versions"]["sdk"], sdk_version_text());
  EXPECT_EQ(manifest["plugins"]["model"]["name"], "llama");
  EXPECT_EQ(manifest["plan"]["strategy"], "single");
  EXPECT_TRUE(manifest["devices"]["devices"].is_array());
  EXPECT_FALSE(fs::exists(dir / "run1/.run.json.tmp"));

  r = run_loom({"run", kQuickstart, "--dry-run", "--output", out});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "already holds a run (run.json); pass --resume")) << r.err;
  r = run_loom({"run", kQuickstart, "--dry-run", "--resume", "--output", out, "--set", "train.lr=0.1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "--resume: the pipeline differs from the one that started " + out + " (changed: train.lr)")) << r.err;
  r = run_loom({"run", kQuickstart, "--dry-run", "--resume", "--output", out});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = run_loom({"run", kQuickstart, "--resume", "--output", (dir / "never").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "holds no run to resume")) << r.err;
}

// A plugin that fails with anything but UserError, in its factory or in a call, is reported as its
// own bug: exit 1, naming the plugin, its version and file, and the call; never as the user's error.
// `loom logits` against transformers' own logits (the parity fixtures), plain and with the PEFT
// adapter, for both model families; a wrong expectation exits 4, bad inputs are one clear error.
TEST(Cli, LogitsMatchTransformersAndRefuseMismatches) {
  const fs::path dir = temp_dir();
  for (const std::string family : {"llama", "qwen3"}) {
    const fs::path fixture = source_dir() / "tests/fixtures/parity" / family;
    const fs::path pipeline = dir / (family + ".toml");
    write_file(pipeline, "[model]\nplugin = \"" + family + "\"\npath = \"" + fixture.string() +
                             "\"\n[adapter]\nplugin = \"lora\"\n[placement]\nplugin = \"single\"\ndevice = \"cpu\"\n");
    const std::string inputs = (fixture / "inputs.json").string();
    auto r = run_loom({"logits", pipeline.string(), "--inputs", inputs, "--compare", (fixture / "logits.safetensors").string()});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_TRUE(contains(r.out, "logits: 2 x 12 x 320\nlargest difference over 21 real tokens: ")) << r.out;
    EXPECT_TRUE(contains(r.out, "(match)")) << r.out;
    const fs::path written = dir / (family + "-adapted.safetensors");
    r = run_loom({"logits", pipeline.string(), "--inputs", inputs, "--adapter", (fixture / "adapter").string(), "--output", written.string(),
                  "--compare", (fixture / "logits_adapter.safetensors").string()});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    // The adapter changes the logits: the base's expectation is a mismatch, exit 4.
    r = run_loom({"logits", pipeline.string(), "--inputs", inputs, "--compare", written.string()});
    EXPECT_EQ(r.exit_code, 4) << r.out << r.err;
    EXPECT_TRUE(contains(r.out, "(MISMATCH)")) << r.out;
  }
  const fs::path pipeline = dir / "llama.toml";
  const auto refused = [&](const std::string& inputs_json, const std::string& message) {
    write_file(dir / "bad.json", inputs_json);
    const auto r = run_loom({"logits", pipeline.string(), "--inputs", (dir / "bad.json").string(), "--output", (dir / "never.safetensors").string()});
    EXPECT_EQ(r.exit_code, 2) << inputs_json << "\n" << r.err;
    EXPECT_TRUE(contains(r.err, message)) << r.err;
    EXPECT_FALSE(fs::exists(dir / "never.safetensors"));
  };
  refused(R"({"input_ids": [[1, 2, 3], [4, 5]]})", "bad.json: input_ids[1]: has 2 entries; every row needs 3");
  refused(R"({"input_ids": [[1, 2, 320]]})", "bad.json: input_ids[0][2]");
  refused(R"({"input_ids": [[1, 2]], "attention_mask": [[0, 0]]})", "a row masks every token");
  refused(R"({"input_ids": []})", "needs 1 to 4096 rows");
  const auto r = run_loom({"logits", pipeline.string(), "--inputs", (dir / "bad.json").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "logits needs --output FILE, --compare FILE or both")) << r.err;
}

// `loom export` merges a PEFT adapter into the base and writes a Hugging Face folder: read back as
// a model it gives transformers' logits of base + adapter (tests/fixtures/parity/llama); shards of
// at most --max-shard-size with transformers' index; the dtype asked for; config.json's dtype in
// both spellings; the model's generation_config.json; nothing left behind on a refusal (issue 55).
TEST(Cli, ExportMergesTheAdapterIntoAHuggingFaceFolder) {
  const fs::path dir = temp_dir();
  const fs::path fixture = source_dir() / "tests/fixtures/parity/llama";
  const fs::path pipeline = dir / "llama.toml";
  write_file(pipeline, "[model]\nplugin = \"llama\"\npath = \"" + fixture.string() + "\"\n[adapter]\nplugin = \"lora\"\n[placement]\nplugin = \"single\"\ndevice = \"cpu\"\n");
  const auto exported = run_loom({"export", pipeline.string(), "--adapter", (fixture / "adapter").string(), "--output", (dir / "merged").string(),
                                  "--max-shard-size", "40KB", "--json"});
  ASSERT_EQ(exported.exit_code, 0) << exported.err;
  const auto summary = nlohmann::json::parse(exported.out);
  EXPECT_GT(summary["shards"].get<int>(), 1);
  const auto index = nlohmann::json::parse(read_file(dir / "merged/model.safetensors.index.json"));
  std::uint64_t total = 0;
  std::set<std::string> shards;
  for (const auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_EQ(shards.size(), summary["shards"].get<std::size_t>());
  for (const auto& shard : shards) {
    // Within the limit (and its header), or one tensor larger than the limit alone.
    const kit::SafetensorsFile file(dir / "merged" / shard);
    total += file.tensors().size();
    if (fs::file_size(dir / "merged" / shard) > 40000u + 4096u) {
      EXPECT_EQ(file.tensors().size(), 1u) << shard;
    }
  }
  EXPECT_EQ(total, index["weight_map"].size());
  EXPECT_EQ(total, summary["tensors"].get<std::uint64_t>());
  EXPECT_GT(index["metadata"]["total_size"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(read_file(dir / "merged/generation_config.json"), read_file(fixture / "generation_config.json"));
  const auto config = nlohmann::json::parse(read_file(dir / "merged/config.json"));
  EXPECT_EQ(config["torch_dtype"], "float32");
  EXPECT_EQ(config["dtype"], "float32");
  // The merged folder alone gives the logits transformers computed with the adapter.
  write_file(dir / "merged.toml", "[model]\nplugin = \"llama\"\npath = \"" + (dir / "merged").string() + "\"\n[placement]\nplugin = \"single\"\ndevice = \"cpu\"\n");
  const auto logits = run_loom({"logits", (dir / "merged.toml").string(), "--inputs", (fixture / "inputs.json").string(), "--compare",
                                (fixture / "logits_adapter.safetensors").string()});
  EXPECT_EQ(logits.exit_code, 0) << logits.out << logits.err;
  EXPECT_TRUE(contains(logits.out, "(match)")) << logits.out;
  // bf16: every weight in bf16, in one file under the default shard size.
  const auto bf16 = run_loom({"export", pipeline.string(), "--output", (dir / "bf16").string(), "--dtype", "bf16"});
  ASSERT_EQ(bf16.exit_code, 0) << bf16.err;
  EXPECT_FALSE(fs::exists(dir / "bf16/model.safetensors.index.json"));
  const kit::SafetensorsFile bf16_file(dir / "bf16/model.safetensors");
  for (const auto& info : bf16_file.tensors()) EXPECT_EQ(info.dtype, "BF16") << info.name;
  // Bad flags are one error each, before anything is loaded.
  for (const auto& [flag, value, message] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--gguf-type", "q4", "--gguf-type q4: use f32, f16, bf16 or q8_0"},
           {"--format", "onnx", "--format onnx: use hf (a Hugging Face folder) or gguf (a file for llama.cpp)"},
           {"--dtype", "int8", "--dtype int8: use fp32, bf16 or fp16"}}) {
    const auto bad = run_loom({"export", pipeline.string(), "--output", (dir / "never").string(), flag, value});
    EXPECT_EQ(bad.exit_code, 2) << flag;
    EXPECT_TRUE(contains(bad.err, message)) << bad.err;
  }
  EXPECT_FALSE(fs::exists(dir / "never"));
  // An existing folder is refused before anything is loaded; nothing half-written is left.
  const auto again = run_loom({"export", pipeline.string(), "--output", (dir / "bf16").string()});
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_TRUE(contains(again.err, "already exists; name a new one")) << again.err;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().front() == '.') left.push_back(e.path().filename().string());
  EXPECT_TRUE(left.empty()) << left.front();
}

// A GGUF file read here by its specification (ggml's docs/gguf.md): metadata, tensor infos, data.
struct Gguf {
  nlohmann::json metadata = nlohmann::json::object();
  struct Tensor {
    std::string name;
    std::vector<std::uint64_t> dims;  // ggml's order: the fastest first
    std::uint32_t type;
    std::uint64_t offset;
  };
  std::vector<Tensor> tensors;
  std::string bytes;
  std::uint64_t data_start = 0;
  // A tensor's values as float32, in PyTorch's shape (F32, F16, BF16 and Q8_0).
  at::Tensor values(const std::string& name) const {
    const auto t = std::find_if(tensors.begin(), tensors.end(), [&](const Tensor& x) { return x.name == name; });
    if (t == tensors.end()) throw std::runtime_error("no tensor " + name);
    std::vector<std::int64_t> shape(t->dims.rbegin(), t->dims.rend());
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    const char* at = bytes.data() + data_start + t->offset;
    at::Tensor out = at::empty({n}, at::kFloat);
    if (t->type == 0) std::memcpy(out.data_ptr(), at, static_cast<std::size_t>(n) * 4);
    else if (t->type == 1) out = at::from_blob(const_cast<char*>(at), {n}, at::kHalf).to(at::kFloat);
    else if (t->type == 30) out = at::from_blob(const_cast<char*>(at), {n}, at::kBFloat16).to(at::kFloat);
    else if (t->type == 8) {  // blocks of an fp16 scale and 32 int8s
      for (std::int64_t b = 0; b < n / 32; ++b) {
        const char* block = at + b * 34;
        const float d = at::from_blob(const_cast<char*>(block), {1}, at::kHalf).item<float>();
        for (int i = 0; i < 32; ++i) out[b * 32 + i] = d * static_cast<float>(static_cast<std::int8_t>(block[2 + i]));
      }
    } else {
      throw std::runtime_error("type " + std::to_string(t->type));
    }
    return out.view(shape);
  }
};

Gguf read_gguf(const fs::path& file) {
  Gguf g;
  g.bytes = read_file(file);
  std::size_t at = 0;
  const auto take = [&](std::size_t n) {
    if (at + n > g.bytes.size()) throw std::runtime_error("truncated at " + std::to_string(at));
    const char* p = g.bytes.data() + at;
    at += n;
    return p;
  };
  const auto u32 = [&] { std::uint32_t v; std::memcpy(&v, take(4), 4); return v; };
  const auto u64 = [&] { std::uint64_t v; std::memcpy(&v, take(8), 8); return v; };
  const auto str = [&] { const auto n = u64(); return std::string(take(n), n); };
  std::function<nlohmann::json(std::uint32_t)> value = [&](std::uint32_t type) -> nlohmann::json {
    switch (type) {
      case 4: return u32();
      case 5: { std::int32_t v; std::memcpy(&v, take(4), 4); return v; }
      case 6: { float v; std::memcpy(&v, take(4), 4); return v; }
      case 7: return *take(1) != 0;
      case 8: return str();
      case 9: {
        const auto element = u32();
        const auto count = u64();
        nlohmann::json a = nlohmann::json::array();
        for (std::uint64_t i = 0; i < count; ++i) a.push_back(value(element));
        return a;
      }
      default: throw std::runtime_error("value type " + std::to_string(type));
    }
  };
  EXPECT_EQ(std::string(take(4), 4), "GGUF");
  EXPECT_EQ(u32(), 3u);
  const auto tensors = u64(), kvs = u64();
  for (std::uint64_t i = 0; i < kvs; ++i) {
    const std::string key = str();
    g.metadata[key] = value(u32());
  }
  for (std::uint64_t i = 0; i < tensors; ++i) {
    Gguf::Tensor t;
    t.name = str();
    const auto dims = u32();
    for (std::uint32_t d = 0; d < dims; ++d) t.dims.push_back(u64());
    t.type = u32();
    t.offset = u64();
    EXPECT_EQ(t.offset % 32, 0u) << t.name;
    g.tensors.push_back(t);
  }
  g.data_start = (at + 31) / 32 * 32;
  return g;
}

// GPT-2's byte-level alphabet: a printable character for every byte (tokenizers' ByteLevel).
std::vector<std::string> byte_level_alphabet() {
  std::vector<int> bs, cs;
  for (int b = 0; b < 256; ++b)
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) bs.push_back(b);
  cs = bs;
  int extra = 0;
  for (int b = 0; b < 256; ++b)
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
      bs.push_back(b);
      cs.push_back(256 + extra++);
    }
  std::vector<std::string> out(256);
  for (std::size_t i = 0; i < bs.size(); ++i) {
    const int c = cs[i];
    std::string u;
    if (c < 0x80) u += static_cast<char>(c);
    else {
      u += static_cast<char>(0xC0 | (c >> 6));
      u += static_cast<char>(0x80 | (c & 0x3F));
    }
    out[static_cast<std::size_t>(bs[i])] = u;
  }
  return out;
}

// `loom export --format gguf` of the parity Llama with its PEFT adapter merged: what llama.cpp reads
// (ggml's layout: its names, the fastest dimension first, data aligned to 32; the Llama's query and
// key rows in llama.cpp's interleaved rotary order: row 2i of a head is transformers' row i, row
// 2i + 1 its row i + head_dim / 2), Q8_0 within half a step of each block's scale (and the scale's
// fp16 rounding) and F16 within its rounding of the merged weights, the architecture's and a byte-level BPE tokenizer's metadata; and
// the same metadata and tensor infos as Hugging Face's JS parser (@huggingface/gguf) reads them
// (issue 55).
TEST(Export, GgufIsWhatLlamaCppAndHfGgufRead) {
  const fs::path dir = temp_dir();
  const fs::path fixture = source_dir() / "tests/fixtures/parity/llama";
  // A byte-level BPE tokenizer for the model's 320 ids: the 256 bytes, two merges, two specials.
  nlohmann::json vocab = nlohmann::json::object();
  const auto alphabet = byte_level_alphabet();
  for (int b = 0; b < 256; ++b) vocab[alphabet[static_cast<std::size_t>(b)]] = b;
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  write_file(dir / "tok/tokenizer.json",
             nlohmann::json{{"version", "1.0"},
                            {"added_tokens", {{{"id", 300}, {"content", "<|begin|>"}, {"special", true}}, {{"id", 301}, {"content", "<|end|>"}, {"special", true}}}},
                            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
                            {"decoder", {{"type", "ByteLevel"}}},
                            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a b", {"ab", "c"}}}}}}
                 .dump());
  write_file(dir / "tok/tokenizer_config.json", R"({"add_bos_token": true, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})");
  const fs::path pipeline = dir / "p.toml";
  write_file(pipeline, "[model]\nplugin = \"llama\"\npath = \"" + fixture.string() + "\"\n[tokenizer]\nplugin = \"hf-json\"\npath = \"" +
                           (dir / "tok").string() + "\"\n[adapter]\nplugin = \"lora\"\n[placement]\nplugin = \"single\"\ndevice = \"cpu\"\n");
  const std::string adapter = (fixture / "adapter").string();
  // A BPE with byte fallback (SentencePiece's kind: Llama 2, Mistral) is refused, not written as a
  // byte-level one that llama.cpp would tokenize otherwise.
  auto spm = nlohmann::json::parse(read_file(dir / "tok/tokenizer.json"));
  spm["model"]["byte_fallback"] = true;
  write_file(dir / "spm/tokenizer.json", spm.dump());
  const auto refused = run_loom({"export", pipeline.string(), "--format", "gguf", "--output", (dir / "spm.gguf").string(), "--set",
                                 "tokenizer.path=" + (dir / "spm").string()});
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_NE(refused.err.find("a BPE with byte fallback (SentencePiece-style: Llama 2, Mistral)"), std::string::npos) << refused.err;
  EXPECT_FALSE(fs::exists(dir / "spm.gguf"));
  ASSERT_EQ(run_loom({"export", pipeline.string(), "--adapter", adapter, "--output", (dir / "hf").string(), "--max-shard-size", "0"}).exit_code, 0);
  const kit::SafetensorsFile merged(dir / "hf/model.safetensors");
  const auto config = nlohmann::json::parse(read_file(fixture / "config.json"));
  for (const std::string type : {"q8_0", "f16"}) {
    SCOPED_TRACE(type);
    const fs::path file = dir / ("m-" + type + ".gguf");
    const auto r = run_loom({"export", pipeline.string(), "--adapter", adapter, "--format", "gguf", "--gguf-type", type, "--output", file.string()});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const Gguf g = read_gguf(file);
    const auto& m = g.metadata;
    EXPECT_EQ(m["general.architecture"], "llama");
    EXPECT_EQ(m["general.file_type"], type == "q8_0" ? 7 : 1);
    EXPECT_EQ(m["llama.block_count"], config["num_hidden_layers"]);
    EXPECT_EQ(m["llama.embedding_length"], config["hidden_size"]);
    EXPECT_EQ(m["llama.attention.head_count_kv"], config["num_key_value_heads"]);
    EXPECT_EQ(m["llama.rope.dimension_count"], config["head_dim"]);
    EXPECT_EQ(m["tokenizer.ggml.model"], "gpt2");
    ASSERT_EQ(m["tokenizer.ggml.tokens"].size(), 320u);
    EXPECT_EQ(m["tokenizer.ggml.tokens"][97], "a");
    EXPECT_EQ(m["tokenizer.ggml.tokens"][300], "<|begin|>");
    EXPECT_EQ(m["tokenizer.ggml.token_type"][300], 3);  // control
    EXPECT_EQ(m["tokenizer.ggml.tokens"][310], "[PAD310]");
    EXPECT_EQ(m["tokenizer.ggml.merges"], (nlohmann::json{"a b", "ab c"}));
    EXPECT_EQ(m["tokenizer.ggml.bos_token_id"], config["bos_token_id"]);
    EXPECT_EQ(m["tokenizer.ggml.add_bos_token"], true);
    // Every merged weight, under llama.cpp's name, in the type asked for (norms in F32).
    const std::map<std::string, std::string> names = {{"model.embed_tokens.weight", "token_embd.weight"},
                                                      {"model.norm.weight", "output_norm.weight"},
                                                      {"model.layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight"},
                                                      {"model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight"},
                                                      {"model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"},
                                                      {"model.layers.1.post_attention_layernorm.weight", "blk.1.ffn_norm.weight"}};
    EXPECT_EQ(g.tensors.size(), merged.tensors().size());
    for (const auto& [hf, name] : names) {
      SCOPED_TRACE(name);
      at::Tensor expected = merged.tensor(hf).to(at::kFloat);
      const bool query = name.find("attn_q") != std::string::npos, key = name.find("attn_k") != std::string::npos;
      if (query || key) {  // llama.cpp's rotary order, from its definition, row by row
        const std::int64_t head_dim = config["head_dim"], heads = expected.size(0) / head_dim;
        at::Tensor reordered = at::empty_like(expected);
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t i = 0; i < head_dim / 2; ++i) {
            reordered[h * head_dim + 2 * i] = expected[h * head_dim + i];
            reordered[h * head_dim + 2 * i + 1] = expected[h * head_dim + head_dim / 2 + i];
          }
        expected = reordered;
      }
      const at::Tensor got = g.values(name);
      ASSERT_EQ(got.sizes(), expected.sizes());
      const std::string wanted = name;  // (a structured binding cannot be captured before C++20)
      const auto t = std::find_if(g.tensors.begin(), g.tensors.end(), [&](const Gguf::Tensor& x) { return x.name == wanted; });
      if (expected.dim() == 1) {
        EXPECT_EQ(t->type, 0u);
        EXPECT_TRUE(at::equal(got, expected));
      } else if (type == "f16") {
        EXPECT_EQ(t->type, 1u);
        EXPECT_TRUE(at::allclose(got, expected, 1e-3, 1e-4));
      } else {
        EXPECT_EQ(t->type, 8u);
        // Half a step d = absmax / 127, and the fp16 rounding of d times at most 127.
        const at::Tensor step = expected.reshape({-1, 32}).abs().amax(1, true) / 127;
        EXPECT_TRUE(((got - expected).reshape({-1, 32}).abs() <= step * (0.5 + 127.0 / 2048) + 1e-7).all().item<bool>());
        EXPECT_GT((got - expected).abs().max().item<double>(), 0.0);  // quantized, not copied
      }
    }
    // Hugging Face's JS parser reads the same file alike (where the npm test data is here).
    const fs::path packages = fs::path(LOOM_TEST_DATA) / "npm";
    if (!fs::exists(packages / "huggingface-gguf-0.4.6/package") || std::system("command -v node > /dev/null") != 0) {
      std::cout << "[  NOTE    ] @huggingface/gguf or node is not here: the JS parser's check is left out\n";
      continue;
    }
    fs::create_directories(dir / "node_modules/@huggingface");
    std::error_code ec;
    fs::create_directory_symlink(packages / "huggingface-gguf-0.4.6/package", dir / "node_modules/@huggingface/gguf", ec);
    fs::create_directory_symlink(packages / "huggingface-tasks-0.21.54/package", dir / "node_modules/@huggingface/tasks", ec);
    const std::string command = "NODE_PATH=" + (dir / "node_modules").string() + " node " + (source_dir() / "tests/parity/gguf_read.js").string() + " " +
                                file.string() + " > " + (dir / "js.json").string();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const auto js = nlohmann::json::parse(read_file(dir / "js.json"));
    for (const auto& [k, v] : m.items()) {
      if (v.is_number_float()) EXPECT_NEAR(js["metadata"][k].get<double>(), v.get<double>(), 1e-6 * std::abs(v.get<double>())) << k;
      else EXPECT_EQ(js["metadata"][k], v) << k;
    }
    ASSERT_EQ(js["tensors"].size(), g.tensors.size());
    for (std::size_t i = 0; i < g.tensors.size(); ++i) {
      EXPECT_EQ(js["tensors"][i]["name"], g.tensors[i].name);
      EXPECT_EQ(js["tensors"][i]["dtype"], g.tensors[i].type);
      EXPECT_EQ(js["tensors"][i]["offset"], g.tensors[i].offset);
      EXPECT_EQ(js["tensors"][i]["shape"], nlohmann::json(g.tensors[i].dims));
    }
  }
}

TEST(Cli, PluginBugsAreInternalErrorsNamingThePlugin) {
  const fs::path dir = temp_dir();
  write_file(dir / "data.jsonl", "{\"text\": \"hello\"}\n{\"text\": \"world\"}\n");
  const auto pipeline = [&](const std::string& test_case, const std::string& collator) {
    write_file(dir / "p.toml", "[model]\nplugin = \"llama\"\ninit = \"random\"\nhidden_size = 32\nintermediate_size = 64\n"
                               "num_hidden_layers = 1\nnum_attention_heads = 2\nvocab_size = 300\n"
                               "[tokenizer]\nplugin = \"bytes\"\n[data]\ntrain = \"data.jsonl\"\n[placement]\nplugin = \"single\"\n"
                               "[train]\nmax_steps = 2\nbatch_size = 2\n[collator]\nplugin = \"" +
                                   collator + "\"\n[plugins]\npaths = [\"" + test_plugin_dir(test_case).string() + "\"]\n");
    return (dir / "p.toml").string();
  };
  auto r = run_loom({"validate", pipeline("factory_throws", "thrower")});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "loom: internal error: collator plugin 'thrower' 9.9.9 (" +
                                  (test_plugin_dir("factory_throws") / "test_plugin_factory_throws.so").string() +
                                  ") failed in its factory: cannot open /dev/gpu-that-does-not-exist\n"
                                  "This is a bug in that plugin, not a problem with your input")) << r.err;
  r = run_loom({"run", pipeline("collate_throws", "collate-thrower"), "--output", (dir / "run").string()});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "loom: internal error: collator plugin 'collate-thrower' 9.9.9 (")) << r.err;
  EXPECT_TRUE(contains(r.err, ") failed in collate(): vector::_M_range_check")) << r.err;
  // A full device is not the plugin's bug: one line saying where, LibTorch's message without its
  // backtrace, and what to do.
  write_file(dir / "data.jsonl", "{\"text\": \"out of memory\"}\n{\"text\": \"out of memory\"}\n");
  r = run_loom({"run", pipeline("collate_throws", "collate-thrower"), "--output", (dir / "oom").string()});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "loom: error: out of memory in collator plugin 'collate-thrower' 9.9.9, collate(): CUDA out of memory. Tried to allocate 2.00 GiB\n"
                              "The plan said this run fits")) << r.err;
  EXPECT_TRUE(contains(r.err, "lower [train] batch_size")) << r.err;
  EXPECT_FALSE(contains(r.err, "frame #")) << r.err;
}

// A final evaluation that fails (here a collator refuses the held-out samples it split during
// validation) costs the training nothing: the adapter, metrics, manifest and page are written
// first, and the run ends with one line and exit 2.
TEST(Cli, AFailingFinalEvaluationKeepsTheTrainedOutputs) {
  const fs::path dir = temp_dir();
  write_file(dir / "data.jsonl", "{\"text\": \"hello\"}\n{\"text\": \"world\"}\n");
  write_file(dir / "p.toml", "[model]\nplugin = \"llama\"\ninit = \"random\"\nhidden_size = 32\nintermediate_size = 64\n"
                             "num_hidden_layers = 1\nnum_attention_heads = 2\nvocab_size = 300\n"
                             "[tokenizer]\nplugin = \"bytes\"\n[data]\ntrain = \"data.jsonl\"\neval = \"data.jsonl\"\n[placement]\nplugin = \"single\"\n"
                             "[adapter]\nplugin = \"lora\"\nr = 4\n[train]\nmax_steps = 2\nbatch_size = 2\ncheckpoint_every = 0\n"
                             "[collator]\nplugin = \"eval-refuser\"\n[plugins]\npaths = [\"" +
                                 test_plugin_dir("eval_refuses").string() + "\"]\n");
  const auto r = run_loom({"run", (dir / "p.toml").string(), "--output", (dir / "run").string()});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "error: the final evaluation failed: the held-out samples changed since validation (test plugin)")) << r.err;
  EXPECT_TRUE(contains(r.err, "training finished and its outputs are written in " + (dir / "run").string())) << r.err;
  for (const char* output : {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "run.json", "metrics.jsonl", "report.html"})
    EXPECT_TRUE(fs::exists(dir / "run" / output)) << output;
  EXPECT_EQ(metrics_rows(dir / "run/metrics.jsonl", true).back()["step"], 2);
}

// docs/pipeline.md carries the generated reference; it must match the plugins as built.
TEST(Cli, PipelineReferenceInDocsIsCurrent) {
  const auto r = run_loom({"plugins", "reference"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string docs = read_file(source_dir() / "docs/pipeline.md");
  EXPECT_TRUE(contains(docs, r.out)) << "docs/pipeline.md is stale: regenerate its reference part with `loom plugins reference`";
}

}  // namespace
}  // namespace loom::test

namespace loom::test {
namespace {

// The plugin guide shows the out-of-tree example verbatim, so its code is known to compile.
TEST(Docs, PluginGuideShowsTheTestedExample) {
  const std::string guide = read_file(source_dir() / "docs/plugin-guide.md");
  const std::string code = read_file(source_dir() / "tests/external_plugin/last_device.cpp");
  EXPECT_NE(guide.find("```cpp\n" + code + "```"), std::string::npos) << "update docs/plugin-guide.md from last_device.cpp";
  const std::string family = read_file(source_dir() / "plugins/models/qwen3/qwen3_family.cpp");
  EXPECT_NE(guide.find("```cpp\n" + family + "```"), std::string::npos) << "update docs/plugin-guide.md from qwen3_family.cpp";
}

}  // namespace
}  // namespace loom::test
