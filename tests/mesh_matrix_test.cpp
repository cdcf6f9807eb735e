// Every mesh trains as one process: pipeline schedules (GPipe, 1F1B, interleaved 1F1B) over 2 and 4
// ranks with and without activation checkpointing, tensor parallelism over 2 and 4 ranks (and with
// checkpointing), data parallelism over 2 and 4 ranks, and data x pipeline, tensor x data and
// tensor x pipeline meshes, each against one one-process reference per model variant (tied or
// untied embeddings, LoRA or full fine-tuning). The ranks run as threads of the test process over
// real Gloo groups (run_loom_ranks); LauncherRunsWhatThreadsRun shows that a launch computes the
// same numbers, so the threads stand for processes.
#include <gtest/gtest.h>

#include <map>

#include <nlohmann/json.hpp>

#include "loom/kit/safetensors.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;

const std::string kSingle = "[placement]\nplugin = \"single\"\n";
const std::string kTensorPlacement = "[placement]\nplugin = \"tensor-parallel\"\n";
const std::string kLora = "[adapter]\nplugin = \"lora\"\nr = 8\nalpha = 16\ntarget_modules = \"all-linear\"\ndropout = 0.0\n";
const std::string kLoraWithEmbedding = kLora + "modules_to_save = [\"embed_tokens\"]\n";
const std::string kSteps = "max_steps = 20\n";
std::string batches(int batch, int accum) { return "batch_size = " + std::to_string(batch) + "\ngrad_accum = " + std::to_string(accum) + "\n"; }

// The two one-process references every layout is held to. Both take 8 samples a step. Pipeline
// schedules need blocks and micro-batches to spread: 6 decoder layers (9 blocks, room for 4 ranks
// x 2 stages), 4 micro-batches of 2. The other layouts split every layer's products or the batch,
// and each split product is a collective: 2 layers, one micro-batch of 8, keep them few.
struct Reference {
  int layers;
  std::string train;
};
const Reference kStaged{6, batches(2, 4)};
const Reference kWhole{2, batches(8, 1)};

struct Variant {
  bool tied, lora;
};
void PrintTo(const Variant& v, std::ostream* out) { *out << (v.tied ? "tied" : "untied") << ", " << (v.lora ? "LoRA" : "full"); }

struct Layout {
  std::string name;
  const Reference* reference;
  Mesh mesh;
  std::string placement, parallel, train;  // train: this layout's batch (per data rank) and micro-batches
  std::string schedule;                    // the pipeline schedule the plan names, or ""
  int micro_batches;                       // a schedule's micro-batches per step
  // The saved adapter or model against one process's. Pipeline stages compute what one process
  // computes in the same order: every element within this fraction (1e-4: the eval's rounding) of
  // the tensor's largest. Split products and data ranks sum in another order: the difference's
  // norm within this fraction of the tensor's (kReorderedNorm, test_support.hpp, says why; the
  // gradients themselves: TensorParallel.GradientsEqualOneDevice, 1e-5).
  double tensor_tolerance;
};

std::string pipeline_placement(const std::string& schedule) {
  return "[placement]\nplugin = \"pipeline\"\nschedule = \"" + schedule + "\"\n" + (schedule == "interleaved-1f1b" ? "stages_per_rank = 2\n" : "");
}

std::vector<Layout> layouts(bool lora) {
  std::vector<Layout> out;
  const std::string recompute = lora ? "every-layer" : "every-2";
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved-1f1b"})
    for (int ranks : {2, 4})
      for (const std::string checkpointing : {"none", recompute.c_str()})
        out.push_back({"pipeline " + schedule + " over " + std::to_string(ranks) + " ranks, activation_checkpointing " + checkpointing, &kStaged,
                       Mesh{1, ranks, 1}, pipeline_placement(schedule), "[parallel]\npipeline = " + std::to_string(ranks) + "\n",
                       kStaged.train + "activation_checkpointing = \"" + checkpointing + "\"\n", schedule, 4, 1e-4});
  for (int ranks : {2, 4})
    out.push_back({"tensor " + std::to_string(ranks), &kWhole, Mesh{1, 1, ranks}, kTensorPlacement, "[parallel]\ntensor = " + std::to_string(ranks) + "\n",
                   kWhole.train, "", 0, kReorderedNorm});
  out.push_back({"tensor 2, activation_checkpointing every-layer", &kWhole, Mesh{1, 1, 2}, kTensorPlacement, "[parallel]\ntensor = 2\n",
                 kWhole.train + "activation_checkpointing = \"every-layer\"\n", "", 0, kReorderedNorm});
  out.push_back({"data 2, 2 micro-batches of 2 each", &kWhole, Mesh{2, 1, 1}, kSingle, "", batches(2, 2), "", 0, kReorderedNorm});
  out.push_back({"data 4", &kWhole, Mesh{4, 1, 1}, kSingle, "", batches(2, 1), "", 0, kReorderedNorm});
  out.push_back({"pipeline 2 x data 2", &kWhole, Mesh{2, 2, 1}, pipeline_placement("1f1b"), "[parallel]\npipeline = 2\n", batches(2, 2), "1f1b", 2,
                 kReorderedNorm});
  out.push_back({"tensor 2 x data 2", &kWhole, Mesh{2, 1, 2}, kTensorPlacement, "[parallel]\ntensor = 2\n", batches(4, 1), "", 0, kReorderedNorm});
  out.push_back({"tensor 2 x pipeline 2", &kWhole, Mesh{1, 2, 2}, pipeline_placement("1f1b"), "[parallel]\ntensor = 2\npipeline = 2\n", batches(4, 2),
                 "1f1b", 2, kReorderedNorm});
  return out;
}

class EveryMesh : public ::testing::TestWithParam<Variant> {};

// 20 steps on every layout equal one process with the same 8 samples a step: the training losses
// within 1e-5 relative step by step (1e-4 over data ranks) and falling, the eval loss within 1e-5, the exact-match
// (greedy generation through the stages or from the gathered logits), the plan's mesh, strategy
// and schedule in run.json, and the saved adapter (keys, shapes, values) or model (a full
// fine-tune under a pipeline: one shard per stage rank and an index, the tied copy kept once).
TEST_P(EveryMesh, TrainsAsOneProcess) {
  const Variant v = GetParam();
  const std::string adapter = v.lora ? (v.tied ? kLoraWithEmbedding : kLora) : "";
  const fs::path dir = temp_dir();
  std::map<const Reference*, fs::path> one;
  for (const Reference* reference : {&kStaged, &kWhole}) {
    const fs::path out = dir / ("one-" + std::to_string(reference->layers));
    const auto r = run_loom({"run", copy_task_pipeline(out.string() + "-p", reference->layers, v.tied, kSingle, adapter, kSteps + reference->train).string(),
                             "--output", out.string()});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    one[reference] = out;
  }
  int index = 0;
  for (const Layout& layout : layouts(v.lora)) {
    SCOPED_TRACE(layout.name);
    const fs::path out = dir / ("layout-" + std::to_string(index)), reference = one.at(layout.reference);
    const auto p = copy_task_pipeline(dir / ("layout-p-" + std::to_string(index++)), layout.reference->layers, v.tied, layout.placement, adapter,
                                      kSteps + layout.train, layout.parallel);
    // Every layout also checks, after each step, that the copies ranks hold whole stayed equal.
    const auto r = run_loom_ranks({"run", p.string(), "--output", out.string(), "--set", "run.check_replicas=true"}, layout.mesh.world());
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    // Data ranks sum each step's gradient in another order (their parts, then over the ranks), and
    // AdamW's normalised steps carry that rounding forward: with the embedding trained too it
    // reaches ~1.3e-5 of the loss by step 14. Tensor ranks sum split products in another order:
    // equal at step 1, 1e-6 at step 2, up to 1.2e-5 by step 14 with the embedding trained (LoRA's
    // delta accumulated inside its product). A lost or doubled share moves it by whole percents.
    expect_same_losses(out / "metrics.jsonl", reference / "metrics.jsonl", layout.mesh.data > 1 ? 1e-4 : layout.mesh.tensor > 1 ? 3e-5 : 1e-5);
    const auto mine = last_eval(out / "metrics.jsonl"), theirs = last_eval(reference / "metrics.jsonl");
    EXPECT_NEAR(mine["eval_loss"].get<double>(), theirs["eval_loss"].get<double>(), 1e-5 * theirs["eval_loss"].get<double>());
    EXPECT_EQ(mine["exact_match"], theirs["exact_match"]);
    EXPECT_EQ(mine["eval_samples"], 12);
    const auto plan = nlohmann::json::parse(read_file(out / "run.json"))["plan"];
    EXPECT_EQ(plan["mesh"]["data"], layout.mesh.data);
    EXPECT_EQ(plan["mesh"]["pipeline"], layout.mesh.pipeline);
    EXPECT_EQ(plan["mesh"]["tensor"], layout.mesh.tensor);
    EXPECT_EQ(plan["ranks"].size(), static_cast<std::size_t>(layout.mesh.world()));
    if (layout.mesh.tensor > 1 && layout.schedule.empty()) {
      EXPECT_EQ(plan["strategy"], "tensor-parallel");
    }
    if (!layout.schedule.empty()) {
      EXPECT_EQ(plan["schedule"]["name"], layout.schedule);
      EXPECT_EQ(plan["schedule"]["micro_batches"], layout.micro_batches);
    }
    const bool same_order = layout.mesh.data == 1 && layout.mesh.tensor == 1;
    const auto expect_trained_alike = [&](const fs::path& a, const fs::path& b) {
      same_order ? expect_same_tensors(a, b, layout.tensor_tolerance) : expect_close_in_norm(a, b, layout.tensor_tolerance);
    };
    if (v.lora) {
      expect_trained_alike(out / "adapter", reference / "adapter");
      EXPECT_EQ(nlohmann::json::parse(read_file(out / "adapter/adapter_config.json"))["target_modules"],
                nlohmann::json::parse(read_file(reference / "adapter/adapter_config.json"))["target_modules"]);
    } else {
      if (layout.mesh.pipeline > 1) {
        EXPECT_TRUE(fs::exists(out / "model/model.safetensors.index.json"));
      }
      expect_trained_alike(out / "model", reference / "model");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(MeshMatrix, EveryMesh,
                         ::testing::Values(Variant{true, true}, Variant{true, false}, Variant{false, true}, Variant{false, false}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return std::string(info.param.tied ? "tied" : "untied") + "_" + (info.param.lora ? "lora" : "full");
                         });

// A copy-task run for the family tests below: `layers` layers (every even one a sliding layer of
// 4 when `windowed`), every replica checked after each step, `sets` more --set overrides; `world`
// ranks as threads.
struct FamilyRun {
  fs::path dir;
  bool tied = false, windowed = false;
  std::vector<std::string> sets;
  fs::path operator()(const std::string& name, int layers, const std::string& placement, const std::string& adapter, const std::string& train,
                      const std::string& parallel, int world, const std::vector<std::string>& more = {}) const {
    const fs::path out = dir / name;
    std::vector<std::string> args{"run", copy_task_pipeline(dir / (name + "-p"), layers, tied, placement, adapter, train, parallel).string(),
                                  "--output", out.string(), "--set", "run.check_replicas=true"};
    if (windowed) {
      std::string kinds;
      for (int i = 0; i < layers; ++i) kinds += std::string(i ? ", " : "") + (i % 2 == 0 ? "\"sliding_attention\"" : "\"full_attention\"");
      args.insert(args.end(), {"--set", "model.sliding_window=4", "--set", "model.layer_types=[" + kinds + "]"});
    }
    for (const auto* extra : {&sets, &more}) args.insert(args.end(), extra->begin(), extra->end());
    const auto r = world > 1 ? run_loom_ranks(args, world) : run_loom(args);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return out;
  }
};
const std::string kRecompute = kStaged.train + "activation_checkpointing = \"every-layer\"\n";

// The rest of a family's strategy matrix: data 2 equals `whole` (a full fine-tune of `steps`),
// packed rows equal padded ones (LoRA), and QLoRA over tensor 2 equals it in one process: each rank
// quantizes its own part of every split linear (blocks of 16 without double quantization, so its
// blocks are the whole's; a fused qkv_proj's part is its part of q, of k and of v).
void expect_data_packing_and_qlora_tensor(const FamilyRun& run, const std::string& steps, const fs::path& whole) {
  const fs::path data = run("matrix-data", 2, kSingle, "", steps + batches(4, 1), "[parallel]\ndata = 2\n", 2);
  const fs::path padded = run("matrix-padded", 2, kSingle, kLora, steps + batches(2, 4), "", 1);
  const fs::path packed = run("matrix-packed", 2, kSingle, kLora, steps + batches(2, 4), "", 1, {"--set", "data.packing=true"});
  const std::string qlora = "[adapter]\nplugin = \"qlora\"\nr = 8\nalpha = 16\ntarget_modules = \"all-linear\"\ndropout = 0.0\nblocksize = 16\n"
                            "double_quant = false\n";
  const fs::path four_bit = run("matrix-qlora", 2, kSingle, qlora, steps + kWhole.train, "", 1);
  const fs::path four_bit_tensor = run("matrix-qlora-tensor", 2, kTensorPlacement, qlora, steps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  ASSERT_FALSE(::testing::Test::HasFailure());
  SCOPED_TRACE("data 2, packed rows, QLoRA over tensor 2");
  expect_same_losses(data / "metrics.jsonl", whole / "metrics.jsonl", 1e-4);
  expect_same_losses(packed / "metrics.jsonl", padded / "metrics.jsonl", 1e-5);
  expect_same_losses(four_bit_tensor / "metrics.jsonl", four_bit / "metrics.jsonl", 1e-5);
  // The same codes and scales, summed in another order: AdamW turns the rounding of lora_B's
  // near-zero gradients into whole steps.
  expect_close_in_norm(four_bit_tensor / "adapter", four_bit / "adapter", kReorderedNorm);
}

// Qwen3 (per-head q/k norms, which every tensor rank applies whole to its own heads) trains under
// the strategies as one process does, with no strategy code in the family: a full fine-tune over
// tensor 2 with every replicated copy checked after each step (the q/k norms included); LoRA over
// a 1F1B pipeline of 2 with every layer recomputed; QLoRA in one process learns. (The q/k norms'
// gradient over tensor ranks against one device: TensorParallel.GradientsEqualOneDevice.)
TEST(MeshMatrix, Qwen3TrainsAsOneProcess) {
  const fs::path dir = temp_dir();
  const FamilyRun run{dir, false, false, {"--set", "model.plugin=qwen3"}};
  const fs::path whole = run("whole", 2, kSingle, "", kSteps + kWhole.train, "", 1);
  const fs::path tensor = run("tensor", 2, kTensorPlacement, "", kSteps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  const auto config = nlohmann::json::parse(read_file(whole / "model/config.json"));
  EXPECT_EQ(config["architectures"][0], "Qwen3ForCausalLM");
  const kit::SafetensorsFile saved(whole / "model/model.safetensors");
  const auto* k_norm = saved.find("model.layers.1.self_attn.k_norm.weight");
  ASSERT_NE(k_norm, nullptr) << "the saved Qwen3 model has no k_norm";
  EXPECT_EQ(k_norm->shape, std::vector<std::int64_t>{8});  // head_dim
  expect_same_losses(tensor / "metrics.jsonl", whole / "metrics.jsonl", 1e-5);
  expect_close_in_norm(tensor / "model", whole / "model", kReorderedNorm);

  const fs::path staged = run("staged", 4, kSingle, kLora, kSteps + kRecompute, "", 1);
  const fs::path pipeline = run("pipeline", 4, pipeline_placement("1f1b"), kLora, kSteps + kRecompute, "[parallel]\npipeline = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  expect_same_losses(pipeline / "metrics.jsonl", staged / "metrics.jsonl", 1e-5);
  expect_same_tensors(pipeline / "adapter", staged / "adapter", 1e-4);

  const fs::path four_bit = run("qlora", 2, kSingle,
                                "[adapter]\nplugin = \"qlora\"\nr = 8\nalpha = 16\ndropout = 0.0\ntarget_modules = \"all-linear\"\n"
                                "modules_to_save = [\"embed_tokens\"]\n",
                                kSteps + kWhole.train, "", 1, {"--set", "train.lr=2e-2"});
  ASSERT_FALSE(HasFailure());
  const auto rows = metrics_rows(four_bit / "metrics.jsonl", true);
  ASSERT_FALSE(rows.empty());
  // On this random base LoRA itself falls ~8% in 20 steps (5.56 to 5.12); an update that never lands leaves it flat.
  EXPECT_LT(rows.back()["loss"].get<double>(), 0.95 * rows.front()["loss"].get<double>()) << "QLoRA did not learn";
  EXPECT_TRUE(contains(read_file(four_bit / "adapter/adapter_config.json"), "\"q_proj\"")) << "qlora adapted no linear";
  expect_data_packing_and_qlora_tensor(run, kSteps, whole);
}

// Sliding windows (a window of 4 on every other layer, shorter than the 11 to 31 tokens of the
// samples) train under the strategies as one process does: the losses differ from the same model
// without windows (the window matters), and tensor 2 (full fine-tune, every replica checked), a
// 1F1B pipeline of 2 (LoRA, every layer recomputed), data 2 and packed rows each give one
// process's losses, eval loss and exact-match (generation through a sliding layer's ring).
TEST(MeshMatrix, SlidingWindowsTrainAsOneProcess) {
  const fs::path dir = temp_dir();
  const FamilyRun run{dir, false, true, {}}, global{dir, false, false, {}};
  const auto same_eval = [](const fs::path& mine, const fs::path& theirs) {
    const auto a = last_eval(mine / "metrics.jsonl"), b = last_eval(theirs / "metrics.jsonl");
    EXPECT_NEAR(a["eval_loss"].get<double>(), b["eval_loss"].get<double>(), 1e-5 * b["eval_loss"].get<double>());
    EXPECT_EQ(a["exact_match"], b["exact_match"]);
  };
  const fs::path whole = run("whole", 2, kSingle, "", kSteps + kWhole.train, "", 1);
  const fs::path unwindowed = global("global", 2, kSingle, "", kSteps + kWhole.train, "", 1);
  const fs::path tensor = run("tensor", 2, kTensorPlacement, "", kSteps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  const fs::path data = run("data", 2, kSingle, "", kSteps + batches(4, 1), "[parallel]\ndata = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  const auto first_loss = [](const fs::path& out) { return metrics_rows(out / "metrics.jsonl", true).front()["loss"].get<double>(); };
  EXPECT_GT(std::abs(first_loss(whole) - first_loss(unwindowed)), 1e-4 * first_loss(unwindowed)) << "the window changes nothing";
  EXPECT_EQ(nlohmann::json::parse(read_file(whole / "model/config.json"))["layer_types"],
            nlohmann::json({"sliding_attention", "full_attention"}));
  expect_same_losses(tensor / "metrics.jsonl", whole / "metrics.jsonl", 3e-5);
  expect_same_losses(data / "metrics.jsonl", whole / "metrics.jsonl", 1e-4);
  same_eval(tensor, whole);
  same_eval(data, whole);
  expect_close_in_norm(tensor / "model", whole / "model", kReorderedNorm);

  const fs::path staged = run("staged", 4, kSingle, kLora, kSteps + kRecompute, "", 1);
  const fs::path pipeline = run("pipeline", 4, pipeline_placement("1f1b"), kLora, kSteps + kRecompute, "[parallel]\npipeline = 2\n", 2);
  const fs::path padded = run("padded", 2, kSingle, kLora, kSteps + batches(2, 4), "", 1);
  const fs::path packed = run("packed", 2, kSingle, kLora, kSteps + batches(2, 4), "", 1, {"--set", "data.packing=true"});
  ASSERT_FALSE(HasFailure());
  expect_same_losses(pipeline / "metrics.jsonl", staged / "metrics.jsonl", 1e-5);
  same_eval(pipeline, staged);
  expect_same_tensors(pipeline / "adapter", staged / "adapter", 1e-4);
  expect_same_losses(packed / "metrics.jsonl", padded / "metrics.jsonl", 1e-5);
}

// Gemma 3 ((1 + w) norms around both halves of a layer, q/k norms, a scaled embedding, GeGLU, a
// local layer before a global one) trains under the strategies as one process does, with no
// strategy code in its family: a full fine-tune over tensor 2 (every replicated copy checked after
// each step) and LoRA over a 1F1B pipeline of 2 with every layer recomputed. 10 steps: with the
// embedding scaled by sqrt(hidden) and trained whole, AdamW carries the tensor ranks' other
// summation order to 2e-4 of the loss by step 14 (Llama's: 1.2e-5), a drift, not a lost share.
TEST(MeshMatrix, Gemma3TrainsAsOneProcess) {
  const FamilyRun run{temp_dir(), true, true, {"--set", "model.plugin=\"gemma3\""}};
  const std::string steps = "max_steps = 10\n";
  const fs::path whole = run("whole", 2, kSingle, "", steps + kWhole.train, "", 1);
  const fs::path tensor = run("tensor", 2, kTensorPlacement, "", steps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(nlohmann::json::parse(read_file(whole / "model/config.json"))["architectures"][0], "Gemma3ForCausalLM");
  const kit::SafetensorsFile saved(whole / "model/model.safetensors");
  EXPECT_NE(saved.find("model.layers.1.post_feedforward_layernorm.weight"), nullptr);
  const auto rows = metrics_rows(whole / "metrics.jsonl", true);
  ASSERT_FALSE(rows.empty());
  EXPECT_LT(rows.back()["loss"].get<double>(), 0.9 * rows.front()["loss"].get<double>()) << "Gemma 3 did not learn";
  expect_same_losses(tensor / "metrics.jsonl", whole / "metrics.jsonl", 3e-5);
  // A near-zero gradient's rounding becomes an AdamW step of up to lr (1e-2) either way, against
  // weights that reach only ~0.1 in 10 steps (q_proj: 1e-3 apart of 0.093).
  expect_close_in_norm(tensor / "model", whole / "model", kReorderedNorm);
  const fs::path staged = run("staged", 4, kSingle, kLoraWithEmbedding, steps + kRecompute, "", 1);
  const fs::path pipeline = run("pipeline", 4, pipeline_placement("1f1b"), kLoraWithEmbedding, steps + kRecompute, "[parallel]\npipeline = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  expect_same_losses(pipeline / "metrics.jsonl", staged / "metrics.jsonl", 1e-5);
  expect_same_tensors(pipeline / "adapter", staged / "adapter", 1e-4);
  expect_data_packing_and_qlora_tensor(run, steps, whole);
}

// OLMo 2 (post-norms only; q/k norms spanning every head, which under tensor parallelism sum their
// squares over the ranks) trains under the strategies as one process does: a full fine-tune over
// tensor 2 (every replica checked after each step) and LoRA over a 1F1B pipeline of 2 with every
// layer recomputed.
TEST(MeshMatrix, Olmo2TrainsAsOneProcess) {
  const FamilyRun run{temp_dir(), false, false, {"--set", "model.plugin=\"olmo2\""}};
  const fs::path whole = run("whole", 2, kSingle, "", kSteps + kWhole.train, "", 1);
  const fs::path tensor = run("tensor", 2, kTensorPlacement, "", kSteps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  const kit::SafetensorsFile saved(whole / "model/model.safetensors");
  const auto* q_norm = saved.find("model.layers.0.self_attn.q_norm.weight");
  ASSERT_NE(q_norm, nullptr);
  EXPECT_EQ(q_norm->shape, std::vector<std::int64_t>{32});  // every head: 4 x 8, saved whole from the split ranks too
  expect_same_losses(tensor / "metrics.jsonl", whole / "metrics.jsonl", 3e-5);
  expect_close_in_norm(tensor / "model", whole / "model", kReorderedNorm);
  const fs::path staged = run("staged", 4, kSingle, kLora, kSteps + kRecompute, "", 1);
  const fs::path pipeline = run("pipeline", 4, pipeline_placement("1f1b"), kLora, kSteps + kRecompute, "[parallel]\npipeline = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  expect_same_losses(pipeline / "metrics.jsonl", staged / "metrics.jsonl", 1e-5);
  // q_proj's output goes through a norm that takes out its radial part, so some of lora_B's
  // gradients sit near zero and AdamW turns their rounding into whole steps: 2.3e-5 apart of 0.077.
  expect_same_tensors(pipeline / "adapter", staged / "adapter", 1e-3);
  expect_data_packing_and_qlora_tensor(run, kSteps, whole);
}

// Phi-3 (q, k and v fused into qkv_proj, gate and up into gate_up_proj, rotary over half of each
// head) trains under the strategies as one process does: a full fine-tune over tensor 2, each rank
// holding its part of q, of k and of v in its rows of qkv_proj (every replica checked each step);
// LoRA on the fused projections as PEFT targets them, over tensor 2 (lora_B's rows split by the
// same pieces, gathered back into PEFT's layout) and over a 1F1B pipeline of 2 with every layer
// recomputed; and the rest of the matrix (expect_data_packing_and_qlora_tensor).
TEST(MeshMatrix, Phi3TrainsAsOneProcess) {
  const FamilyRun run{temp_dir(), false, false, {"--set", "model.plugin=\"phi3\"", "--set", "model.partial_rotary_factor=0.5"}};
  const fs::path whole = run("whole", 2, kSingle, "", kSteps + kWhole.train, "", 1);
  const fs::path tensor = run("tensor", 2, kTensorPlacement, "", kSteps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  const auto config = nlohmann::json::parse(read_file(whole / "model/config.json"));
  EXPECT_EQ(config["architectures"][0], "Phi3ForCausalLM");
  EXPECT_EQ(config["partial_rotary_factor"], 0.5);
  const kit::SafetensorsFile saved(whole / "model/model.safetensors");
  ASSERT_NE(saved.find("model.layers.0.self_attn.qkv_proj.weight"), nullptr);
  EXPECT_EQ(saved.find("model.layers.0.self_attn.qkv_proj.weight")->shape, (std::vector<std::int64_t>{64, 32}));  // q 32, k 16, v 16
  expect_same_losses(tensor / "metrics.jsonl", whole / "metrics.jsonl", 3e-5);
  expect_close_in_norm(tensor / "model", whole / "model", kReorderedNorm);

  const fs::path adapted = run("adapted", 2, kSingle, kLora, kSteps + kWhole.train, "", 1);
  const fs::path adapted_tensor = run("adapted-tensor", 2, kTensorPlacement, kLora, kSteps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  const auto adapter_config = nlohmann::json::parse(read_file(adapted / "adapter/adapter_config.json"));
  EXPECT_EQ(adapter_config["target_modules"], nlohmann::json({"down_proj", "gate_up_proj", "o_proj", "qkv_proj"}));
  const kit::SafetensorsFile adapter(adapted_tensor / "adapter/adapter_model.safetensors");
  const auto* lora_b = adapter.find("base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight");
  ASSERT_NE(lora_b, nullptr);
  EXPECT_EQ(lora_b->shape, (std::vector<std::int64_t>{64, 8}));
  expect_same_losses(adapted_tensor / "metrics.jsonl", adapted / "metrics.jsonl", 1e-5);
  expect_close_in_norm(adapted_tensor / "adapter", adapted / "adapter", kReorderedNorm);

  const fs::path staged = run("staged", 4, kSingle, kLora, kSteps + kRecompute, "", 1);
  const fs::path pipeline = run("pipeline", 4, pipeline_placement("1f1b"), kLora, kSteps + kRecompute, "[parallel]\npipeline = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  expect_same_losses(pipeline / "metrics.jsonl", staged / "metrics.jsonl", 1e-5);
  expect_same_tensors(pipeline / "adapter", staged / "adapter", 1e-4);

  expect_data_packing_and_qlora_tensor(run, kSteps, whole);
}

// The families added with kit 4 (tests/fixtures/families: their parity with transformers is
// parity_test.cpp's): GPT-NeoX, StarCoder 2, Granite and Cohere written as blocks, Gemma 2, OLMoE
// and Qwen2-MoE (a shared expert) as descriptions. Each trains under the strategies as one process does with no strategy code of
// its own: a full fine-tune over tensor 2 (every replica checked each step), LoRA over a 1F1B
// pipeline of 2 with every layer recomputed, data 2, packed rows and QLoRA over tensor 2 (each
// rank's part a whole number of 4-bit blocks: widths of 32 and more); OLMoE's and Qwen2-MoE's
// experts shared out over expert 2 as well.
struct NewFamily {
  std::string plugin, hf_class, saved;  // saved: a tensor of layer 0 the saved folder must hold
  bool windowed = false;
  std::vector<std::string> sets;
};
void PrintTo(const NewFamily& f, std::ostream* out) { *out << f.plugin; }
class NewFamilies : public ::testing::TestWithParam<NewFamily> {};

TEST_P(NewFamilies, TrainAsOneProcess) {
  const NewFamily& family = GetParam();
  std::vector<std::string> sets{"--set", "model.plugin=\"" + family.plugin + "\""};
  sets.insert(sets.end(), family.sets.begin(), family.sets.end());
  const FamilyRun run{temp_dir(), false, family.windowed, sets};
  const fs::path whole = run("whole", 2, kSingle, "", kSteps + kWhole.train, "", 1);
  const fs::path tensor = run("tensor", 2, kTensorPlacement, "", kSteps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(nlohmann::json::parse(read_file(whole / "model/config.json"))["architectures"][0], family.hf_class);
  EXPECT_NE(kit::SafetensorsFile(whole / "model/model.safetensors").find(family.saved), nullptr) << family.saved;
  expect_same_losses(tensor / "metrics.jsonl", whole / "metrics.jsonl", 3e-5);
  expect_close_in_norm(tensor / "model", whole / "model", kReorderedNorm);
  const fs::path staged = run("staged", 4, kSingle, kLora, kSteps + kRecompute, "", 1);
  const fs::path pipeline = run("pipeline", 4, pipeline_placement("1f1b"), kLora, kSteps + kRecompute, "[parallel]\npipeline = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  {
    SCOPED_TRACE("1F1B pipeline 2 against one process");
    expect_same_losses(pipeline / "metrics.jsonl", staged / "metrics.jsonl", 1e-5);
    expect_same_tensors(pipeline / "adapter", staged / "adapter", 1e-3);
  }
  expect_data_packing_and_qlora_tensor(run, kSteps, whole);
  if (family.plugin != "olmoe" && family.plugin != "qwen2_moe" && family.plugin != "deepseek_v3" && family.plugin != "gpt_oss") return;
  const fs::path data = run("data", 2, kSingle, "", kSteps + batches(4, 1), "[parallel]\ndata = 2\n", 2);
  const fs::path expert = run("expert", 2, kSingle, "", kSteps + batches(4, 1), "[parallel]\ndata = 2\nexpert = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  // The experts' outputs come back over the exchange and sum in another order: DeepSeek-V3's sigmoid
  // routing ends 1.7e-5 apart at step 16 of 20 (3e-5, as tensor 2 against one process).
  SCOPED_TRACE("expert 2 against data 2");
  expect_same_losses(expert / "metrics.jsonl", data / "metrics.jsonl", 3e-5);
  expect_close_in_norm(expert / "model", data / "model", kReorderedNorm);
}

INSTANTIATE_TEST_SUITE_P(
    MeshMatrix, NewFamilies,
    ::testing::Values(NewFamily{"gpt_neox", "GPTNeoXForCausalLM", "gpt_neox.layers.0.attention.query_key_value.weight", false,
                                {"--set", "model.partial_rotary_factor=0.5"}},
                      NewFamily{"starcoder2", "Starcoder2ForCausalLM", "model.layers.0.mlp.c_fc.bias", true, {}},
                      NewFamily{"granite", "GraniteForCausalLM", "model.layers.0.mlp.gate_proj.weight", false, {}},
                      NewFamily{"cohere", "CohereForCausalLM", "model.layers.0.input_layernorm.weight", false, {}},
                      NewFamily{"gemma2", "Gemma2ForCausalLM", "model.layers.0.pre_feedforward_layernorm.weight", true, {}},
                      NewFamily{"stablelm", "StableLmForCausalLM", "model.layers.0.input_layernorm.bias", false, {"--set", "model.partial_rotary_factor=0.5"}},
                      NewFamily{"olmoe", "OlmoeForCausalLM", "model.layers.0.mlp.experts.3.up_proj.weight", false,
                                {"--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2"}},
                      NewFamily{"deepseek_v3", "DeepseekV3ForCausalLM", "model.layers.1.mlp.gate.e_score_correction_bias", false,
                                {"--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2", "--set", "model.moe_intermediate_size=32",
                                 "--set", "model.mlp_only_layers=[0]"}},
                      NewFamily{"gpt_oss", "GptOssForCausalLM", "model.layers.0.self_attn.sinks", true,
                                {"--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2"}},
                      NewFamily{"qwen2_moe", "Qwen2MoeForCausalLM", "model.layers.0.mlp.shared_expert_gate.weight", false,
                                {"--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2", "--set", "model.moe_intermediate_size=32",
                                 "--set", "model.shared_expert_intermediate_size=32", "--set", "model.mlp_only_layers=[1]"}}),
    [](const auto& info) { return info.param.plugin; });

// The launcher's processes compute exactly what the same run's ranks compute as threads: on a
// tensor 2 x pipeline 2 mesh (4 processes, every group kind), the same metrics row for row and the
// same adapter bytes. So the matrix above, run as threads, stands for launched runs.
TEST(MeshMatrix, LauncherRunsWhatThreadsRun) {
  const fs::path dir = temp_dir();
  const auto p = copy_task_pipeline(dir, 2, true, pipeline_placement("1f1b"), kLoraWithEmbedding, "max_steps = 6\n" + batches(4, 2),
                                    "[parallel]\ntensor = 2\npipeline = 2\n");
  const auto threads = run_loom_ranks({"run", p.string(), "--output", (dir / "threads").string()}, 4);
  ASSERT_EQ(threads.exit_code, 0) << threads.out << threads.err;
  const auto launched = run_loom_process({"run", p.string(), "--output", (dir / "launched").string(), "--nproc-per-node", "4"});
  ASSERT_EQ(launched.exit_code, 0) << launched.out << launched.err;
  EXPECT_EQ(metrics_rows(dir / "launched/metrics.jsonl", false), metrics_rows(dir / "threads/metrics.jsonl", false));
  EXPECT_EQ(read_file(dir / "launched/adapter/adapter_model.safetensors"), read_file(dir / "threads/adapter/adapter_model.safetensors"));
  // Rank 0 speaks for the run; every line says which rank printed it.
  EXPECT_NE(launched.out.find("[rank 0] step 6/6"), std::string::npos) << launched.out;
  EXPECT_EQ(launched.out.find("[rank 1] step"), std::string::npos) << launched.out;
}


// [data] packing: samples of different lengths laid end to end in rows of max_length train as the
// padded batches of the same samples do (losses step by step, the adapter), in one process and
// split over pipeline (1F1B), tensor and data ranks; a model plugin without PackedSequences is
// refused at the key. The model-level proof, logits and gradients sample by sample:
// Packing.PackedRowsGiveEachSamplesLogitsLossAndGradients.
TEST(MeshMatrix, PackedRowsTrainAsPaddedOnes) {
  const fs::path dir = temp_dir();
  const auto run = [&](const std::string& name, const std::string& placement, const std::string& parallel, int world, bool packing,
                       const std::string& packer = "first_fit_decreasing", int batch = 2) {
    const fs::path out = dir / name;
    const fs::path pipeline = copy_task_pipeline(dir / (name + "-p"), 2, false, placement, kLora, kSteps + batches(batch, 4), parallel);
    // Answers of 1 to 6 words: samples of 11 to 31 tokens, so rows hold one to three of them.
    std::string train;
    const char* words[] = {"ab", "cd", "ef", "gh", "ij", "kl"};
    for (int i = 0; i < 84; ++i) {
      std::string w;
      for (int k = 0; k <= i % 6; ++k) w += words[(i + k) % 6];
      train += "{\"q\": \"" + w.substr(0, 2) + "\", \"a\": \"" + w + "\"}\n";
    }
    write_file(pipeline.parent_path() / "train.jsonl", train);
    std::vector<std::string> args{"run", pipeline.string(), "--output", out.string(), "--set", std::string("data.packing=") + (packing ? "true" : "false"),
                                  "--set", "data.packer=\"" + packer + "\""};
    const auto r = world > 1 ? run_loom_ranks(args, world) : run_loom(args);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return out;
  };
  const fs::path padded = run("padded", kSingle, "", 1, false);
  const fs::path packed = run("packed", kSingle, "", 1, true);
  const fs::path greedy = run("greedy", kSingle, "", 1, true, "greedy");
  const fs::path pipeline = run("pipeline", pipeline_placement("1f1b"), "[parallel]\npipeline = 2\n", 2, true);
  const fs::path tensor = run("tensor", "[placement]\nplugin = \"tensor-parallel\"\n", "[parallel]\ntensor = 2\n", 2, true);
  const fs::path data = run("data", kSingle, "[parallel]\ndata = 2\n", 2, true, "first_fit_decreasing", 1);  // the same global batch
  ASSERT_FALSE(HasFailure());
  expect_same_losses(packed / "metrics.jsonl", padded / "metrics.jsonl", 1e-5);
  // The rows' sums run in another order, and AdamW turns that rounding in a near-zero gradient into
  // a step of up to lr: the adapter as the tensor layouts of EveryMesh hold it.
  expect_close_in_norm(packed / "adapter", padded / "adapter", kReorderedNorm);
  expect_same_losses(greedy / "metrics.jsonl", padded / "metrics.jsonl", 1e-5);
  expect_same_losses(pipeline / "metrics.jsonl", packed / "metrics.jsonl", 1e-5);
  expect_same_losses(tensor / "metrics.jsonl", packed / "metrics.jsonl", 1e-5);
  expect_same_losses(data / "metrics.jsonl", packed / "metrics.jsonl", 1e-4);
  // A packer loom does not have is one error at its key.
  const auto unknown = run_loom({"validate", (dir / "packed-p" / "p.toml").string(), "--set", "data.packer=\"best_fit\""});
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_TRUE(contains(unknown.err, "packer")) << unknown.err;
  EXPECT_TRUE(contains(unknown.err, "\"first_fit_decreasing\", \"greedy\"")) << unknown.err;
}

// A mixture of experts (Qwen3-MoE: 4 experts, top-2, layer 1 dense through mlp_only_layers) trains
// under the strategies as one process does, with the routers' load-balancing loss in it
// (output_router_logits, weighted 0.1): tensor 2 (each expert's units split, the router whole and
// checked equal on both ranks after each step) equals one process; data 2 equals one process
// running the same two halves as micro-batches (the term is each micro-batch's, as transformers
// under DDP takes it per rank); LoRA over a 1F1B pipeline of 2 with every layer recomputed (no
// router term: it spans the stages) equals one process. The term is logged, and a pipeline with it
// is refused.
TEST(MeshMatrix, MixtureOfExpertsTrainsAsOneProcess) {
  const std::vector<std::string> moe{"--set", "model.plugin=\"qwen3_moe\"", "--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2",
                                     "--set", "model.moe_intermediate_size=16", "--set", "model.mlp_only_layers=[1]"};
  std::vector<std::string> balanced = moe;
  for (const char* set : {"model.output_router_logits=true", "model.router_aux_loss_coef=0.1"}) balanced.insert(balanced.end(), {"--set", set});
  const fs::path dir = temp_dir();
  const FamilyRun run{dir, false, false, balanced}, plain{dir, false, false, moe};
  const fs::path whole = run("whole", 2, kSingle, "", kSteps + kWhole.train, "", 1);
  const fs::path tensor = run("tensor", 2, kTensorPlacement, "", kSteps + kWhole.train, "[parallel]\ntensor = 2\n", 2);
  const fs::path halves = run("halves", 2, kSingle, "", kSteps + batches(4, 2), "", 1);
  const fs::path data = run("data", 2, kSingle, "", kSteps + batches(4, 1), "[parallel]\ndata = 2\n", 2);
  const fs::path unbalanced = plain("unbalanced", 2, kSingle, "", kSteps + kWhole.train, "", 1);
  ASSERT_FALSE(HasFailure());
  const auto rows = metrics_rows(whole / "metrics.jsonl", true);
  ASSERT_FALSE(rows.empty());
  ASSERT_TRUE(rows.front().contains("aux_loss")) << rows.front().dump();
  // One sparse layer of 4 experts: the term is 1 when the picks and probabilities are uniform, up to 4.
  EXPECT_GE(rows.front()["aux_loss"].get<double>(), 0.99);
  EXPECT_LE(rows.front()["aux_loss"].get<double>(), 4.0);
  EXPECT_FALSE(metrics_rows(unbalanced / "metrics.jsonl", true).front().contains("aux_loss"));
  const auto first_loss = [](const fs::path& out) { return metrics_rows(out / "metrics.jsonl", true).front()["loss"].get<double>(); };
  EXPECT_NEAR(first_loss(whole) - first_loss(unbalanced), 0.1 * rows.front()["aux_loss"].get<double>(), 1e-5) << "the loss holds the weighted term";
  const auto config = nlohmann::json::parse(read_file(whole / "model/config.json"));
  EXPECT_EQ(config["architectures"][0], "Qwen3MoeForCausalLM");
  EXPECT_EQ(config["num_experts"], 4);
  EXPECT_EQ(config["mlp_only_layers"], nlohmann::json({1}));
  const kit::SafetensorsFile saved(whole / "model/model.safetensors");
  EXPECT_NE(saved.find("model.layers.0.mlp.experts.3.down_proj.weight"), nullptr);
  EXPECT_NE(saved.find("model.layers.1.mlp.down_proj.weight"), nullptr);
  EXPECT_EQ(saved.find("model.layers.0.mlp.down_proj.weight"), nullptr);
  expect_same_losses(tensor / "metrics.jsonl", whole / "metrics.jsonl", 3e-5);
  expect_close_in_norm(tensor / "model", whole / "model", kReorderedNorm);
  expect_same_losses(data / "metrics.jsonl", halves / "metrics.jsonl", 1e-4);
  for (const auto& [mine, theirs] : {std::pair{tensor, whole}, std::pair{data, halves}}) {
    const auto a = metrics_rows(mine / "metrics.jsonl", true), b = metrics_rows(theirs / "metrics.jsonl", true);
    EXPECT_NEAR(a.back()["aux_loss"].get<double>(), b.back()["aux_loss"].get<double>(), 1e-4);
  }

  // LoRA on attention and on every expert (PEFT's target_parameters), over a pipeline of 2.
  const std::string experts_lora = kLora + "target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]\n";
  const fs::path staged = plain("staged", 4, kSingle, experts_lora, kSteps + kRecompute, "", 1);
  const fs::path pipeline = plain("pipeline", 4, pipeline_placement("1f1b"), experts_lora, kSteps + kRecompute, "[parallel]\npipeline = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  expect_same_losses(pipeline / "metrics.jsonl", staged / "metrics.jsonl", 1e-5);
  expect_same_tensors(pipeline / "adapter", staged / "adapter", 1e-4);
  const kit::SafetensorsFile adapter(staged / "adapter/adapter_model.safetensors");
  const auto* a = adapter.find("base_model.model.model.layers.2.mlp.experts.base_layer.lora_A.weight");  // gate_up_proj's: [E * r, hidden]
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<std::int64_t>{4 * 8, 32}));
  EXPECT_NE(adapter.find("base_model.model.model.layers.2.mlp.experts.lora_B.weight"), nullptr);  // down_proj's
  EXPECT_EQ(adapter.find("base_model.model.model.layers.1.mlp.experts.lora_A.weight"), nullptr);   // layer 1 is dense
  EXPECT_EQ(nlohmann::json::parse(read_file(staged / "adapter/adapter_config.json"))["target_parameters"],
            nlohmann::json({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  // As Qwen3's LoRA on this random base, ~8% in 20 steps; the experts' B (zero at init) moved.
  const auto staged_rows = metrics_rows(staged / "metrics.jsonl", true);
  EXPECT_LT(staged_rows.back()["loss"].get<double>(), 0.95 * staged_rows.front()["loss"].get<double>()) << "LoRA did not learn";
  EXPECT_GT(adapter.tensor("base_model.model.model.layers.2.mlp.experts.lora_B.weight").abs().max().item<double>(), 1e-3) << "the experts' B never moved";
  // Split experts with LoRA on them are refused, naming the way out.
  std::vector<std::string> split_args{"run", (dir / "staged-p" / "p.toml").string(), "--output", (dir / "split").string(), "--set",
                                      "placement.plugin=\"tensor-parallel\"", "--set", "parallel.tensor=2"};
  split_args.insert(split_args.end(), moe.begin(), moe.end());
  const auto split = run_loom_ranks(split_args, 2);
  EXPECT_NE(split.exit_code, 0);
  EXPECT_TRUE(contains(split.err, "LoRA on experts split over tensor ranks is not supported yet")) << split.err;
  std::vector<std::string> refused{"run", (dir / "pipeline-p" / "p.toml").string(), "--output", (dir / "refused").string()};
  refused.insert(refused.end(), balanced.begin(), balanced.end());
  const auto r = run_loom_ranks(refused, 2);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.err, "output_router_logits")) << r.err;
  EXPECT_TRUE(contains(r.err, "activation_checkpointing = \"none\"")) << r.err;
}

// [parallel] expert: data ranks share out each sparse layer's experts, every token's rows sent to
// its experts' rank and back. A full fine-tune over expert 2 equals data 2 (the same samples per
// rank) to 1e-5 and one process to 1e-4, with the load-balancing loss on; LoRA on attention and on
// every expert over expert 2 x data 2 equals data 4 to 1e-5 and one process. Each saves what one process saves: every
// expert, gathered. Layouts it does not combine with yet are refused at the key.
TEST(MeshMatrix, ExpertParallelTrainsAsOneProcess) {
  const std::vector<std::string> moe{"--set", "model.plugin=\"qwen3_moe\"", "--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2",
                                     "--set", "model.moe_intermediate_size=16", "--set", "model.mlp_only_layers=[1]", "--set", "model.output_router_logits=true",
                                     "--set", "model.router_aux_loss_coef=0.1"};
  const fs::path dir = temp_dir();
  const FamilyRun run{dir, false, false, moe};
  const fs::path halves = run("halves", 2, kSingle, "", kSteps + batches(4, 2), "", 1);
  const fs::path data = run("data", 2, kSingle, "", kSteps + batches(4, 1), "[parallel]\ndata = 2\n", 2);
  const fs::path expert = run("expert", 2, kSingle, "", kSteps + batches(4, 1), "[parallel]\ndata = 2\nexpert = 2\n", 2);
  const std::string experts_lora = kLora + "target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]\n";
  const fs::path quarters = run("quarters", 2, kSingle, experts_lora, kSteps + batches(2, 4), "", 1);
  const fs::path data4 = run("data4", 2, kSingle, experts_lora, kSteps + batches(2, 1), "[parallel]\ndata = 4\n", 4);
  // Every layer recomputed in the backward: the exchanges run again there, on every rank alike.
  // (The load-balancing term needs every activation kept: off in both.)
  const fs::path data_lora = run("data-lora", 2, kSingle, experts_lora, kSteps + batches(4, 1), "[parallel]\ndata = 2\n", 2,
                                 {"--set", "model.output_router_logits=false"});
  const fs::path recomputed = run("expert-recomputed", 2, kSingle, experts_lora, kSteps + batches(4, 1) + "activation_checkpointing = \"every-layer\"\n",
                                  "[parallel]\ndata = 2\nexpert = 2\n", 2, {"--set", "model.output_router_logits=false"});
  const fs::path expert_data = run("expert-data", 2, kSingle, experts_lora, kSteps + batches(2, 1), "[parallel]\ndata = 4\nexpert = 2\n", 4);
  ASSERT_FALSE(HasFailure());
  expect_same_losses(expert / "metrics.jsonl", data / "metrics.jsonl", 1e-5);
  expect_same_losses(expert / "metrics.jsonl", halves / "metrics.jsonl", 1e-4);
  const auto aux = [](const fs::path& out) { return metrics_rows(out / "metrics.jsonl", true).back()["aux_loss"].get<double>(); };
  EXPECT_NEAR(aux(expert), aux(data), 1e-5);
  expect_close_in_norm(expert / "model", data / "model", kReorderedNorm);  // 20 AdamW steps on sums added up in another order
  // Evaluation: the expert group's ranks take the same held-out samples in lockstep, one counts them.
  const auto eval_expert = last_eval(expert / "metrics.jsonl"), eval_data = last_eval(data / "metrics.jsonl");
  EXPECT_NEAR(eval_expert["eval_loss"].get<double>(), eval_data["eval_loss"].get<double>(), 1e-4 * eval_data["eval_loss"].get<double>());
  EXPECT_EQ(eval_expert["eval_samples"], eval_data["eval_samples"]) << eval_expert.dump();
  EXPECT_EQ(eval_expert["exact_match"], eval_data["exact_match"]) << eval_expert.dump();
  const kit::SafetensorsFile saved(expert / "model/model.safetensors");
  for (int e = 0; e < 4; ++e) EXPECT_NE(saved.find("model.layers.0.mlp.experts." + std::to_string(e) + ".down_proj.weight"), nullptr) << e;
  // The same samples per rank as data 4: losses to 1e-5; one process adds its micro-batches up in another
  // order (as data 4 does).
  expect_same_losses(expert_data / "metrics.jsonl", data4 / "metrics.jsonl", 1e-5);
  expect_close_in_norm(expert_data / "adapter", data4 / "adapter", kReorderedNorm);  // B from zero under AdamW: rounding of small gradients grows
  expect_same_losses(expert_data / "metrics.jsonl", quarters / "metrics.jsonl", 1e-4);
  expect_same_losses(recomputed / "metrics.jsonl", data_lora / "metrics.jsonl", 1e-5);
  expect_close_in_norm(expert_data / "adapter", quarters / "adapter", kReorderedNorm);
  const kit::SafetensorsFile adapter(expert_data / "adapter/adapter_model.safetensors");
  const auto* a = adapter.find("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<std::int64_t>{4 * 8, 32}));
  EXPECT_GT(adapter.tensor("base_model.model.model.layers.0.mlp.experts.lora_B.weight").abs().max().item<double>(), 1e-3) << "the experts' B never moved";
  // Samples too long for max_length (dropped) leave a rank's micro-batch empty now and then: it passes
  // a row that labels nothing, whose backward still takes part in the group's exchanges, and the
  // load-balancing term counts only real micro-batches, as data 2's.
  std::string gappy;
  const char* words[] = {"ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"};
  for (int i = 0; i < 48; ++i) {
    const std::string w = i % 5 == 3 ? std::string(40, 'z') : std::string(words[i % 8]) + words[(i / 8) % 8];
    gappy += "{\"q\": \"" + w + "\", \"a\": \"" + w + "\"}\n";
  }
  write_file(dir / "gappy.jsonl", gappy);
  const std::vector<std::string> gaps{"--set", "data.train=\"" + (dir / "gappy.jsonl").string() + "\"", "--set", "data.truncation=\"drop\""};
  const std::string gap_train = "max_steps = 12\nbatch_size = 1\ngrad_accum = 2\n";
  const fs::path gaps_data = run("gaps-data", 2, kSingle, "", gap_train, "[parallel]\ndata = 2\n", 2, gaps);
  const fs::path gaps_expert = run("gaps-expert", 2, kSingle, "", gap_train, "[parallel]\ndata = 2\nexpert = 2\n", 2, gaps);
  ASSERT_FALSE(HasFailure());
  expect_same_losses(gaps_expert / "metrics.jsonl", gaps_data / "metrics.jsonl", 1e-5);
  EXPECT_NEAR(aux(gaps_expert), aux(gaps_data), 1e-5);
  EXPECT_GT(metrics_rows(gaps_expert / "metrics.jsonl", true).back()["skipped_samples"].get<int>(), 0);
  // What expert parallelism does not take, refused at the key by `loom plan`.
  const auto refusal = [&](const std::string& name, const std::string& parallel, const std::vector<std::string>& sets) {
    std::vector<std::string> args{"plan", copy_task_pipeline(dir / (name + "-p"), 2, false, kSingle, "", kSteps, parallel).string()};
    args.insert(args.end(), sets.begin(), sets.end());
    return run_loom(args);
  };
  const auto uneven = refusal("uneven", "[parallel]\ndata = 2\nexpert = 3\n", moe);
  EXPECT_NE(uneven.exit_code, 0);
  EXPECT_TRUE(contains(uneven.err, "expert = 3 does not divide the 2 data rank(s)")) << uneven.err;
  EXPECT_TRUE(contains(uneven.err, "p.toml:")) << uneven.err;
  std::vector<std::string> six = moe;
  six.insert(six.end(), {"--set", "model.num_experts=6"});
  const auto indivisible = refusal("indivisible", "[parallel]\ndata = 4\nexpert = 4\n", six);
  EXPECT_NE(indivisible.exit_code, 0);
  EXPECT_TRUE(contains(indivisible.err, "has 6 experts, which do not divide over 4 ranks")) << indivisible.err;
  const auto dense = refusal("dense", "[parallel]\ndata = 2\nexpert = 2\n", {});
  EXPECT_NE(dense.exit_code, 0);
  EXPECT_TRUE(contains(dense.err, "has no experts in this config to share out")) << dense.err;
  const auto tensor = refusal("tensor", "[parallel]\ndata = 2\nexpert = 2\ntensor = 2\n", moe);
  EXPECT_NE(tensor.exit_code, 0);
  EXPECT_TRUE(contains(tensor.err, "combines with data parallelism only so far")) << tensor.err;
}

// QLoRA on a mixture of experts: the experts are stored 4-bit with the linears (NF4, double
// quantization), LoRA on attention and every expert learns and saves PEFT's keys, the plan counts
// the stacked experts as stored, and a merge (no dense copy to write back) is refused before the run.
// Over expert 2 it equals data 2 (each rank quantizes its own experts).
TEST(MeshMatrix, FourBitExpertsTrainWithLora) {
  const std::vector<std::string> moe{"--set", "model.plugin=\"qwen3_moe\"", "--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2",
                                     "--set", "model.moe_intermediate_size=16", "--set", "model.mlp_only_layers=[1]"};
  const fs::path dir = temp_dir();
  const FamilyRun run{dir, false, false, moe};
  const std::string qlora = "[adapter]\nplugin = \"qlora\"\nr = 8\nalpha = 16\ntarget_modules = \"all-linear\"\ndropout = 0.0\n"
                            "target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]\n";
  const fs::path one = run("one", 2, kSingle, qlora, kSteps + kWhole.train, "", 1);
  // Double quantization's 8-bit scales are offset by the mean over the matrix quantized, a rank's
  // experts' rather than the layer's: compared without it, each rank's 4-bit blocks are the whole's.
  const std::string single_quant = qlora + "double_quant = false\n";
  const fs::path data = run("data", 2, kSingle, single_quant, kSteps + batches(4, 1), "[parallel]\ndata = 2\n", 2);
  const fs::path expert = run("expert", 2, kSingle, single_quant, kSteps + batches(4, 1), "[parallel]\ndata = 2\nexpert = 2\n", 2);
  ASSERT_FALSE(HasFailure());
  const auto rows = metrics_rows(one / "metrics.jsonl", true);
  EXPECT_LT(rows.back()["loss"].get<double>(), 0.95 * rows.front()["loss"].get<double>()) << "LoRA over 4-bit experts did not learn";
  const kit::SafetensorsFile adapter(one / "adapter/adapter_model.safetensors");
  ASSERT_NE(adapter.find("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"), nullptr);
  EXPECT_GT(adapter.tensor("base_model.model.model.layers.0.mlp.experts.lora_B.weight").abs().max().item<double>(), 1e-3) << "the experts' B never moved";
  expect_same_losses(expert / "metrics.jsonl", data / "metrics.jsonl", 1e-5);
  expect_close_in_norm(expert / "adapter", data / "adapter", kReorderedNorm);
  const fs::path p = dir / "one-p" / "p.toml";
  std::vector<std::string> plan{"plan", p.string()};
  plan.insert(plan.end(), moe.begin(), moe.end());
  const auto planned = run_loom(plan);
  ASSERT_EQ(planned.exit_code, 0) << planned.err;
  EXPECT_TRUE(contains(planned.out, "and 2 stacked experts weights")) << planned.out;
  plan.insert(plan.end(), {"--set", "adapter.merge=true"});
  const auto merged = run_loom(plan);
  EXPECT_NE(merged.exit_code, 0);
  EXPECT_TRUE(contains(merged.err, "stores the experts 4-bit, which no merge can write back")) << merged.err;
}

}  // namespace
}  // namespace loom::test
