// Faults around a run rather than inside its arithmetic: who owns the output folder, what the
// launcher leaves behind, what the watchdog calls a hang, what --resume accepts, and the
// rendezvous environments of launchers other than loom's own.
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include "distributed/distributed.hpp"
#include "loom/error.hpp"
#include "loom/kit/torch_compat.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;

// The copy task with LoRA, `steps` steps, a checkpoint every `checkpoint_every`.
fs::path lora_pipeline(const fs::path& dir, int steps, int checkpoint_every) {
  return copy_task_pipeline(dir, 2, true, "[placement]\nplugin = \"single\"\n", "[adapter]\nplugin = \"lora\"\nr = 8\ntarget_modules = \"all-linear\"\n",
                            "batch_size = 4\nmax_steps = " + std::to_string(steps) + "\ncheckpoint_every = " + std::to_string(checkpoint_every));
}

std::size_t metric_rows(const fs::path& out) { return fs::exists(out / "metrics.jsonl") ? metrics_rows(out / "metrics.jsonl", true).size() : 0; }

// Waits until the run writing `out` has logged `rows` steps (false after two minutes).
bool wait_for_rows(const fs::path& out, std::size_t rows) {
  return wait_until([&] { return metric_rows(out) >= rows; }, std::chrono::seconds(120));
}

// A mark in the environment of everything one test starts, to find what is still running.
std::string process_mark() { return "LOOM_TEST_MARK=" + std::to_string(::getpid()) + "-" + std::to_string(std::rand()); }

// Whether every process carrying `mark` ends within `limit`.
bool all_gone_within(const std::string& mark, std::chrono::seconds limit) {
  return wait_until([&] { return live_processes_with(mark).empty(); }, limit);
}

// A new run writes only under names that were free, and a failure before its first step takes back
// exactly those: a user's files in the folder, and the folder itself when it was there, stay.
TEST(OutputFolder, ARunTakesBackOnlyWhatItWrote) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 4, 0);
  write_file(dir / "mine/checkpoints/x.bin", "the user's");
  auto r = run_loom({"run", pipeline.string(), "--output", (dir / "mine").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, (dir / "mine/checkpoints").string() + " is in the way: a run writes checkpoints in its output folder")) << r.err;
  EXPECT_EQ(read_file(dir / "mine/checkpoints/x.bin"), "the user's");
  EXPECT_FALSE(fs::exists(dir / "mine/run.json"));

  // Line 85 of the training data is broken: the first records pass the checks, loading all of them
  // fails inside the run, after run.json and metrics.jsonl were written.
  write_file(dir / "train.jsonl", read_file(dir / "train.jsonl") + "not json\n");
  write_file(dir / "kept/notes.txt", "notes");
  r = run_loom({"run", pipeline.string(), "--output", (dir / "kept").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "train.jsonl:85")) << r.err;
  EXPECT_EQ(read_file(dir / "kept/notes.txt"), "notes");
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir / "kept")) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"notes.txt"});
  r = run_loom({"run", pipeline.string(), "--output", (dir / "new").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_FALSE(fs::exists(dir / "new")) << "the folder the run created stays behind";
}

// One run per folder: a second run or a --resume of a live run is refused while it lives, and the
// lock dies with the process that held it (SIGKILL included). A refused --resume, and a dry one,
// leave run.json as it was.
TEST(OutputFolder, IsHeldByOneRunAtATime) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 100000, 2);
  const fs::path out = dir / "out";
  const int pid = start_loom({"run", pipeline.string(), "--output", out.string()}, dir / "r.out", dir / "r.err");
  ASSERT_TRUE(wait_for_rows(out, 3)) << read_file(dir / "r.err");
  const std::string manifest = read_file(out / "run.json");
  auto r = run_loom({"run", pipeline.string(), "--output", out.string(), "--resume"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, out.string() + " is in use by another loom run (it holds the folder's lock")) << r.err;
  EXPECT_EQ(r.err.find("loom: error:"), r.err.rfind("loom: error:")) << r.err;
  ::kill(pid, SIGKILL);
  EXPECT_EQ(wait_child(pid), 128 + SIGKILL);
  r = run_loom({"run", pipeline.string(), "--output", out.string(), "--resume", "--set", "train.lr=0.5"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "(changed: train.lr)")) << r.err;
  r = run_loom({"run", pipeline.string(), "--output", out.string(), "--resume", "--dry-run"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "which is left as it was")) << r.out;
  EXPECT_EQ(read_file(out / "run.json"), manifest);
}

// The folder is the run, wherever it was moved and however its path is spelled; how long a rank
// waits ([run] timeout), its threads and its length may change on resume, what it trains may not.
TEST(Resume, TheFolderIsTheRunWhereverItIs) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 4, 2);
  auto r = run_loom({"run", pipeline.string(), "--output", "out"}, {}, dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  fs::rename(dir / "out", dir / "moved");
  r = run_loom({"run", pipeline.string(), "--output", (dir / "moved/").string(), "--resume", "--set", "run.timeout=99"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = run_loom({"run", pipeline.string(), "--output", "./moved", "--resume", "--set", "train.threads=2"}, {}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = run_loom({"run", pipeline.string(), "--output", "moved", "--resume", "--set", "train.lr=0.5"}, {}, dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "(changed: train.lr)")) << r.err;
}

// Workers die with their launcher, however it ends; a launcher that cannot start them all stops
// those it started, says why in one line and exits 2.
TEST(Launcher, LeavesNoWorkerBehind) {
  const fs::path dir = temp_dir();
  // Workers that print nothing (no step lines, warnings only): a write to the dead launcher's pipe
  // would end them anyway, so the test keeps them silent; checkpoints show their progress.
  const auto pipeline = lora_pipeline(dir, 100000, 2);
  const std::string mark = process_mark();
  const auto eq = mark.find('=');
  const std::map<std::string, std::string> env{{mark.substr(0, eq), mark.substr(eq + 1)}};
  const int launcher = start_loom_with_env({"run", pipeline.string(), "--output", (dir / "out").string(), "--nproc-per-node", "2", "--set",
                                            "train.log_every=100000", "--log-level", "warn"},
                                           dir / "l.out", dir / "l.err", env);
  ASSERT_TRUE(wait_until([&] { return fs::exists(dir / "out/checkpoints/latest"); }, std::chrono::seconds(120))) << read_file(dir / "l.err");
  EXPECT_EQ(live_processes_with(mark).size(), 3u);
  ::kill(launcher, SIGKILL);
  EXPECT_EQ(wait_child(launcher), 128 + SIGKILL);
  EXPECT_TRUE(all_gone_within(mark, std::chrono::seconds(10))) << "workers outlived their launcher";

  const auto r = run_loom_with_limits({"run", pipeline.string(), "--output", (dir / "few").string(), "--nproc-per-node", "6"}, env,
                                      ChildLimits{0, 16});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "loom: error: cannot start 6 worker processes: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "open files are limited to 16: raise `ulimit -n`); none was left running")) << r.err;
  EXPECT_TRUE(live_processes_with(mark).empty());
}

// The watchdog measures waiting for other ranks, not computing: ranks that compute for longer
// than [run] timeout between two collectives are no hang (the process is not ended).
TEST(Watchdog, ComputingLongerThanTheTimeoutIsNoHang) {
  on_ranks(
      Mesh{2, 1, 1},
      [](Parallel& p) {
        // Past [run] timeout (1 s), the watchdog's grace (5 s) and its look at the heartbeats (3 s).
        std::this_thread::sleep_for(std::chrono::seconds(11));
        std::vector<at::Tensor> t{at::ones({1})};
        p.world().all_reduce(t, ReduceOp::kSum)->wait();
        EXPECT_EQ(t[0].item<float>(), 2.0f);
      },
      std::chrono::seconds(1));
}

// A rank allowed too few open files for its sockets is refused before it opens any (running out
// midway ended in an abort on one of c10d's threads).
TEST(Rendezvous, TooFewOpenFilesIsRefusedFirst) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 2, 0);
  const auto r = run_loom_with_limits({"run", pipeline.string(), "--output", (dir / "out").string()},
                                      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(free_port())}},
                                      ChildLimits{0, 64});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "loom: error: rank 0: a run of 2 processes needs about 264 open files per process")) << r.err;
  EXPECT_TRUE(contains(r.err, "this process may open 64 (hard limit 64); raise `ulimit -n`")) << r.err;
  EXPECT_FALSE(fs::exists(dir / "out")) << "the refused run left its folder";
}

// A rendezvous that fails is one line in loom's words: not c10's stack ("Exception raised from"),
// its socket warnings or glog's preamble.
TEST(Rendezvous, FailuresAreOneLineInLoomsWords) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 2, 0);
  const std::string port = std::to_string(free_port());  // nobody listens there
  const auto r = run_loom_process({"run", pipeline.string(), "--output", (dir / "out").string(), "--set", "run.timeout=2"},
                                  {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "loom: error: rank 1: cannot reach the rendezvous at 127.0.0.1:" + port + " (MASTER_ADDR, MASTER_PORT; torchrun): "))
      << r.err;
  EXPECT_EQ(r.err.find("loom: error:"), r.err.rfind("loom: error:")) << r.err;
  for (const char* noise : {"Exception raised from", "socket.cpp", "InitGoogleLogging", "frame #"}) EXPECT_FALSE(contains(r.err, noise)) << r.err;
}

// Two runs given one MASTER_PORT: a rank of one that reaches the other's rendezvous is refused,
// and refuses, in one line each; neither trains with a stranger's rank (rank 1 here resolves
// another seed, so another pipeline; launches with another LOOM_RUN_ID are told apart the same way).
TEST(Rendezvous, TwoRunsOnOnePortAreRefusedNotMixed) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 2, 0);
  const std::string port = std::to_string(free_port());
  std::vector<int> pids;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string r = std::to_string(rank);
    pids.push_back(start_loom_with_env({"run", pipeline.string(), "--output", (dir / ("out" + r)).string(), "--set", "run.seed=" + std::to_string(7 + rank)},
                                       dir / ("rank" + r + ".out"), dir / ("rank" + r + ".err"),
                                       {{"RANK", r}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}, {"LOOM_RUN_ID", ""}}));
  }
  for (int rank = 0; rank < 2; ++rank) {
    const int code = wait_child_within(pids[static_cast<std::size_t>(rank)], std::chrono::seconds(60));
    const std::string err = read_file(dir / ("rank" + std::to_string(rank) + ".err"));
    EXPECT_EQ(code, 2) << err;
    EXPECT_TRUE(contains(err, "loom: error: rank " + std::to_string(rank) + ": the rank(s) " + std::to_string(1 - rank) +
                                  " that joined the rendezvous at 127.0.0.1:" + port + " belong to another run (another pipeline or launch); "
                                  "give each run its own MASTER_PORT"))
        << err;
    EXPECT_FALSE(fs::exists(dir / ("out" + std::to_string(rank)) / "metrics.jsonl")) << "rank " << rank << " trained";
  }
}

// srun's environment as Slurm sets it: the tasks on this node come from SLURM_NTASKS_PER_NODE when
// given, else from SLURM_TASKS_PER_NODE's entry for this node; errors name Slurm's variables.
TEST(Rendezvous, SlurmTasksPerNode) {
  struct Env {
    std::vector<std::string> names;
    void set(const std::string& name, const std::string& value) {
      names.push_back(name);
      ::setenv(name.c_str(), value.c_str(), 1);
    }
    ~Env() {
      for (const auto& n : names) ::unsetenv(n.c_str());
    }
  } env;
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"}) ::unsetenv(name);
  env.set("SLURM_PROCID", "3");
  env.set("SLURM_NTASKS", "4");
  env.set("SLURM_LOCALID", "1");
  env.set("SLURM_NODEID", "1");
  env.set("SLURM_NNODES", "2");
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("MASTER_PORT", "29400");
  env.set("SLURM_TASKS_PER_NODE", "2(x2)");
  auto r = core::rendezvous_from_env();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->source, "slurm");
  EXPECT_EQ(r->rank, 3);
  EXPECT_EQ(r->local_rank, 1);
  EXPECT_EQ(r->local_world, 2);
  env.set("SLURM_TASKS_PER_NODE", "3,1");
  EXPECT_THROW(
      {
        try {
          core::rendezvous_from_env();
        } catch (const UserError& e) {
          EXPECT_TRUE(contains(e.what(), "SLURM_LOCALID 1 is not below the tasks on this node, 1")) << e.what();
          throw;
        }
      },
      UserError);
  env.set("SLURM_TASKS_PER_NODE", "1,3");
  EXPECT_EQ(core::rendezvous_from_env()->local_world, 3);
  env.set("SLURM_TASKS_PER_NODE", "two");
  EXPECT_THROW(core::rendezvous_from_env(), UserError);
  ::unsetenv("SLURM_TASKS_PER_NODE");
  EXPECT_EQ(core::rendezvous_from_env()->local_world, 2);  // 4 tasks over SLURM_NNODES = 2
  env.set("SLURM_NTASKS_PER_NODE", "4");
  EXPECT_EQ(core::rendezvous_from_env()->local_world, 4);
}

// What plan and run refuse about a pipeline's structure, validate refuses too, with no GPU or
// memory of this machine involved: stages over pipeline ranks, tensor splits of the model,
// interleaved micro-batch groups.
TEST(Validate, RefusesWhatPlanAndRunRefuse) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 2, 0);
  ASSERT_EQ(run_loom({"validate", pipeline.string()}).exit_code, 0);
  const std::string pipelined = "placement.plugin=\"pipeline\"";
  for (const auto& [sets, expected] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{pipelined, "parallel.pipeline=2", "placement.stages=3"}, "stages = 3 on 2 pipeline ranks"},
           {{"parallel.tensor=2", "model.intermediate_size=63"}, "its intermediate_size 63 does not split over 2 tensor ranks"},
           {{"parallel.tensor=3"}, "its 4 attention heads do not split over 3 tensor ranks"},
           {{pipelined, "parallel.pipeline=2", "placement.schedule=\"interleaved-1f1b\"", "train.grad_accum=3"},
            "interleaved-1f1b takes micro-batches in groups of the 2 pipeline ranks"}}) {
    std::vector<std::string> args{"validate", pipeline.string()};
    for (const auto& s : sets) args.insert(args.end(), {"--set", s});
    const auto r = run_loom(args);
    EXPECT_EQ(r.exit_code, 2) << sets.back();
    EXPECT_TRUE(contains(r.err, expected)) << r.err;
  }
}

// `loom generate --ids`: prompts as token ids, answers as the ids drawn, so a greedy check needs no
// detokenizing. The JSON form gives both ids beside the text; the ids of a text prompt given back
// with --ids draw the same answer, and its prompt plus the first drawn tokens the rest of it.
TEST(Generation, TakesAndPrintsTokenIds) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 1, 0).string();
  const auto as_text = [](const std::vector<std::int64_t>& ids) {
    std::string out;
    for (const auto id : ids) out += (out.empty() ? "" : " ") + std::to_string(id);
    return out;
  };
  const auto text = run_loom({"generate", pipeline, "--prompt", "Q:abcd A:", "--max-new-tokens", "6", "--ignore-eos", "--json"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  const auto answer = nlohmann::json::parse(text.out).at(0);
  const auto prompt = answer.at("prompt_ids").get<std::vector<std::int64_t>>(), drawn = answer.at("ids").get<std::vector<std::int64_t>>();
  ASSERT_EQ(drawn.size(), 6u);
  ASSERT_GT(prompt.size(), 3u);
  auto ids = run_loom({"generate", pipeline, "--ids", "--prompt", as_text(prompt), "--max-new-tokens", "6", "--ignore-eos"});
  ASSERT_EQ(ids.exit_code, 0) << ids.err;
  EXPECT_EQ(ids.out, as_text(drawn) + "\n");
  // Commas separate as spaces do; the JSON form's text is the text form's answer.
  std::string commas = as_text(prompt);
  std::replace(commas.begin(), commas.end(), ' ', ',');
  ids = run_loom({"generate", pipeline, "--ids", "--json", "--prompt", commas, "--max-new-tokens", "6", "--ignore-eos"});
  ASSERT_EQ(ids.exit_code, 0) << ids.err;
  const auto again = nlohmann::json::parse(ids.out).at(0);
  EXPECT_EQ(again.at("answer"), answer.at("answer"));
  EXPECT_EQ(again.at("ids"), answer.at("ids"));
  EXPECT_FALSE(again.contains("prompt"));
  // The prompt and the first two tokens drawn continue with the other four, through the cache.
  std::vector<std::int64_t> longer = prompt;
  longer.insert(longer.end(), drawn.begin(), drawn.begin() + 2);
  ids = run_loom({"generate", pipeline, "--ids", "--prompt", as_text(longer), "--prompt", as_text(prompt), "--max-new-tokens", "4", "--ignore-eos"});
  ASSERT_EQ(ids.exit_code, 0) << ids.err;
  EXPECT_EQ(ids.out, as_text({drawn.begin() + 2, drawn.end()}) + "\n" + as_text({drawn.begin(), drawn.begin() + 4}) + "\n");
  // What is not a list of the model's token ids: one line naming the prompt and the word.
  for (const auto& [args, expected] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--prompt", "1 2 x3"}, "--prompt (--ids): 'x3' is not a token id; give decimal ids separated by spaces or commas"},
           {{"--prompt", "1", "--prompt", "2 -5"}, "--prompt 2 (--ids): '-5' is not a token id"},
           {{"--prompt", "1 99999999999999999999"}, "'99999999999999999999' is not a token id"},
           {{"--prompt", "4 1000000"}, "--prompt (--ids): token id 1000000 is past the model's vocabulary of "},
           {{"--prompt", " , "}, "--prompt (--ids) holds no token ids"},
           {{"--prompt", "1 2", "--chat"}, "--ids takes prompts as token ids and --chat renders text through a template: use one of them"}}) {
    std::vector<std::string> command{"generate", pipeline, "--ids"};
    command.insert(command.end(), args.begin(), args.end());
    const auto r = run_loom(command);
    EXPECT_EQ(r.exit_code, 2) << args.back();
    EXPECT_TRUE(contains(r.err, expected)) << r.err;
  }
}

// Sampling temperatures: a finite number from 0; one too small to matter samples as greedy does.
TEST(Generation, TemperatureIsANumberFromZero) {
  const fs::path dir = temp_dir();
  const auto pipeline = lora_pipeline(dir, 1, 0);
  const auto generate = [&](const std::string& temperature) {
    return run_loom({"generate", pipeline.string(), "--prompt", "Q:abcd A:", "--max-new-tokens", "6", "--temperature", temperature});
  };
  const auto greedy = generate("0");
  ASSERT_EQ(greedy.exit_code, 0) << greedy.err;
  // A prompt passed in pieces of 1 or 2 tokens continues as a whole one does.
  for (const char* chunk : {"1", "2", "0"}) {
    const auto r = run_loom({"generate", pipeline.string(), "--prompt", "Q:abcd A:", "--max-new-tokens", "6", "--prompt-chunk", chunk});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, greedy.out) << "--prompt-chunk " << chunk;
  }
  for (const char* tiny : {"1e-40", "1e-320"}) {
    const auto r = generate(tiny);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, greedy.out) << tiny;
  }
  for (const char* bad : {"nan", "inf", "-1"}) {
    const auto r = generate(bad);
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_TRUE(contains(r.err, "--temperature must be a number from 0 (greedy) up")) << r.err;
  }
  // As many new tokens as an int64 holds: the prompt's tokens plus those overflowed the check
  // (a cache of -9223372036854775806 positions, then LibTorch's stack trace). One line instead.
  for (const char* many : {"9223372036854775807", "9223372036854775000", "100000"}) {
    const auto r = run_loom({"generate", pipeline.string(), "--prompt", "Q:ab A:", "--max-new-tokens", many});
    EXPECT_EQ(r.exit_code, 2) << many << r.err;
    EXPECT_TRUE(contains(r.err, "new ones pass the model's")) << r.err;
    EXPECT_TRUE(contains(r.err, "ask for at most")) << r.err;
    EXPECT_FALSE(contains(r.err, "internal error")) << r.err;
  }
  // Text from the command line is UTF-8, or one line says where it is not (it was an internal
  // error from the JSON library with --chat).
  for (const auto& args : std::vector<std::vector<std::string>>{{"--prompt", "ok \xff"}, {"--prompt", "ok", "--prompt", "\xc3("},
                                                                  {"--chat", "--system", "\xfe", "--prompt", "hi"}}) {
    std::vector<std::string> command{"generate", pipeline.string()};
    command.insert(command.end(), args.begin(), args.end());
    const auto r = run_loom(command);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "is not UTF-8; give the text in UTF-8")) << r.err;
  }
  EXPECT_TRUE(contains(run_loom({"generate", pipeline.string(), "--prompt", "ok", "--prompt", "\xc3("}).err, "--prompt 2: byte 0 is not UTF-8"));
  // The other sampling and batching numbers: each refused with its own line.
  for (const auto& [flag, value, expected] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--top-k", "-1", "--top-k must be 0 (all tokens) or more"}, {"--rows", "0", "--rows must be at least 1"},
           {"--prompt-chunk", "-1", "--prompt-chunk must be 0 (a whole prompt at once) or more"}}) {
    const auto r = run_loom({"generate", pipeline.string(), "--prompt", "Q:ab A:", flag, value});
    EXPECT_EQ(r.exit_code, 2) << flag;
    EXPECT_TRUE(contains(r.err, expected)) << r.err;
  }
  // What run refuses on this machine, generate refuses too.
  auto r = run_loom({"generate", pipeline.string(), "--prompt", "Q:ab A:", "--set", "train.threads=1024"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "[train] threads = 1024 is more than this machine's")) << r.err;
  if (kit::compat::cuda_device_count() > 0) return;
  r = run_loom({"generate", pipeline.string(), "--prompt", "Q:ab A:", "--set", "run.dtype=\"fp16\""});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "[run] dtype = \"fp16\" computes on CUDA devices only and this machine has none")) << r.err;
  r = run_loom({"generate", pipeline.string(), "--prompt", "Q:ab A:", "--set", "adapter.plugin=\"qlora\"", "--set", "adapter.compute_dtype=\"fp16\""});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "[adapter] compute_dtype = \"fp16\": ")) << r.err;
  EXPECT_TRUE(contains(r.err, " is on cpu, where fp16 products are not supported")) << r.err;
  r = run_loom({"validate", pipeline.string(), "--set", "adapter.plugin=\"qlora\"", "--set", "adapter.compute_dtype=\"fp16\""});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "adapter plugin 'qlora': [adapter] compute_dtype = \"fp16\": ")) << r.err;
}

}  // namespace
}  // namespace loom::test
