// Pipeline parallelism: schedules as data (complete, matched, deadlock-free), stage cuts and their
// refusals, activation checkpointing, micro-batches the collator empties, and a launched pipeline
// killed and resumed. (Training over every schedule against one process: mesh_matrix_test.cpp.)
#include <gtest/gtest.h>

#include <tuple>

#include <signal.h>

#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "runtime/executor.hpp"
#include "loom/error.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/kit/schedule.hpp"
#include "loom/schedule.hpp"
#include "planner/planner.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;

TEST(PipelineSchedules, EveryScheduleIsCompleteMatchedAndDeadlockFree) {
  for (const std::string kind : {"gpipe", "1f1b", "interleaved-1f1b"})
    for (int ranks = 1; ranks <= 4; ++ranks)
      for (int per_rank : kind == "interleaved-1f1b" ? std::vector<int>{2, 3} : std::vector<int>{1})
        for (int micro = 1; micro <= 8; ++micro) {
          if (kind == "interleaved-1f1b" && micro % ranks != 0) continue;
          SCOPED_TRACE(kind + " ranks " + std::to_string(ranks) + " x " + std::to_string(per_rank) + ", micro-batches " + std::to_string(micro));
          const PipelineSchedule s = kit::make_schedule(kind, ranks, per_rank, micro);
          EXPECT_EQ(kit::check_schedule(s), "");
          ASSERT_EQ(s.stages, ranks * per_rank);
          const auto peak = kit::in_flight_per_stage(s);
          for (int st = 0; st < s.stages; ++st) {
            if (kind == "gpipe") {
              EXPECT_EQ(peak[static_cast<std::size_t>(st)], micro);
            } else if (kind == "1f1b") {
              EXPECT_EQ(peak[static_cast<std::size_t>(st)], std::min(ranks - st, micro)) << "stage " << st;
            }
            EXPECT_LE(peak[static_cast<std::size_t>(st)], micro);
          }
        }
  // 1F1B on 2 ranks: rank 0 runs one forward ahead, then alternates; rank 1 alternates at once.
  EXPECT_EQ(kit::schedule_timeline(kit::make_schedule("1f1b", 2, 1, 4)),
            "  rank 0: F0.0 F0.1 .    B0.0 F0.2 B0.1 F0.3 B0.2 .    B0.3\n"
            "  rank 1: .    F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3\n");
  EXPECT_THROW(kit::make_schedule("interleaved-1f1b", 2, 2, 3), UserError);
  // A careless mesh and grad_accum is refused, not planned for minutes.
  try {
    kit::make_schedule("1f1b", 1024, 1, 65536);
    ADD_FAILURE() << "planned 1024 x 65536";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("too large to plan"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kit::make_schedule("1f1b", 2, 2, 4), UserError);
}

// At the bound (2^18 stage and micro-batch pairs) a schedule is made and checked in seconds: it
// took minutes when each slot's transfers were ordered by walking every pair of ranks. (The test's
// timeout is what holds it; the seconds are in the closing note of issue 24.)
TEST(PipelineSchedules, TheLargestAllowedSchedulesArePlanned) {
  for (const auto& [kind, ranks, per_rank, micro] : std::vector<std::tuple<std::string, int, int, int>>{
           {"1f1b", 512, 1, 512}, {"gpipe", 256, 1, 1024}, {"interleaved-1f1b", 256, 2, 512}}) {
    SCOPED_TRACE(kind);
    const PipelineSchedule s = kit::make_schedule(kind, ranks, per_rank, micro);
    EXPECT_EQ(kit::check_schedule(s), "");
  }
}

TEST(PipelineSchedules, BrokenSchedulesAreFound) {
  PipelineSchedule s = kit::make_schedule("1f1b", 2, 1, 2);
  PipelineSchedule missing = s;
  missing.actions[1].erase(missing.actions[1].begin());
  EXPECT_NE(kit::check_schedule(missing).find("is missing"), std::string::npos) << kit::check_schedule(missing);
  // Backward before its forward on the last stage: nothing can run it.
  PipelineSchedule deadlock = s;
  auto& last = deadlock.actions[1];
  std::vector<StageAction> compute, rest;
  for (const auto& a : last) (a.op == StageOp::kForward || a.op == StageOp::kBackward ? compute : rest).push_back(a);
  std::swap(*std::find(last.begin(), last.end(), compute[0]), *std::find(last.begin(), last.end(), compute[1]));
  EXPECT_NE(kit::check_schedule(deadlock).find("deadlocks"), std::string::npos) << kit::check_schedule(deadlock);
  // Two ranks listing their transfers in different orders would hang NCCL's in-order channels.
  PipelineSchedule crossed = kit::make_schedule("1f1b", 2, 1, 4);
  auto& r0 = crossed.actions[0];
  std::vector<std::size_t> transfers;
  for (std::size_t i = 0; i < r0.size(); ++i)
    if (r0[i].op != StageOp::kForward && r0[i].op != StageOp::kBackward) transfers.push_back(i);
  std::swap(r0[transfers[0]], r0[transfers[1]]);
  EXPECT_NE(kit::check_schedule(crossed), "");
}

// An 8B shape over two pipeline ranks (1F1B, 8 micro-batches of 1 x 1024, fp16 LoRA): stage 0
// keeps two micro-batches in flight, stage 1 one, so where memory is short the cut moves towards
// the first stage's favour instead of the even compute split; too little is refused with numbers.
TEST(PipelinePlacement, CutsBalanceComputeUnderEachStagesMemory) {
  PlacementRequest r;
  r.model = llama_from_config(R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256})")->structure();
  r.dtype = DType::kFloat16;
  r.batch_size = 1;
  r.seq_len = 1024;
  r.micro_batches = 8;
  r.mesh.pipeline = 2;
  r.adapter_trainable.assign(r.model.blocks.size(), 0);
  for (std::size_t i = 1; i + 2 < r.model.blocks.size(); ++i) r.adapter_trainable[i] = 16 * 8192 * 4;
  const auto plan_with = [&](const std::string& gpu) {
    r.ranks = {core::parse_inventory("cuda:0=" + gpu + ",cpu=64GiB"), core::parse_inventory("cuda:0=" + gpu + ",cpu=64GiB")};
    return make_plugin<Placement>("placement", "pipeline", {{"schedule", std::string("1f1b")}})->plan(r);
  };
  const auto first_stage_blocks = [](const Plan& p) {
    std::size_t n = 0;
    for (const auto& b : p.blocks) n += b.stage == 0 ? 1 : 0;
    return n;
  };
  const Plan roomy = plan_with("141GiB"), tight = plan_with("13GiB");
  EXPECT_EQ(roomy.schedule.name, "1f1b");
  EXPECT_EQ(kit::in_flight_per_stage(roomy.schedule), (std::vector<int>{2, 1}));
  EXPECT_LT(first_stage_blocks(tight), first_stage_blocks(roomy));
  for (const auto& d : tight.devices) EXPECT_LE(d.total(), 12ull << 30) << "rank " << d.rank;  // 13 GiB less the 1 GiB reserve
  // The compute split of the roomy plan would not have fitted.
  EXPECT_GT(roomy.devices[0].total(), 12ull << 30);
  try {
    plan_with("8GiB");
    ADD_FAILURE() << "an 8 GiB pair of GPUs cannot hold an 8B model";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("2 micro-batch(es) in flight) on rank 0 cuda:0 needs"), std::string::npos) << e.what();
  }
}

// Every option mistake is one clear error naming what to change.
TEST(PipelinePlacement, BadOptionsAreClearErrors) {
  PlacementRequest r;
  r.model = llama_from_config(R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256})")->structure();
  r.micro_batches = 4;
  r.mesh.pipeline = 2;
  r.ranks = {core::parse_inventory("cpu=8GiB"), core::parse_inventory("cpu=8GiB")};
  const auto refusal = [&](std::map<std::string, OptionValue> options) -> std::string {
    try {
      make_plugin<Placement>("placement", "pipeline", options)->plan(r);
    } catch (const UserError& e) {
      return e.what();
    }
    return "(planned)";
  };
  EXPECT_NE(refusal({{"cuts", StringList{"layers.9"}}}).find("cuts names 'layers.9', which is not a block of this model"), std::string::npos);
  EXPECT_NE(refusal({{"cuts", StringList{"layers.2", "layers.1", "norm"}}, {"schedule", std::string("interleaved-1f1b")}})
                .find("cuts must name blocks in model order"),
            std::string::npos);
  EXPECT_NE(refusal({{"cuts", StringList{"layers.1", "layers.2"}}}).find("cuts makes 3 stages; 2 pipeline ranks with stages_per_rank = 1 need 2"),
            std::string::npos);
  EXPECT_NE(refusal({{"stages", std::int64_t{3}}}).find("each rank runs the same number of stages"), std::string::npos);
  EXPECT_NE(refusal({{"stages", std::int64_t{40}}}).find("stages"), std::string::npos);
  EXPECT_NE(refusal({{"schedule", std::string("1f1b")}, {"stages_per_rank", std::int64_t{2}}}).find("use schedule = \"interleaved-1f1b\""),
            std::string::npos);
  EXPECT_NE(refusal({{"device", std::string("cuda:3")}}).find("device = \"cuda:3\" is not among a rank's devices (cpu)"), std::string::npos);
  r.micro_batches = 3;
  EXPECT_NE(refusal({{"schedule", std::string("interleaved-1f1b")}}).find("use a multiple of 2"), std::string::npos);
  // Manual cuts that are fine plan where they say.
  r.micro_batches = 4;
  const Plan manual = make_plugin<Placement>("placement", "pipeline", {{"cuts", StringList{"layers.3"}}})->plan(r);
  const std::set<std::string> first{"embed", "layers.0", "layers.1", "layers.2"};
  for (const auto& b : manual.blocks) EXPECT_EQ(b.stage, first.count(b.block) ? 0 : 1) << b.block;
}

// A model that counts how often each block runs.
class Counting final : public LoadedModel {
 public:
  explicit Counting(std::unique_ptr<LoadedModel> inner) : inner_(std::move(inner)) {}
  std::size_t block_count() const override { return inner_->block_count(); }
  void forward(std::size_t index, ForwardState& state) override {
    ++calls[index];
    inner_->forward(index, state);
  }
  at::Tensor loss_sum(const at::Tensor& out, const at::Tensor& labels) override { return inner_->loss_sum(out, labels); }
  at::Tensor logits(const at::Tensor& out) override { return inner_->logits(out); }
  std::vector<NamedParameter> parameters() override { return inner_->parameters(); }
  std::vector<NamedLinear> linears() override { return inner_->linears(); }
  void set_training(bool training) override { inner_->set_training(training); }
  void save_pretrained(const fs::path& dir) override { inner_->save_pretrained(dir); }
  std::map<std::size_t, int> calls;

 private:
  std::unique_ptr<LoadedModel> inner_;
};

// A checkpointed layer runs twice (forward, then again in backward) and gives the gradients
// keeping its activations gives.
TEST(ActivationCheckpointing, RecomputesTheLayerAndGivesTheSameGradients) {
  const auto model = make_plugin<Model>("model", "llama",
                                        {{"init", std::string("random")}, {"hidden_size", std::int64_t{32}}, {"intermediate_size", std::int64_t{64}},
                                         {"num_hidden_layers", std::int64_t{2}}, {"num_attention_heads", std::int64_t{4}},
                                         {"num_key_value_heads", std::int64_t{2}}, {"vocab_size", std::int64_t{64}}});
  ASSERT_TRUE(model);
  LoadRequest request;
  request.block_devices.assign(5, c10::Device(c10::kCPU));
  request.seed = 3;
  const at::Tensor ids = at::randint(0, 64, {2, 8}, at::kLong);
  const at::Tensor positions = at::arange(8, at::kLong).repeat({2, 1});
  const at::Tensor mask = at::ones({2, 8}, at::kLong);
  std::vector<std::map<std::string, at::Tensor>> grads;
  std::vector<std::map<std::size_t, int>> calls;
  for (bool checkpointed : {false, true}) {
    auto counting = std::make_unique<Counting>(model->load(request));
    Counting* seen = counting.get();
    core::Executor executor(std::move(counting), request.block_devices);
    if (checkpointed) executor.set_checkpointed({false, true, true, false, false});
    for (auto& p : executor.model().parameters()) p.tensor.set_requires_grad(true);
    torch::autograd::backward({executor.loss_sum(executor.head_output(ids, positions, mask), ids)});
    std::map<std::string, at::Tensor> g;
    for (auto& p : executor.model().parameters()) g[p.name] = p.tensor.grad().clone();
    grads.push_back(g);
    calls.push_back(seen->calls);
  }
  EXPECT_EQ(calls[0], (std::map<std::size_t, int>{{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}}));
  EXPECT_EQ(calls[1], (std::map<std::size_t, int>{{0, 1}, {1, 2}, {2, 2}, {3, 1}, {4, 1}}));
  for (const auto& [name, g] : grads[0]) EXPECT_TRUE(at::allclose(grads[1].at(name), g, 1e-5, 1e-7)) << name;
}

const std::string kSingle = "[placement]\nplugin = \"single\"\n";
const std::string kLora = "[adapter]\nplugin = \"lora\"\nr = 8\nalpha = 16\ntarget_modules = \"all-linear\"\ndropout = 0.0\n";
const std::string kLoraWithEmbedding = kLora + "modules_to_save = [\"embed_tokens\"]\n";

std::string pipeline_placement(const std::string& schedule) { return "[placement]\nplugin = \"pipeline\"\nschedule = \"" + schedule + "\"\n"; }

// (Every schedule over 2 and 4 ranks, with and without activation checkpointing, tied and untied,
// LoRA and full, against one process: mesh_matrix_test.cpp.)

// Activation checkpointing on one process (any placement) changes memory, not the numbers.
TEST(PipelineParallel, CheckpointingOnOneProcessKeepsTheLosses) {
  const fs::path dir = temp_dir();
  const std::string train = "max_steps = 10\nbatch_size = 4\n";
  const std::string lora_dropout = "[adapter]\nplugin = \"lora\"\nr = 8\nalpha = 16\ntarget_modules = \"all-linear\"\ndropout = 0.1\n";
  const auto plain = run_loom({"run", copy_task_pipeline(dir / "a", 2, true, kSingle, lora_dropout, train).string(), "--output", (dir / "plain").string()});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const auto checkpointed = run_loom({"run", copy_task_pipeline(dir / "b", 2, true, kSingle, lora_dropout, train + "activation_checkpointing = \"every-layer\"\n").string(),
                                      "--output", (dir / "ckpt").string()});
  ASSERT_EQ(checkpointed.exit_code, 0) << checkpointed.err;
  // Dropout is replayed in the recomputation: the same numbers, not just close ones.
  expect_same_losses(dir / "ckpt/metrics.jsonl", dir / "plain/metrics.jsonl", 1e-6);
  // Inputs kept until backward through the offload's chain (on the CPU they stay where they are).
  const auto offloaded = run_loom({"run", copy_task_pipeline(dir / "d", 2, true, kSingle, lora_dropout, train + "activation_checkpointing = \"offload\"\n").string(),
                                   "--output", (dir / "offload").string()});
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.err;
  expect_same_losses(dir / "offload/metrics.jsonl", dir / "plain/metrics.jsonl", 1e-6);
  const auto bad = run_loom({"validate", copy_task_pipeline(dir / "c", 2, true, kSingle, kLora, train + "activation_checkpointing = \"sometimes\"\n").string()});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("p.toml:"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("[train] activation_checkpointing = \"sometimes\": use \"none\", \"every-layer\", \"offload\" or \"every-N\""), std::string::npos) << bad.err;
}

// Micro-batches the collator empties (every sample too long under truncation = "drop") still run
// through the schedule, labelling nothing, so the step equals one process that skipped them.
TEST(PipelineParallel, EmptiedMicroBatchesTrainAsOneProcess) {
  const fs::path dir = temp_dir();
  std::string data;
  const char* words[] = {"ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"};
  for (int i = 0; i < 48; ++i) {
    const std::string w = i % 5 == 3 ? std::string(40, 'z') : std::string(words[i % 8]) + words[(i / 8) % 8];
    data += "{\"q\": \"" + w + "\", \"a\": \"" + w + "\"}\n";
  }
  const std::string train = "max_steps = 12\nbatch_size = 1\ngrad_accum = 4\n";
  const auto one_p = copy_task_pipeline(dir / "a", 2, true, kSingle, kLora, train, "");
  const auto pp_p = copy_task_pipeline(dir / "b", 2, true, pipeline_placement("1f1b"), kLora, train, "[parallel]\npipeline = 2\n");
  for (const auto& d : {dir / "a", dir / "b"}) write_file(d / "train.jsonl", data);
  const auto one = run_loom({"run", one_p.string(), "--output", (dir / "one").string(), "--set", "data.truncation=\"drop\""});
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const auto pp = run_loom_ranks({"run", pp_p.string(), "--output", (dir / "pp").string(), "--set", "data.truncation=\"drop\""}, 2);
  ASSERT_EQ(pp.exit_code, 0) << pp.out << pp.err;
  expect_same_losses(dir / "pp/metrics.jsonl", dir / "one/metrics.jsonl", 1e-5);
  EXPECT_GT(metrics_rows(dir / "pp/metrics.jsonl", true).back()["skipped_samples"].get<int>(), 0);
}

// A pipeline run killed after a checkpoint and resumed logs the losses of an uninterrupted run.
TEST(PipelineParallel, ResumeAfterSigkillEqualsAnUninterruptedRun) {
  const fs::path dir = temp_dir();
  const auto pipeline = copy_task_pipeline(dir, 2, true, pipeline_placement("1f1b"), kLoraWithEmbedding,
                             "max_steps = 40\ncheckpoint_every = 10\nbatch_size = 2\ngrad_accum = 2\n", "[parallel]\npipeline = 2\n");
  const auto whole = run_loom_process({"run", pipeline.string(), "--output", (dir / "whole").string(), "--nproc-per-node", "2"});
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  EXPECT_EQ(kill_rank_one_after_checkpoint(pipeline, dir / "killed"), 128 + SIGKILL);
  ASSERT_LT(metrics_rows(dir / "killed/metrics.jsonl", true).size(), 40u) << "the run finished before it could be killed";
  // The checkpoint holds the whole adapter, gathered from both stages: the very bytes the
  // uninterrupted run's checkpoint of that step holds.
  const std::string latest = read_file(dir / "killed/checkpoints/latest").substr(0, 13);
  EXPECT_EQ(read_file(dir / "killed/checkpoints" / latest / "adapter/adapter_model.safetensors"),
            read_file(dir / "whole/checkpoints" / latest / "adapter/adapter_model.safetensors"));
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, t] : tensors_of(dir / "killed/checkpoints" / latest / "adapter")) shapes[name] = t.sizes().vec();
  EXPECT_EQ(shapes, copy_task_adapter_shapes(2, 8, true));
  const auto resumed = run_loom_process({"run", pipeline.string(), "--output", (dir / "killed").string(), "--resume", "--nproc-per-node", "2"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(metrics_rows(dir / "killed/metrics.jsonl", false), metrics_rows(dir / "whole/metrics.jsonl", false));
  EXPECT_EQ(read_file(dir / "killed/adapter/adapter_model.safetensors"), read_file(dir / "whole/adapter/adapter_model.safetensors"));
}

// `loom plan` shows each rank's stages and the schedule's timeline; a stage that cannot fit is
// refused before any weight loads, with its numbers and what would help; a pipeline axis needs
// the pipeline placement.
TEST(PipelineParallel, PlanShowsStagesAndRefusesWhatDoesNotFit) {
  const fs::path dir = temp_dir();
  const auto pipeline = copy_task_pipeline(dir, 4, true, pipeline_placement("gpipe"), kLora, "batch_size = 2\ngrad_accum = 4\n", "[parallel]\npipeline = 2\n");
  const auto plan = run_loom({"plan", pipeline.string(), "--devices", "cpu=64GiB", "--nproc-per-node", "2"});
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_NE(plan.out.find("schedule: gpipe, 2 stages, 4 micro-batches per step"), std::string::npos) << plan.out;
  EXPECT_NE(plan.out.find("  rank 0: F0.0 F0.1 F0.2 F0.3"), std::string::npos) << plan.out;
  EXPECT_NE(plan.out.find("stage 1: layers."), std::string::npos) << plan.out;
  const auto json = run_loom({"plan", pipeline.string(), "--devices", "cpu=64GiB", "--nproc-per-node", "2", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["schedule"]["in_flight"], nlohmann::json::array({4, 4}));
  EXPECT_EQ(j["blocks"].back()["stage"], 1);

  const auto tiny = run_loom({"plan", pipeline.string(), "--devices", "cpu=3MiB", "--nproc-per-node", "2", "--set", "data.max_length=256",
                              "--set", "train.batch_size=8"});
  EXPECT_EQ(tiny.exit_code, 2) << tiny.out;
  EXPECT_NE(tiny.err.find("micro-batch(es) in flight) on rank "), std::string::npos) << tiny.err;
  EXPECT_NE(tiny.err.find("usable; it would help to use fewer samples per micro-batch"), std::string::npos) << tiny.err;
  EXPECT_NE(tiny.err.find("schedule = \"1f1b\""), std::string::npos) << tiny.err;

  const auto alone = run_loom({"run", pipeline.string(), "--output", (dir / "alone").string()});
  EXPECT_EQ(alone.exit_code, 2);
  EXPECT_NE(alone.err.find("does not divide the 1 processes of this run; launch a multiple of 2 processes (loom run --nproc-per-node 2"),
            std::string::npos)
      << alone.err;
  const auto wrong = run_loom({"plan", copy_task_pipeline(dir / "w", 2, true, kSingle, kLora, "", "[parallel]\npipeline = 2\n").string(), "--nproc-per-node", "2"});
  EXPECT_EQ(wrong.exit_code, 2);
  EXPECT_NE(wrong.err.find("[parallel] pipeline = 2 needs a placement that runs a pipeline schedule"), std::string::npos) << wrong.err;
  EXPECT_NE(wrong.err.find("use [placement] plugin = \"pipeline\""), std::string::npos) << wrong.err;
}

}  // namespace
}  // namespace loom::test
