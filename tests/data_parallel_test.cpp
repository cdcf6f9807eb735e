// Data parallelism on the CPU over Gloo, as launched processes: a rank that dies or hangs is named
// by the others, a killed or preempted run resumes exactly, the mesh is checked and planned per
// rank. (Ranks with a share of each batch training as one process: mesh_matrix_test.cpp.)
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <cmath>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;

// The copy task (as in the training tests), dropout off so ranks draw no random numbers that one
// process would draw differently.
fs::path dp_pipeline(const fs::path& dir, const std::string& extra, const std::string& train = "") {
  write_file(dir / "p.toml", "[run]\nseed = 7\ntimeout = 30\n" + copy_task(dir) + R"([train]
lr = 1e-2
log_every = 1
eval_samples = 12
max_new_tokens = 6
threads = 1
)" + train + "\n" + extra);
  return dir / "p.toml";
}

const std::string kLora = "[adapter]\nplugin = \"lora\"\nr = 8\nalpha = 16\ntarget_modules = \"all-linear\"\ndropout = 0.0\n";

std::vector<nlohmann::json> rows_of(const fs::path& metrics) { return metrics_rows(metrics, true); }

// (DP = 2 and 4 with a share of each batch against one process with the whole batch, LoRA and
// full, with gradient accumulation: mesh_matrix_test.cpp.)

// Two ranks started as torchrun starts them, rank 0 watched, rank 1 signalled after a few steps.
struct Watched {
  int code;
  double seconds;
  std::string err;
};
Watched stop_rank_one(const fs::path& dir, int signal, int port) {
  const auto pipeline = dp_pipeline(dir, kLora, "max_steps = 100000\nbatch_size = 2");
  std::vector<int> pids;
  for (int rank = 0; rank < 2; ++rank)
    pids.push_back(start_loom_with_env({"run", pipeline.string(), "--output", (dir / "out").string(), "--set", "run.timeout=10"},
                                       dir / ("r" + std::to_string(rank) + ".out"), dir / ("r" + std::to_string(rank) + ".err"),
                                       {{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", std::to_string(rank)},
                                        {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}}));
  wait_until([&] { return fs::exists(dir / "out/metrics.jsonl") && rows_of(dir / "out/metrics.jsonl").size() >= 3; }, std::chrono::seconds(120));
  kill(pids[1], signal);
  const auto signalled = std::chrono::steady_clock::now();
  Watched w;
  w.code = wait_child_within(pids[0], std::chrono::seconds(60));
  w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
  kill(pids[1], SIGKILL);
  wait_child(pids[1]);
  w.err = read_file(dir / "r0.err");
  return w;
}

// A rank killed mid-run, or frozen (a hang): with no launcher watching, the other rank stops
// within [run] timeout (10 s here), naming the rank it lost, with exit code 3.
TEST(DataParallel, KilledOrHungRankStopsTheOthersNamingIt) {
  const int port = 29000 + static_cast<int>(::getpid() % 2000) * 2;
  const auto killed = stop_rank_one(temp_dir(), SIGKILL, port);
  EXPECT_EQ(killed.code, 3) << killed.err;
  EXPECT_LE(killed.seconds, 10 + 10) << killed.err;
  EXPECT_NE(killed.err.find("loom: error: rank 0: rank 1 stopped responding"), std::string::npos) << killed.err;
  const auto hung = stop_rank_one(temp_dir(), SIGSTOP, port + 1);
  EXPECT_EQ(hung.code, 3) << hung.err;
  EXPECT_LE(hung.seconds, 10 + 10) << hung.err;
  EXPECT_NE(hung.err.find("loom: error: rank 0: rank 1 stopped responding"), std::string::npos) << hung.err;
  EXPECT_NE(hung.err.find("Timed out"), std::string::npos) << hung.err;
}

// Under the launcher a failing rank stops every rank at once; the launcher exits with its code.
// Resumed from the last checkpoint (on the same mesh) the run logs the losses of a run that was
// never interrupted; on another mesh, --resume names both meshes.
TEST(DataParallel, ResumeAfterSigkillEqualsAnUninterruptedRun) {
  const fs::path dir = temp_dir();
  const auto pipeline = dp_pipeline(dir, kLora, "max_steps = 40\ncheckpoint_every = 10\nbatch_size = 4");
  const auto whole = run_loom_process({"run", pipeline.string(), "--output", (dir / "whole").string(), "--nproc-per-node", "2"});
  ASSERT_EQ(whole.exit_code, 0) << whole.err;

  EXPECT_EQ(kill_rank_one_after_checkpoint(pipeline, dir / "killed"), 128 + SIGKILL);
  const std::string err = read_file(dir / "killed.err");
  EXPECT_NE(err.find("loom: rank 1 was killed by signal 9 (SIGKILL); stopping the other ranks"), std::string::npos) << err;
  ASSERT_LT(rows_of(dir / "killed/metrics.jsonl").size(), 40u) << "the run finished before it could be killed";

  const std::string manifest = read_file(dir / "killed/run.json");
  const auto other_mesh = run_loom({"run", pipeline.string(), "--output", (dir / "killed").string(), "--resume"});
  EXPECT_EQ(read_file(dir / "killed/run.json"), manifest) << "a refused --resume rewrote run.json";
  EXPECT_EQ(other_mesh.exit_code, 2);
  EXPECT_NE(other_mesh.err.find("was written by a run on the mesh data 2 x pipeline 1 x tensor 1 (2 processes); this run is data 1 x "
                                "pipeline 1 x tensor 1 (1)"),
            std::string::npos)
      << other_mesh.err;

  const auto resumed = run_loom_process({"run", pipeline.string(), "--output", (dir / "killed").string(), "--resume", "--nproc-per-node", "2"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(rows_of(dir / "killed/metrics.jsonl"), rows_of(dir / "whole/metrics.jsonl"));
  EXPECT_EQ(read_file(dir / "killed/adapter/adapter_model.safetensors"), read_file(dir / "whole/adapter/adapter_model.safetensors"));
}

// SIGTERM to the launcher (Slurm's preemption) stops every rank after the same step with one
// checkpoint; the printed command resumes it, to the losses of an uninterrupted run.
TEST(DataParallel, SigtermStopsEveryRankAtOneStepAndResumes) {
  const fs::path dir = temp_dir();
  const auto pipeline = dp_pipeline(dir, kLora, "max_steps = 60\nbatch_size = 4");
  const auto whole = run_loom_process({"run", pipeline.string(), "--output", (dir / "whole").string(), "--nproc-per-node", "2"});
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const int launcher = start_loom({"run", pipeline.string(), "--output", (dir / "stopped").string(), "--nproc-per-node", "2"}, dir / "s.out",
                                  dir / "s.err");
  wait_until([&] { return fs::exists(dir / "stopped/metrics.jsonl") && rows_of(dir / "stopped/metrics.jsonl").size() >= 3; },
             std::chrono::seconds(120), std::chrono::milliseconds(2));
  kill(launcher, SIGTERM);
  ASSERT_EQ(wait_child_within(launcher, std::chrono::seconds(60)), 128 + SIGTERM) << read_file(dir / "s.err");
  const std::string out = read_file(dir / "s.out");
  EXPECT_NE(out.find("[rank 0] stopped by SIGTERM after step "), std::string::npos) << out;
  EXPECT_NE(out.find(" --resume --nproc-per-node 2"), std::string::npos) << out;
  const auto rows = rows_of(dir / "stopped/metrics.jsonl");
  ASSERT_LT(rows.size(), 60u) << "the run finished before the signal; make it longer";
  EXPECT_EQ(std::stoll(read_file(dir / "stopped/checkpoints/latest").substr(5)), rows.back()["step"].get<std::int64_t>());
  const auto resumed = run_loom_process({"run", pipeline.string(), "--output", (dir / "stopped").string(), "--resume", "--nproc-per-node", "2"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(rows_of(dir / "stopped/metrics.jsonl"), rows_of(dir / "whole/metrics.jsonl"));
}

// The mesh is checked before any process starts, and the plan shows every rank.
TEST(DataParallel, MeshIsCheckedAndPlannedPerRank) {
  const fs::path dir = temp_dir();
  const auto pipeline = dp_pipeline(dir, kLora, "max_steps = 2\nbatch_size = 2\n[parallel]\ndata = 3");
  const auto r = run_loom_process({"run", pipeline.string(), "--nproc-per-node", "2", "--output", (dir / "o").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("[parallel] data x pipeline x tensor = 3 ranks, but this run has 2 process(es)"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir / "o"));
  const auto zero = run_loom({"plan", dp_pipeline(dir, kLora).string(), "--nproc-per-node", "0"});
  EXPECT_EQ(zero.exit_code, 2);
  EXPECT_NE(zero.err.find("--nproc-per-node 0: use 1 to 1024"), std::string::npos) << zero.err;
  const auto many = run_loom_process({"run", dp_pipeline(dir, kLora).string(), "--nproc-per-node", "5000", "--output", (dir / "o").string()});
  EXPECT_EQ(many.exit_code, 2);
  EXPECT_NE(many.err.find("--nproc-per-node 5000: use 1 to 1024 processes"), std::string::npos) << many.err;
  const auto no_wait = run_loom({"validate", dp_pipeline(dir, kLora).string(), "--set", "run.timeout=0"});
  EXPECT_EQ(no_wait.exit_code, 2);
  EXPECT_NE(no_wait.err.find("--set run.timeout"), std::string::npos) << no_wait.err;
  // A tensor size the model's heads do not divide is refused before any plan, at its key.
  const auto tp = run_loom({"plan", dp_pipeline(dir, kLora, "[parallel]\ntensor = 3").string(), "--nproc-per-node", "3"});
  EXPECT_EQ(tp.exit_code, 2);
  EXPECT_NE(tp.err.find("p.toml:35:10: [parallel] tensor = 3: model plugin 'llama' cannot split this model: its 4 attention heads"), std::string::npos)
      << tp.err;

  // A pipeline names devices as each rank sees them: cuda:0 is every rank's first GPU.
  const auto text = run_loom({"plan", dp_pipeline(dir, kLora, "batch_size = 4").string(), "--nproc-per-node", "2", "--devices",
                              "cuda:0=80GiB,cuda:1=80GiB,cpu=64GiB", "--set", "placement.device=\"cuda:0\""});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("mesh: data 2 x pipeline 1 x tensor 1 = 2 ranks"), std::string::npos) << text.out;
  // Each rank's share of the run's draws: the copy task's samples are at most 15 tokens ([data]
  // max_length 32).
  EXPECT_NE(text.out.find("batch 4 x 15 tokens per data rank (8 in all)"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("activations for the run's largest micro-batch from its data: 4 rows of 15 tokens"), std::string::npos)
      << text.out;
  const auto json = run_loom({"plan", dp_pipeline(dir, kLora, "batch_size = 4").string(), "--nproc-per-node", "2", "--devices",
                              "cuda:0=80GiB,cuda:1=80GiB,cpu=64GiB", "--json", "--set", "placement.device=\"cuda:0\""});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const auto plan = nlohmann::json::parse(json.out);
  ASSERT_EQ(plan["ranks"].size(), 2u);
  EXPECT_EQ(plan["ranks"][0]["devices"][0]["device"], "cuda:0");
  EXPECT_EQ(plan["ranks"][1]["devices"][0]["device"], "cuda:1");
  EXPECT_EQ(plan["ranks"][1]["data"], 1);
  EXPECT_EQ(plan["ranks"][1]["blocks"].size(), 5u);  // embed, 2 layers, norm, head
  // Three processes cannot share two GPUs evenly: they get none, and a plan that wants one says so
  // (CPU ranks on that host still run).
  const auto uneven = run_loom({"plan", dp_pipeline(dir, kLora, "batch_size = 4").string(), "--nproc-per-node", "3", "--devices",
                                "cuda:0=80GiB,cuda:1=80GiB,cpu=64GiB", "--set", "placement.device=\"cuda:0\""});
  EXPECT_EQ(uneven.exit_code, 2);
  EXPECT_NE(uneven.err.find("device cuda:0 is not available here (devices: cpu) (3 processes on this host cannot share its 2 GPU(s) evenly"),
            std::string::npos)
      << uneven.err;
  const auto on_cpu = run_loom({"plan", dp_pipeline(dir, kLora, "batch_size = 4").string(), "--nproc-per-node", "3", "--devices",
                                "cuda:0=80GiB,cuda:1=80GiB,cpu=64GiB"});
  EXPECT_EQ(on_cpu.exit_code, 0) << on_cpu.err;
}

}  // namespace
}  // namespace loom::test
