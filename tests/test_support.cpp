#include "test_support.hpp"

#include <execinfo.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include "cli/cli.hpp"
#include "distributed/distributed.hpp"
#include "cli/logits.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/layers.hpp"
#include "loom/kit/json.hpp"
#include "plugins/plugin_registry.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_TESTS_UNDER_ASAN
#endif
#endif

namespace loom::test {
namespace fs = std::filesystem;

namespace {

// AddressSanitizer reserves terabytes of shadow at start, so an address-space limit (ulimit -v)
// kills a sanitized child before main. There the same bound is AddressSanitizer's own: the child
// dies once its resident memory passes it, which fails the test as the limit would.
void limit_address_space(std::uint64_t bytes) {
  if (bytes == 0) return;
#ifdef LOOM_TESTS_UNDER_ASAN
  const char* options = std::getenv("ASAN_OPTIONS");
  std::string merged = options ? options : "";
  if (!merged.empty()) merged += ':';
  merged += "hard_rss_limit_mb=" + std::to_string(bytes >> 20);
  setenv("ASAN_OPTIONS", merged.c_str(), 1);
#else
  const rlimit limit{bytes, bytes};
  if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(127);
#endif
}

}  // namespace

int start_loom(const std::vector<std::string>& args, const fs::path& out, const fs::path& err,
               const std::map<std::string, std::string>& env, const fs::path& cwd, const ChildLimits& limits = {}) {
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    for (const auto& [resource, value] : {std::pair{RLIMIT_FSIZE, limits.file_bytes}, std::pair{RLIMIT_NOFILE, limits.open_files}}) {
      const rlimit limit{value, value};
      if (value > 0 && setrlimit(resource, &limit) != 0) _exit(127);
    }
    for (const auto& [k, v] : env) v.empty() ? unsetenv(k.c_str()) : setenv(k.c_str(), v.c_str(), 1);
    limit_address_space(limits.address_bytes);
    if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(127);
    const int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(o, 1);
    dup2(e, 2);
    const int null_in = open("/dev/null", O_RDONLY);
    dup2(null_in, 0);
    std::vector<char*> argv;
    std::string binary = LOOM_BINARY;
    argv.push_back(binary.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

int start_loom(const std::vector<std::string>& args, const fs::path& out, const fs::path& err) {
  return start_loom(args, out, err, {}, {});
}

int start_loom_with_env(const std::vector<std::string>& args, const fs::path& out, const fs::path& err,
                        const std::map<std::string, std::string>& env) {
  return start_loom(args, out, err, env, {});
}

int wait_child_within(int pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

std::vector<int> live_processes_with(const std::string& variable) {
  std::vector<int> found;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream environ(entry.path() / "environ", std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(environ)), std::istreambuf_iterator<char>());
    if (('\0' + text).find('\0' + variable + '\0') == std::string::npos) continue;
    // A zombie has ended; only its parent's wait is missing.
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z') continue;
    found.push_back(std::stoi(name));
  }
  return found;
}

namespace {
std::vector<std::string>& gpu_test_names() {
  static std::vector<std::string> names;
  return names;
}
}  // namespace

const std::vector<std::string>& gpu_tests() { return gpu_test_names(); }

bool register_gpu_test(const char* name) {
  gpu_test_names().push_back(name);
  return true;
}

bool wait_until(const std::function<bool()>& done, std::chrono::seconds limit, std::chrono::milliseconds every) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done())
    if (std::chrono::steady_clock::now() > deadline) return false;
    else std::this_thread::sleep_for(every);
  return true;
}

int wait_child(int pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

CommandResult run_loom_with_file_limit(const std::vector<std::string>& args, std::uint64_t max_file_bytes) {
  ChildLimits limits;
  limits.file_bytes = max_file_bytes;
  return run_loom_with_limits(args, {}, limits);
}

CommandResult run_loom_with_limits(const std::vector<std::string>& args, const std::map<std::string, std::string>& env, const ChildLimits& limits) {
  const fs::path dir = temp_dir();
  CommandResult r;
  const int pid = start_loom(args, dir / "stdout", dir / "stderr", env, {}, limits);
  r.exit_code = limits.wall.count() > 0 ? wait_child_within(pid, limits.wall) : wait_child(pid);
  r.out = read_file(dir / "stdout");
  r.err = read_file(dir / "stderr");
  return r;
}

CommandResult run_loom_process(const std::vector<std::string>& args, const std::map<std::string, std::string>& env, const fs::path& cwd) {
  const fs::path dir = temp_dir();
  CommandResult r;
  r.exit_code = wait_child(start_loom(args, dir / "stdout", dir / "stderr", env, cwd));
  r.out = read_file(dir / "stdout");
  r.err = read_file(dir / "stderr");
  return r;
}

namespace {

// A crash inside a command run in this process happens while its stderr goes to a file: the
// signal, the stack and the folder of that file go to the test's own stderr instead, so ctest
// shows what crashed where.
int original_stderr = -1;
std::atomic<const char*> capture_folder{nullptr};

[[maybe_unused]] void report_crash(int signal) {  // unused under ASan, which reports crashes itself
  const int fd = original_stderr >= 0 ? original_stderr : 2;
  char line[256];
  const int n = std::snprintf(line, sizeof line, "\nloom_tests: signal %d (%s)%s%s; stack:\n", signal, strsignal(signal),
                              capture_folder.load() ? ", the command's output is in " : "", capture_folder.load() ? capture_folder.load() : "");
  [[maybe_unused]] const auto written = ::write(fd, line, static_cast<std::size_t>(std::max(0, n)));
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), fd);
  ::signal(signal, SIG_DFL);
  ::raise(signal);
}

#ifndef LOOM_TESTS_UNDER_ASAN  // AddressSanitizer reports these itself
// Commands run in this process allocate as they do in `loom`.
[[maybe_unused]] const bool allocator_tuned = [] {
  core::tune_host_allocator();
  return true;
}();

[[maybe_unused]] const bool crash_reports_installed = [] {
  original_stderr = ::dup(2);
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::signal(s, report_crash);
  return true;
}();
#endif

// LibTorch 2.x's flight recorder adds each process group to a map outside its lock at the group's
// first collective: the ranks-as-threads of run_loom_ranks, each creating its groups, corrupted
// that map (a crash in ProcessGroupGloo::enqueue, seen with torch 2.11). The tests read no traces.
[[maybe_unused]] const bool flight_recorder_off = [] {
  ::setenv("TORCH_FR_BUFFER_SIZE", "0", 1);
  ::setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0", 1);
  return true;
}();

// While alive: the process's stdout and stderr go to files in `dir`, stdin reads nothing, the
// environment and working folder are as asked; all restored on destruction.
class InProcessCall {
 public:
  InProcessCall(const fs::path& dir, const std::map<std::string, std::string>& env, const fs::path& cwd) : dir_(dir), dir_text_(dir.string()) {
    capture_folder = dir_text_.c_str();
    for (const auto& [k, v] : env) {
      const char* before = std::getenv(k.c_str());
      env_.emplace_back(k, before ? std::optional<std::string>(before) : std::nullopt);
      v.empty() ? unsetenv(k.c_str()) : setenv(k.c_str(), v.c_str(), 1);
    }
    if (!cwd.empty()) {
      cwd_ = fs::current_path();
      fs::current_path(cwd);
    }
    flush();
    const int in = open("/dev/null", O_RDONLY);
    const int out = open((dir / "stdout").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = open((dir / "stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (int fd = 0; fd < 3; ++fd) saved_[fd] = dup(fd);
    if (in < 0 || out < 0 || err < 0 || saved_[0] < 0 || saved_[1] < 0 || saved_[2] < 0) throw std::runtime_error("cannot redirect the standard streams");
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
    for (int fd : {in, out, err}) close(fd);
  }
  ~InProcessCall() {
    capture_folder = nullptr;
    flush();
    for (int fd = 0; fd < 3; ++fd) {
      dup2(saved_[fd], fd);
      close(saved_[fd]);
    }
    std::cin.clear();
    if (!cwd_.empty()) fs::current_path(cwd_);
    for (const auto& [k, v] : env_) v ? setenv(k.c_str(), v->c_str(), 1) : unsetenv(k.c_str());
  }
  InProcessCall(const InProcessCall&) = delete;
  InProcessCall& operator=(const InProcessCall&) = delete;

  CommandResult result(int code) const {
    flush();
    return {code, read_file(dir_ / "stdout"), read_file(dir_ / "stderr")};
  }

 private:
  static void flush() {
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
  }
  fs::path dir_, cwd_;
  std::string dir_text_;
  int saved_[3] = {-1, -1, -1};
  std::vector<std::pair<std::string, std::optional<std::string>>> env_;
};

std::vector<std::string> loom_argv(const std::vector<std::string>& args) {
  // A launch starts copies of the running program, which here is the test binary.
  std::string command;
  for (std::size_t i = 0; i < args.size() && command.empty(); ++i) {
    if (args[i] == "--log-level") ++i;
    else if (args[i].rfind("-", 0) != 0) command = args[i];
  }
  for (const auto& a : args)
    if ((command == "run" || command == "generate") && a.rfind("--nproc-per-node", 0) == 0)
      throw std::logic_error("run_loom runs loom inside the test process, which cannot launch workers: use run_loom_process for the launcher, "
                             "run_loom_ranks for ranks as threads");
  std::vector<std::string> argv{LOOM_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

core::Rendezvous loopback_rank(int rank, int world, int port) {
  core::Rendezvous r;
  r.rank = rank;
  r.world = world;
  r.local_rank = rank;
  r.local_world = world;
  r.master_addr = "127.0.0.1";
  r.master_port = port;
  r.source = "threads";
  return r;
}

}  // namespace

CommandResult run_loom(const std::vector<std::string>& args, const std::map<std::string, std::string>& env, const fs::path& cwd) {
  const auto argv = loom_argv(args);
  const InProcessCall call(temp_dir(), env, cwd);
  return call.result(core::run_cli(argv));
}

CommandResult run_loom_ranks(const std::vector<std::string>& args, int world) {
  const auto argv = loom_argv(args);
  // Each rank sets the threads of its own CPU work ([train] threads); OpenBLAS's pool is one for
  // the process and cannot be resized while another rank multiplies: it is sized here, once.
  kit::compat::set_cpu_threads(1);
  const int port = free_port();
  std::vector<int> codes(static_cast<std::size_t>(world), 0);
  const InProcessCall call(temp_dir(), {}, {});
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank)
    threads.emplace_back([&, rank] { codes[static_cast<std::size_t>(rank)] = core::run_cli(argv, loopback_rank(rank, world, port)); });
  for (auto& t : threads) t.join();
  int code = 0;
  for (int c : codes)
    if (code == 0) code = c;
  return call.result(code);
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

void on_ranks(const Mesh& mesh, const std::function<void(Parallel&)>& body, std::chrono::seconds timeout) {
  const int port = free_port();
  std::vector<std::string> failures(static_cast<std::size_t>(mesh.world()));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < mesh.world(); ++rank)
    threads.emplace_back([&, rank] {
      try {
        auto parallel = core::connect(loopback_rank(rank, mesh.world(), port), mesh, false, timeout, std::max(timeout, std::chrono::seconds(60)));
        body(*parallel);
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(rank)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < mesh.world(); ++rank) EXPECT_EQ(failures[static_cast<std::size_t>(rank)], "") << "rank " << rank;
}

int kill_rank_one_after_checkpoint(const fs::path& pipeline, const fs::path& out) {
  const int launcher = start_loom({"run", pipeline.string(), "--output", out.string(), "--nproc-per-node", "2"}, out.string() + ".out", out.string() + ".err");
  wait_until([&] { return fs::exists(out / "checkpoints/latest"); }, std::chrono::seconds(120), std::chrono::milliseconds(5));
  // Rank 1 is the launcher's second child.
  const std::string children = read_file("/proc/" + std::to_string(launcher) + "/task/" + std::to_string(launcher) + "/children");
  std::istringstream ids(children);
  int rank0 = 0, rank1 = 0;
  ids >> rank0 >> rank1;
  if (rank1 <= 0) {
    kill(launcher, SIGKILL);
    wait_child(launcher);
    return -1;
  }
  kill(rank1, SIGKILL);
  return wait_child_within(launcher, std::chrono::seconds(60));
}

void expect_same_losses(const fs::path& a, const fs::path& b, double tolerance) {
  const auto x = metrics_rows(a, true), y = metrics_rows(b, true);
  ASSERT_EQ(x.size(), y.size());
  ASSERT_FALSE(x.empty());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double p = x[i]["loss"].get<double>(), q = y[i]["loss"].get<double>();
    EXPECT_LE(std::abs(p - q), tolerance * std::abs(q)) << "step " << i + 1 << ": " << p << " vs " << q;
  }
  EXPECT_LT(x.back()["loss"].get<double>(), x.front()["loss"].get<double>()) << "it did not learn";
}

std::string copy_task(const fs::path& dir) {
  std::string train, eval;
  const char* words[] = {"ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv", "wx"};
  for (int i = 0; i < 96; ++i) {
    const std::string w = std::string(words[i % 12]) + words[(i / 12) % 12];
    (i < 84 ? train : eval) += "{\"q\": \"" + w + "\", \"a\": \"" + w + "\"}\n";
  }
  write_file(dir / "train.jsonl", train);
  write_file(dir / "eval.jsonl", eval);
  return R"([model]
plugin = "llama"
init = "random"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 259
tie_word_embeddings = true
[tokenizer]
plugin = "bytes"
padding_side = "left"
pad_token = "eos"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
format = "Q:{q} A:{a}"
max_length = 32
[collator]
plugin = "completion-only"
response_template = " A:"
[placement]
plugin = "single"
)";
}

std::map<std::string, std::vector<std::int64_t>> copy_task_adapter_shapes(int layers, std::int64_t r, bool embedding) {
  std::map<std::string, std::vector<std::int64_t>> out;
  if (embedding) out["base_model.model.model.embed_tokens.weight"] = {259, 32};
  const std::vector<std::tuple<std::string, std::int64_t, std::int64_t>> linears = {
      {"self_attn.q_proj", 32, 32}, {"self_attn.k_proj", 16, 32}, {"self_attn.v_proj", 16, 32}, {"self_attn.o_proj", 32, 32},
      {"mlp.gate_proj", 64, 32},    {"mlp.up_proj", 64, 32},      {"mlp.down_proj", 32, 64}};
  for (int layer = 0; layer < layers; ++layer)
    for (const auto& [name, rows, cols] : linears) {
      const std::string key = "base_model.model.model.layers." + std::to_string(layer) + "." + name;
      out[key + ".lora_A.weight"] = {r, cols};
      out[key + ".lora_B.weight"] = {rows, r};
    }
  return out;
}

std::vector<nlohmann::json> metrics_rows(const fs::path& metrics, bool training_only) {
  std::vector<nlohmann::json> rows;
  std::istringstream in(read_file(metrics));
  std::string line;
  while (std::getline(in, line)) {
    auto row = nlohmann::json::parse(line);
    if (training_only && row.contains("eval")) continue;
    row.erase("tokens_per_s");  // wall-clock, differs between runs
    row.erase("time");
    rows.push_back(row);
  }
  return rows;
}

int expect_adapted_layers_equal_their_sums(LoadedModel& model, double tolerance) {
  int layers = 0;
  for (const auto& l : model.linears()) {
    if (l.layer == nullptr || !l.layer->adapter()) continue;
    SCOPED_TRACE(l.name);
    AdaptableLinear& layer = *l.layer;
    for (auto& p : layer.base().parameters()) p.requires_grad_(false);
    auto params = layer.adapter()->parameters();
    if (params.size() != 2u) {
      ADD_FAILURE() << params.size() << " adapter parameters";
      continue;
    }
    for (auto& p : params) {
      p.requires_grad_(false);
      if (p.abs().max().item<double>() == 0) p.normal_(0, 0.1);  // B starts at zero: make the delta count
      p.requires_grad_(true);
    }
    const auto dtype = layer.options().dtype();
    const at::Tensor x0 = at::randn({2, 5, layer.in_features}).to(dtype), g = at::randn({2, 5, layer.out_features}).to(dtype);
    const bool whole = dynamic_cast<WholeProduct*>(layer.adapter().get()) != nullptr;
    const auto run = [&](bool composite) {
      for (auto& p : params) p.mutable_grad() = at::Tensor();
      const at::Tensor x = x0.clone().requires_grad_(true);
      const at::Tensor y = composite ? layer.base().forward(x, layer.bias) + layer.adapter()->delta(x) : layer.forward(x);
      if (!composite) {
        // Into the base's own output, not a view of it: autograd would copy the whole gradient
        // in backward (CopySlices).
        const auto& fn = y.grad_fn();
        EXPECT_EQ(std::string(fn->name()).find("CopySlices"), std::string::npos) << fn->name();
        for (const auto& edge : fn->next_edges()) {
          if (edge.function) {
            EXPECT_EQ(std::string(edge.function->name()).find("CopySlices"), std::string::npos) << edge.function->name();
          }
        }
        // One node for the layer, under the view back to [2, 5, out].
        if (whole) {
          const auto& product = fn->next_edges().at(0).function;
          EXPECT_NE(product ? std::string(product->name()).find("LoraProduct") : std::string::npos, std::string::npos)
              << (product ? product->name() : "no node");
        }
      }
      y.backward(g);
      return std::vector<at::Tensor>{y.detach(), x.grad(), params[0].grad().clone(), params[1].grad().clone()};
    };
    const auto want = run(true), got = run(false);
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(at::allclose(got[i].to(at::kFloat), want[i].to(at::kFloat), tolerance, tolerance))
          << i << ": " << (got[i].to(at::kFloat) - want[i].to(at::kFloat)).abs().max().item<double>();
    ++layers;
  }
  return layers;
}

fs::path temp_dir() {
  static std::atomic<int> counter{0};
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "loom";
  const fs::path dir = fs::temp_directory_path() / ("loom-test-" + std::to_string(getpid())) /
                       (name + "-" + std::to_string(counter++));
  kit::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

void write_file(const fs::path& path, const std::string& content) {
  if (path.has_parent_path()) fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << content;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

fs::path source_dir() { return LOOM_SOURCE_DIR; }
fs::path test_plugin_dir(const std::string& test_case) { return fs::path(LOOM_TEST_PLUGIN_ROOT) / test_case; }
fs::path builtin_plugin_dir() { return LOOM_BUILTIN_PLUGIN_DIR; }

std::unique_ptr<Plugin> make_plugin_object(const std::string& kind, const std::string& name,
                                           const std::map<std::string, OptionValue>& given) {
  static core::PluginRegistry registry = [] {
    core::PluginRegistry r;
    r.scan_directory(builtin_plugin_dir(), true);
    return r;
  }();
  const auto* p = registry.find(kind, name);
  if (p == nullptr) throw std::logic_error("no built-in " + kind + " plugin " + name);
  Options o;
  for (const auto& s : p->schema)
    if (s.default_value) o.set(s.name, *s.default_value);
  for (const auto& [k, v] : given) o.set(k, v);
  return registry.create(*p, o);
}

// The built-in model plugin that reads the folder's model_type, as each declares its types.
std::string model_plugin_of(const fs::path& folder) {
  const auto config = nlohmann::json::parse(read_file(folder / "config.json"));
  const std::string type = config.at("model_type");
  core::PluginRegistry registry;
  registry.scan_directory(builtin_plugin_dir(), true);
  for (const auto* plugin : registry.of_kind("model"))
    if (std::find(plugin->model_types.begin(), plugin->model_types.end(), type) != plugin->model_types.end()) return plugin->name;
  throw std::runtime_error(folder.string() + ": no built-in model plugin reads model_type " + type);
}

std::unique_ptr<Model> llama_from_config(const std::string& config_json) {
  const auto dir = temp_dir();
  write_file(dir / "config.json", config_json);
  core::PluginRegistry registry;
  registry.scan_directory(builtin_plugin_dir(), true);
  Options o;
  o.set("path", dir.string());
  o.set("init", std::string("pretrained"));
  auto object = registry.create(*registry.find("model", "llama"), o);
  return std::unique_ptr<Model>(dynamic_cast<Model*>(object.release()));
}

fs::path copy_task_pipeline(const fs::path& dir, int layers, bool tied, const std::string& placement, const std::string& adapter,
                            const std::string& train, const std::string& extra) {
  std::string sections = copy_task(dir);
  const auto swap = [&](const std::string& from, const std::string& to) {
    const auto at = sections.find(from);
    if (at == std::string::npos) throw std::logic_error("copy_task_pipeline: the copy task has no '" + from + "'");
    sections.replace(at, from.size(), to);
  };
  swap("num_hidden_layers = 2", "num_hidden_layers = " + std::to_string(layers));
  swap("tie_word_embeddings = true", std::string("tie_word_embeddings = ") + (tied ? "true" : "false"));
  swap("[placement]\nplugin = \"single\"\n", placement);
  write_file(dir / "p.toml", "[run]\nseed = 7\ntimeout = 60\n" + sections + "[train]\nlr = 1e-2\nlog_every = 1\neval_samples = 12\nmax_new_tokens = 6\nthreads = 1\n" +
                                 train + "\n" + adapter + extra);
  return dir / "p.toml";
}

std::vector<bool> exact_answers(const std::string& generated, const std::vector<std::string>& prompts, const std::vector<std::string>& answers) {
  std::vector<bool> out;
  std::istringstream lines(generated);
  std::string line;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    if (i > 0 && (!std::getline(lines, line) || !line.empty())) {  // the empty line between answers
      ADD_FAILURE() << "no empty line before prompt " << prompts[i] << " in:\n" << generated;
      return out;
    }
    if (!std::getline(lines, line) || line.rfind(prompts[i], 0) != 0) {
      ADD_FAILURE() << "no line for prompt " << prompts[i] << " in:\n" << generated;
      return out;
    }
    std::string answer = line.substr(prompts[i].size());
    const auto b = answer.find_first_not_of(" \t\r"), e = answer.find_last_not_of(" \t\r");
    answer = b == std::string::npos ? "" : answer.substr(b, e - b + 1);
    out.push_back(answer == answers[i]);
  }
  return out;
}

Samples expect_trained_samples_answered(const fs::path& pipeline, const fs::path& out, const std::vector<std::string>& overrides,
                                        std::string& generated) {
  Samples samples;
  std::string seen;
  for (const char* w : {"abab", "cdab", "efab", "ghab", "ijab", "klab"}) {
    seen += std::string("{\"q\": \"") + w + "\", \"a\": \"" + w + "\"}\n";
    samples.prompts.push_back(std::string("Q:") + w + " A:");
    samples.answers.push_back(w);
  }
  write_file(pipeline.parent_path() / "seen.jsonl", seen);
  std::vector<std::string> run = {"run", pipeline.string(), "--output", out.string(), "--set", "train.max_steps=100", "--set", "data.eval=" + (pipeline.parent_path() / "seen.jsonl").string()};
  run.insert(run.end(), overrides.begin(), overrides.end());
  const auto learned = run_loom(run);
  EXPECT_EQ(learned.exit_code, 0) << learned.err;
  const auto last = last_eval(out / "metrics.jsonl");
  const double reported = last["exact_match"].get<double>();
  EXPECT_GE(reported, 0.5) << "the model did not learn the samples it trained on: " << last;
  std::vector<std::string> generate = {"generate", pipeline.string(), "--adapter", (out / "adapter").string(), "--max-new-tokens", "6"};
  for (const auto& p : samples.prompts) generate.insert(generate.end(), {"--prompt", p});
  const auto g = run_loom(generate);
  EXPECT_EQ(g.exit_code, 0) << g.err;
  generated = g.out;
  const auto exact = exact_answers(g.out, samples.prompts, samples.answers);
  EXPECT_DOUBLE_EQ(reported, static_cast<double>(std::count(exact.begin(), exact.end(), true)) / static_cast<double>(samples.prompts.size())) << g.out;
  // An answer that ended before 6 tokens drew the end of sequence, which the text leaves out: said once.
  if (std::count(exact.begin(), exact.end(), true) > 0)
    EXPECT_TRUE(g.err.find("note: the text leaves out special tokens the answers drew: '") != std::string::npos) << g.err;
  return samples;
}

nlohmann::json last_eval(const fs::path& metrics) {
  std::istringstream in(read_file(metrics));
  std::string line, last;
  while (std::getline(in, line))
    if (line.find("\"eval\":true") != std::string::npos) last = line;
  return nlohmann::json::parse(last);
}

std::map<std::string, at::Tensor> tensors_of(const fs::path& dir) {
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") {
      const kit::SafetensorsFile f(entry.path());
      for (const auto& info : f.tensors()) out[info.name] = f.tensor(info.name).clone();
    }
  return out;
}

namespace {
// Each pair of same-named tensors of two folders (the names and shapes must agree), in double.
void for_each_pair(const fs::path& a, const fs::path& b, const std::function<void(const std::string&, const at::Tensor&, const at::Tensor&)>& check) {
  const auto x = tensors_of(a), y = tensors_of(b);
  ASSERT_FALSE(x.empty());
  std::set<std::string> xs, ys;
  for (const auto& [k, v] : x) xs.insert(k);
  for (const auto& [k, v] : y) ys.insert(k);
  ASSERT_EQ(xs, ys);
  for (const auto& [name, t] : x) {
    const at::Tensor u = y.at(name);
    ASSERT_EQ(t.sizes(), u.sizes()) << name;
    check(name, t.to(at::kDouble), u.to(at::kDouble));
  }
}
}  // namespace

void expect_same_tensors(const fs::path& a, const fs::path& b, double tolerance) {
  for_each_pair(a, b, [&](const std::string& name, const at::Tensor& t, const at::Tensor& u) {
    const double diff = (t - u).abs().max().item<double>();
    const double scale = std::max(1e-3, u.abs().max().item<double>());
    EXPECT_LE(diff, tolerance * scale) << name;
  });
}

void expect_close_in_norm(const fs::path& a, const fs::path& b, double tolerance) {
  for_each_pair(a, b, [&](const std::string& name, const at::Tensor& t, const at::Tensor& u) {
    const double diff = (t - u).norm().item<double>(), scale = std::max(1e-6, u.norm().item<double>());
    EXPECT_LE(diff, tolerance * scale) << name << ": " << diff / scale << " of its norm; the largest element apart: " << (t - u).abs().max().item<double>()
                                       << " of " << u.abs().max().item<double>();
  });
}

double float32_path_bound(const fs::path& config, std::int64_t tokens) {
  const nlohmann::json text = kit::json::read_file(config, 1 << 20, "model config");
  const kit::json::Value c(text, config.string());
  const double hidden = c["hidden_size"].number(), heads = c["num_attention_heads"].number(), rows = static_cast<double>(tokens);
  const double head_dim = c.has("head_dim") ? c["head_dim"].number() : hidden / heads;
  const double per_layer = 3 * hidden + head_dim + rows + 2 * c["intermediate_size"].number();
  const double path = c["num_hidden_layers"].number() * per_layer + hidden + c["vocab_size"].number() + rows;
  return path * std::numeric_limits<float>::epsilon();
}

fs::path parity_fixture(const std::string& name) {
  return source_dir() / "tests/fixtures" / (name.rfind("families/", 0) == 0 ? fs::path(name) : fs::path("parity") / name);
}

std::string fixture_test_name(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  std::replace(name.begin(), name.end(), '/', '_');
  return name;
}

std::uint64_t expect_same_checkpoint(const fs::path& mine, const fs::path& theirs) {
  const kit::SafetensorsFile saved(mine / "model.safetensors"), published(theirs / "model.safetensors");
  EXPECT_EQ(saved.tensors().size(), published.tensors().size());
  std::uint64_t values = 0;
  for (const auto& info : published.tensors()) {
    SCOPED_TRACE(info.name);
    if (saved.find(info.name) == nullptr) {
      ADD_FAILURE() << "not saved: " << info.name;
      continue;
    }
    EXPECT_TRUE(at::equal(saved.tensor(info.name), published.tensor(info.name)));
    values += static_cast<std::uint64_t>(published.tensor(info.name).numel());
  }
  return values;
}

ParityInputs read_parity_inputs(const fs::path& dir) {
  const auto j = nlohmann::json::parse(read_file(dir / "inputs.json"));
  const auto tensor = [](const nlohmann::json& rows) {
    std::vector<std::int64_t> flat;
    for (const auto& r : rows)
      for (const auto& v : r) flat.push_back(v.get<std::int64_t>());
    return at::tensor(flat, at::kLong).view({static_cast<std::int64_t>(rows.size()), -1});
  };
  return {tensor(j["input_ids"]), tensor(j["attention_mask"]), tensor(j["position_ids"])};
}

double max_real_error(const at::Tensor& a, const at::Tensor& b, const at::Tensor& mask) { return core::max_real_difference(a, b, mask); }

nlohmann::json tiny_tokenizer() {
  nlohmann::json vocab = nlohmann::json::object();
  const std::vector<std::string> alphabet = [] {
    // GPT-2's byte alphabet, as tokenizer.json writes it.
    std::vector<std::string> t;
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const int cp = printable ? b : next++;
      std::string s;
      if (cp < 0x80) s.push_back(static_cast<char>(cp));
      else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      t.push_back(s);
    }
    return t;
  }();
  for (int b = 0; b < 256; ++b) vocab[alphabet[static_cast<std::size_t>(b)]] = b;
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  return {{"version", "1.0"},
          {"added_tokens", {{{"id", 258}, {"content", "<eos>"}, {"special", true}, {"normalized", false}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a b", "ab c"}}}}};
}

}  // namespace loom::test
