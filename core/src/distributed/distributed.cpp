#include "distributed/distributed.hpp"

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <thread>

#include <sys/resource.h>
#include <unistd.h>

#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#ifdef LOOM_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef LOOM_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "config/diagnostics.hpp"
#include "loom/error.hpp"
#include "loom/kit/json.hpp"

namespace loom::core {
namespace {

using Clock = std::chrono::steady_clock;

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, int lowest, int highest) {
  const auto v = env(name);
  if (!v) throw UserError("the environment sets a distributed launch but not " + std::string(name) + "; set it (or unset the others for one process)");
  try {
    std::size_t used = 0;
    const long n = std::stol(*v, &used);
    if (used == v->size() && n >= lowest && n <= highest) return static_cast<int>(n);
  } catch (const std::exception&) {
  }
  throw UserError(std::string(name) + "=" + kit::json::quote(*v, 40) + " is not an integer from " + std::to_string(lowest) + " to " + std::to_string(highest));
}

// How many of the job's tasks run on this node: SLURM_NTASKS_PER_NODE when the job set it (srun
// --ntasks-per-node), else this node's entry of SLURM_TASKS_PER_NODE ("2(x3),1": 2 on each of the
// first three nodes, 1 on the fourth), else an even split over SLURM_NNODES.
int slurm_tasks_on_this_node(int world) {
  if (env("SLURM_NTASKS_PER_NODE")) return env_int("SLURM_NTASKS_PER_NODE", 1, world);
  if (const auto spec = env("SLURM_TASKS_PER_NODE"); spec && env("SLURM_NODEID")) {
    int node = env_int("SLURM_NODEID", 0, 1 << 16);
    std::size_t at = 0;
    while (at < spec->size()) {
      const auto comma = std::min(spec->find(',', at), spec->size());
      const std::string entry = spec->substr(at, comma - at);
      int tasks = 0, repeat = 1;
      char close = 0;
      const int read = std::sscanf(entry.c_str(), "%d(x%d%c", &tasks, &repeat, &close);
      if (!(read == 1 || (read == 3 && close == ')')) || tasks < 1 || tasks > world || repeat < 1)
        throw UserError("SLURM_TASKS_PER_NODE=" + kit::json::quote(*spec, 60) + " is not Slurm's form (\"2(x3),1\"); set SLURM_NTASKS_PER_NODE");
      if (node < repeat) return tasks;
      node -= repeat;
      at = comma + 1;
    }
    throw UserError("SLURM_NODEID is past the nodes SLURM_TASKS_PER_NODE=" + kit::json::quote(*spec, 60) + " lists; set SLURM_NTASKS_PER_NODE");
  }
  if (env("SLURM_NNODES")) {
    const int nodes = env_int("SLURM_NNODES", 1, world);
    if (world % nodes == 0) return world / nodes;
  }
  throw UserError("a Slurm launch of " + std::to_string(world) + " tasks without SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE: loom cannot tell how " +
                  "many tasks share this node; run it with srun --ntasks-per-node N");
}

// The step of the last progress mark (note_progress), published with the heartbeat.
std::atomic<std::int64_t> progress_step{0};

// c10's errors carry the C++ stack where they were raised ("Exception raised from recvBytes at
// ..."); loom's messages keep what went wrong, its first line.
std::string reason(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10_error ? c10_error->what_without_backtrace() : e.what();
  if (const auto nl = text.find('\n'); nl != std::string::npos) text.resize(nl);
  return text;
}

// Open files a rank needs for its groups: a socket per peer per group (Gloo connects every pair),
// the store's, and room for the files a run reads and writes. A soft limit below it is raised to
// the hard one, which is what the user allowed; a lower hard limit is refused before any socket
// opens (running out midway ends in an exception on one of c10d's own threads: an abort).
void ensure_open_files(int rank, int world) {
  const rlim_t needed = static_cast<rlim_t>(4 * world + 256);
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= needed) return;
  if (limit.rlim_max >= needed) {
    rlimit raised{limit.rlim_max == RLIM_INFINITY ? needed : limit.rlim_max, limit.rlim_max};
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) return;
  }
  throw UserError("rank " + std::to_string(rank) + ": a run of " + std::to_string(world) + " processes needs about " + std::to_string(needed) +
                  " open files per process (a socket per peer and group), and this process may open " + std::to_string(limit.rlim_cur) +
                  " (hard limit " + (limit.rlim_max == RLIM_INFINITY ? std::string("unlimited") : std::to_string(limit.rlim_max)) +
                  "); raise `ulimit -n`");
}

std::int64_t now_ms() { return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count(); }

c10d::ReduceOp reduce_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// What every rank publishes in the store once a second: a heartbeat and where it is.
struct PeerState {
  bool present = false;
  std::int64_t beat = 0, step = 0;
};

// The store client the watchdog and failure messages share (a TCPStore client is one socket).
// The watchdog measures how long this rank has been waiting for the others (inside a collective),
// never how long it computes: a rank's own long work (an evaluation, a save) is no hang.
class Monitor {
 public:
  Monitor(c10::intrusive_ptr<c10d::Store> store, int rank, int world, std::chrono::seconds timeout)
      : store_(std::move(store)), rank_(rank), world_(world), timeout_(timeout) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Monitor() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

  // Why a collective failed, naming the rank when the heartbeats tell: one that stopped beating
  // died; one at an earlier step hangs.
  std::string explain(const std::string& what) {
    // The caller reports this failure; the watchdog stays quiet meanwhile.
    explaining_ = true;
    return explain_now(what);
  }

  // Around every blocking wait for other ranks (waits may nest or overlap across threads).
  void begin_wait() {
    std::lock_guard<std::mutex> lock(wait_mutex_);
    if (waits_++ == 0) waiting_since_ms_ = now_ms();
  }
  void end_wait() {
    std::lock_guard<std::mutex> lock(wait_mutex_);
    if (--waits_ == 0) waiting_since_ms_ = 0;
  }

 private:
  std::string explain_now(const std::string& what) {
    std::vector<PeerState> before = read_all();
    // Three seconds of the others' heartbeats; this rank keeps beating meanwhile, so that a rank
    // explaining a failure at the same moment does not take it for dead.
    for (int i = 0; i < 30; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      beat_if_due();
    }
    std::vector<PeerState> after = read_all();
    std::string dead, behind;
    const std::int64_t mine = progress_step.load();
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      const auto& a = before[static_cast<std::size_t>(r)];
      const auto& b = after[static_cast<std::size_t>(r)];
      if (!b.present || b.beat == a.beat) dead += (dead.empty() ? "" : ", ") + std::to_string(r);
      else if (b.step < mine) behind += (behind.empty() ? "" : ", ") + std::to_string(r) + " (at step " + std::to_string(b.step) + ")";
    }
    const std::string me = "rank " + std::to_string(rank_) + ": ";
    if (store_lost_) return me + "rank 0 is gone (it holds the run's rendezvous store): it died or was killed; " + what;
    if (!dead.empty())
      return me + (dead.find(',') == std::string::npos ? "rank " + dead + " stopped responding" : "ranks " + dead + " stopped responding") +
             " (no heartbeat: died, killed or frozen) while this rank waited at step " + std::to_string(mine) + "; " + what;
    if (!behind.empty())
      return me + "rank " + behind + " did not reach step " + std::to_string(mine) + " within [run] timeout = " + std::to_string(timeout_.count()) +
             " s (it is alive: a hang); " + what;
    return me + what;
  }

  static std::string key(int rank) { return "loom/beat/" + std::to_string(rank); }

  std::vector<PeerState> read_all() {
    std::vector<PeerState> out(static_cast<std::size_t>(world_));
    std::lock_guard<std::mutex> lock(mutex_);
    for (int r = 0; r < world_; ++r) {
      try {
        if (!store_->check({key(r)})) continue;
        const auto bytes = store_->get(key(r));
        const std::string text(bytes.begin(), bytes.end());
        auto& s = out[static_cast<std::size_t>(r)];
        s.present = std::sscanf(text.c_str(), "%ld %ld", &s.beat, &s.step) == 2;
      } catch (const std::exception&) {
        store_lost_ = true;
        return out;
      }
    }
    return out;
  }

  // Publishes this rank's heartbeat and step, at most once a second; throws when the store is gone.
  void beat_if_due() {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = now_ms();
    if (now - last_beat_ms_ < 1000) return;
    last_beat_ms_ = now;
    const std::string text = std::to_string(++beat_) + " " + std::to_string(progress_step.load());
    store_->set(key(rank_), std::vector<std::uint8_t>(text.begin(), text.end()));
  }

  void loop() {
    while (!stop_) {
      try {
        beat_if_due();
      } catch (const std::exception& e) {
        if (stop_) return;
        store_lost_ = true;
        report(explain_now("the rendezvous store failed: " + reason(e)));
        return;
      }
      // A collective past [run] timeout ends with its backend's error, which the waiting thread
      // explains; this is for a wait that never returns. The grace leaves that explanation first.
      const std::int64_t since = waiting_since_ms_.load();
      const auto waited = std::chrono::milliseconds(since == 0 ? 0 : now_ms() - since);
      if (since != 0 && waited > timeout_ + kGrace && !explaining_) {
        report(explain_now("waited " + std::to_string(std::chrono::duration_cast<std::chrono::seconds>(waited).count()) +
                           " s for the other ranks, past [run] timeout = " + std::to_string(timeout_.count()) + " s"));
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  // Ends the process with the message, unless the main thread is already reporting a failure
  // of its own (a collective that threw) or the run is shutting down.
  void report(const std::string& message) {
    if (stop_ || explaining_) return;
    std::cerr << "loom: error: " << message << std::endl;
    ::_exit(kExitPeerFailed);
  }

  static constexpr std::chrono::seconds kGrace{5};
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, world_;
  std::chrono::seconds timeout_;
  std::mutex mutex_;  // the store client
  std::int64_t beat_ = 0, last_beat_ms_ = 0;
  std::mutex wait_mutex_;
  int waits_ = 0;
  std::atomic<std::int64_t> waiting_since_ms_{0};
  std::atomic<bool> stop_{false}, store_lost_{false}, explaining_{false};
  std::thread thread_;
};

// An operation that completed when it was issued.
struct DoneWork final : Work {
  void wait() override {}
};

class C10dWork final : public Work {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, Monitor* monitor) : work_(std::move(work)), monitor_(monitor) {}
  void wait() override {
    if (monitor_) monitor_->begin_wait();
    try {
      work_->wait();
    } catch (const std::exception& e) {
      if (monitor_) monitor_->end_wait();
      throw CommunicationError(monitor_ ? monitor_->explain("a collective failed: " + reason(e)) : reason(e));
    }
    if (monitor_) monitor_->end_wait();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  Monitor* monitor_;
};

// torch 2.x's NCCL group wants an explicit shutdown before exit (it warns otherwise); Gloo and
// LibTorch 1.13 need none.
template <typename Group>
void shut_down(Group&) {}
#if defined(LOOM_WITH_CUDA) && TORCH_VERSION_MAJOR >= 2
template <>
void shut_down(c10d::ProcessGroupNCCL& group) {
  group.shutdown();
}
#endif

// One group over a c10d backend (ProcessGroupGloo or ProcessGroupNCCL, whose common base differs
// between LibTorch 1.13 and 2.x; the concrete type serves both).
template <typename Group>
class C10dCommunicator final : public Communicator, public AllToAll {
 public:
  C10dCommunicator(c10::intrusive_ptr<Group> group, Monitor* monitor, bool gloo)
      : group_(std::move(group)), monitor_(monitor), gloo_(gloo) {}
  ~C10dCommunicator() override {
    // Only on a clean finish: a group whose peer failed may not shut down in time.
    if (std::uncaught_exceptions() == 0) try {
        shut_down(*group_);
      } catch (const std::exception&) {
      }
  }
  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }

  std::unique_ptr<Work> all_reduce(std::vector<at::Tensor>& tensors, ReduceOp op) override {
    c10d::AllreduceOptions o;
    o.reduceOp = reduce_op(op);
    return wrap([&] { return group_->allreduce(tensors, o); });
  }
  std::unique_ptr<Work> broadcast(std::vector<at::Tensor>& tensors, int root) override {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return wrap([&] { return group_->broadcast(tensors, o); });
  }
  std::unique_ptr<Work> all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) override {
    std::vector<std::vector<at::Tensor>> out{outputs};
    std::vector<at::Tensor> in{input};
    auto work = wrap([&] { return group_->allgather(out, in); });
    return work;
  }
  std::unique_ptr<Work> reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op) override {
    if (gloo_) {
      // Gloo has no reduce-scatter: reduce everything, keep this rank's part.
      std::vector<at::Tensor> all{at::stack(inputs)};
      all_reduce(all, op)->wait();
      output.copy_(all[0][rank()]);
      return std::make_unique<DoneWork>();
    }
    std::vector<at::Tensor> out{output};
    std::vector<std::vector<at::Tensor>> in{inputs};
    c10d::ReduceScatterOptions o;
    o.reduceOp = reduce_op(op);
    return wrap([&] { return group_->reduce_scatter(out, in, o); });
  }
  std::unique_ptr<Work> all_to_all(at::Tensor& output, at::Tensor& input, const std::vector<std::int64_t>& output_splits,
                                   const std::vector<std::int64_t>& input_splits) override {
    std::vector<std::int64_t> out_counts = output_splits, in_counts = input_splits;
    return wrap([&] { return group_->alltoall_base(output, input, out_counts, in_counts); });
  }
  std::unique_ptr<Work> send(std::vector<at::Tensor>& tensors, int to, int tag) override {
    return wrap([&] { return group_->send(tensors, to, tag); });
  }
  std::unique_ptr<Work> recv(std::vector<at::Tensor>& tensors, int from, int tag) override {
    return wrap([&] { return group_->recv(tensors, from, tag); });
  }
  void barrier() override {
    std::vector<at::Tensor> one{at::zeros({1}, gloo_ ? at::TensorOptions() : at::TensorOptions().device(at::kCUDA))};
    all_reduce(one, ReduceOp::kSum)->wait();
    (void)one[0].item<float>();  // NCCL's wait only orders the stream; this waits for the result
  }

 private:
  template <typename F>
  std::unique_ptr<Work> wrap(F&& issue) {
    try {
      return std::make_unique<C10dWork>(issue(), monitor_);
    } catch (const std::exception& e) {
      throw CommunicationError(monitor_ ? monitor_->explain("a collective failed: " + reason(e)) : reason(e));
    }
  }
  c10::intrusive_ptr<Group> group_;
  Monitor* monitor_;
  bool gloo_;
};

// A group of one: every collective is the identity.
class SoloCommunicator final : public Communicator, public AllToAll {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::unique_ptr<Work> all_reduce(std::vector<at::Tensor>&, ReduceOp) override { return done(); }
  std::unique_ptr<Work> broadcast(std::vector<at::Tensor>&, int) override { return done(); }
  std::unique_ptr<Work> all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) override {
    outputs.at(0).copy_(input);
    return done();
  }
  std::unique_ptr<Work> reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp) override {
    output.copy_(inputs.at(0));
    return done();
  }
  std::unique_ptr<Work> all_to_all(at::Tensor& output, at::Tensor& input, const std::vector<std::int64_t>&, const std::vector<std::int64_t>&) override {
    output.copy_(input);
    return done();
  }
  std::unique_ptr<Work> send(std::vector<at::Tensor>&, int to, int) override { throw std::logic_error("send to rank " + std::to_string(to) + " in a group of one"); }
  std::unique_ptr<Work> recv(std::vector<at::Tensor>&, int from, int) override { throw std::logic_error("recv from rank " + std::to_string(from) + " in a group of one"); }
  void barrier() override {}

 private:
  static std::unique_ptr<Work> done() { return std::make_unique<DoneWork>(); }
};

class SoloParallel final : public Parallel {
 public:
  const Mesh& mesh() const override { return mesh_; }
  int rank() const override { return 0; }
  Communicator& world() override { return solo_; }
  Communicator& data() override { return solo_; }
  Communicator& pipeline() override { return solo_; }
  Communicator& tensor() override { return solo_; }

 private:
  Mesh mesh_;
  SoloCommunicator solo_;
};

// Counts this rank in under `key`; rank 0, which serves the store, then stays (up to `limit`) until
// all `world` ranks have, so none finds the store gone while it still needs it. Never throws: the
// others may already have left.
void count_in_and_hold_store(c10d::Store& store, const std::string& key, int rank, int world, std::chrono::seconds limit) {
  try {
    store.add(key, 1);
    const auto deadline = Clock::now() + limit;
    while (rank == 0 && store.add(key, 0) < world && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } catch (const std::exception&) {
  }
}

class C10dParallel final : public Parallel, public ExpertParallel {
 public:
  const Mesh& mesh() const override { return mesh_; }
  int rank() const override { return rank_; }
  Communicator& world() override { return *world_; }
  Communicator& data() override { return *data_; }
  Communicator& pipeline() override { return *pipeline_; }
  Communicator& tensor() override { return *tensor_; }
  Communicator& expert() override { return expert_ ? *expert_ : solo_; }
  Communicator& expert_replicas() override { return expert_replicas_ ? *expert_replicas_ : *data_; }
  ~C10dParallel() override {
    const bool clean = std::uncaught_exceptions() == 0;
    // Groups go before the monitor (their errors name ranks through it), the monitor before the store.
    expert_.reset();
    expert_replicas_.reset();
    data_.reset();
    pipeline_.reset();
    tensor_.reset();
    world_.reset();
    monitor_.reset();
    // Rank 0 serves the store: on a clean finish it stays until every rank has stopped using it,
    // so no rank mistakes its exit for a failure.
    if (clean && store_) count_in_and_hold_store(*store_, "loom/finished", rank_, mesh_.world(), std::chrono::seconds(60));
  }

  Mesh mesh_;
  int rank_ = 0;
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<Monitor> monitor_;
  std::unique_ptr<Communicator> world_, data_, pipeline_, tensor_, expert_, expert_replicas_;  // expert groups only under [parallel] expert > 1
  SoloCommunicator solo_;
};

std::unique_ptr<Communicator> make_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name, int rank, int size, bool cuda,
                                         std::chrono::seconds timeout, Monitor* monitor, const std::string& master_addr) {
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
#ifdef LOOM_WITH_CUDA
  if (cuda) {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return std::make_unique<C10dCommunicator<c10d::ProcessGroupNCCL>>(
        c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, options), monitor, false);
  }
#else
  if (cuda) throw UserError("this loom was built without CUDA: NCCL groups are not available");
#endif
#ifndef LOOM_WITH_GLOO
  (void)rank, (void)size, (void)timeout, (void)monitor, (void)master_addr, (void)prefixed;
  throw UserError("this loom was built without Gloo's headers: processes on the CPU cannot talk to each other; put every rank on a GPU "
                  "or rebuild with libgloo-dev");
#else
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // Loopback when every rank is on this host; otherwise the interface GLOO_SOCKET_IFNAME names or
  // the one this host's name resolves to (as torch.distributed picks it).
  if (const auto ifname = env("GLOO_SOCKET_IFNAME")) options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(*ifname));
  else if (master_addr == "127.0.0.1" || master_addr == "localhost") options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  else options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return std::make_unique<C10dCommunicator<c10d::ProcessGroupGloo>>(c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options),
                                                                     monitor, true);
#endif
}

}  // namespace

std::optional<Rendezvous> rendezvous_from_env() {
  Rendezvous r;
  if (env("RANK") || env("WORLD_SIZE")) {
    r.source = "torchrun";
    r.world = env_int("WORLD_SIZE", 1, 1 << 16);
    r.rank = env_int("RANK", 0, r.world - 1);
    r.local_rank = env("LOCAL_RANK") ? env_int("LOCAL_RANK", 0, r.world - 1) : r.rank;
    r.local_world = env("LOCAL_WORLD_SIZE") ? env_int("LOCAL_WORLD_SIZE", 1, r.world) : r.world;
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    r.source = "slurm";
    r.world = env_int("SLURM_NTASKS", 1, 1 << 16);
    r.rank = env_int("SLURM_PROCID", 0, r.world - 1);
    r.local_rank = env("SLURM_LOCALID") ? env_int("SLURM_LOCALID", 0, r.world - 1) : 0;
    r.local_world = slurm_tasks_on_this_node(r.world);
  } else {
    return std::nullopt;
  }
  if (r.local_rank >= r.local_world) {
    const bool slurm = r.source == "slurm";
    throw UserError(std::string(slurm ? "SLURM_LOCALID " : "LOCAL_RANK ") + std::to_string(r.local_rank) + " is not below " +
                    (slurm ? "the tasks on this node, " : "LOCAL_WORLD_SIZE ") + std::to_string(r.local_world) +
                    (slurm ? " (SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE)" : "") + "; the launcher's environment is inconsistent");
  }
  if (r.world == 1) return r;
  if (const auto id = env("LOOM_RUN_ID")) r.run = *id;
  else if (const auto elastic = env("TORCHELASTIC_RUN_ID"); elastic && *elastic != "none") r.run = *elastic;
  else if (const auto job = env("SLURM_JOB_ID")) r.run = *job + "." + env("SLURM_STEP_ID").value_or("");
  const auto addr = env("MASTER_ADDR");
  if (!addr || addr->empty()) throw UserError("a " + r.source + " launch of " + std::to_string(r.world) + " processes needs MASTER_ADDR (the host of rank 0)");
  r.master_addr = *addr;
  r.master_port = env_int("MASTER_PORT", 1, 65535);
  return r;
}

int requested_world(const RunConfig& config) {
  const auto& p = config.parallel;
  return p.data > 0 ? p.data * p.pipeline * p.tensor : 0;
}

Mesh resolve_mesh(const RunConfig& config, int world) {
  const auto& p = config.parallel;
  Mesh m;
  m.pipeline = p.pipeline;
  m.tensor = p.tensor;
  Diagnostics d;
  const int replica = p.replica();
  if (p.data == 0) {
    if (world % replica != 0)
      d.add(p.where, "[parallel] pipeline x tensor = " + std::to_string(replica) + " does not divide the " + std::to_string(world) +
                         " processes of this run; launch a multiple of " + std::to_string(replica) + " processes (loom run --nproc-per-node " +
                         std::to_string(replica) + ", or torchrun / srun with that many)");
    m.data = std::max(1, world / replica);
  } else {
    m.data = p.data;
    if (m.world() != world)
      d.add(p.data_at, "[parallel] data x pipeline x tensor = " + std::to_string(m.world()) + " ranks, but this run has " + std::to_string(world) +
                           " process(es); launch " + std::to_string(m.world()) + " (loom run --nproc-per-node " + std::to_string(m.world()) +
                           ") or set data = 0");
  }
  d.throw_if_any();
  return m;
}

Communicator* expert_group(Parallel& parallel) {
  auto* groups = dynamic_cast<ExpertParallel*>(&parallel);
  return groups != nullptr ? &groups->expert() : nullptr;
}

int expert_ranks(Parallel& parallel) {
  const Communicator* group = expert_group(parallel);
  return group != nullptr ? group->size() : 1;
}

int resolve_expert_ranks(const RunConfig& config, const Mesh& mesh) {
  const int expert = config.parallel.expert;
  if (mesh.data % expert != 0) {
    Diagnostics d;
    d.add(config.parallel.expert_at, "[parallel] expert = " + std::to_string(expert) + " does not divide the " + std::to_string(mesh.data) +
                                         " data rank(s): the experts are shared out by data ranks; set data to a multiple of " +
                                         std::to_string(expert) + " or expert to a divisor of " + std::to_string(mesh.data));
    d.throw_if_any();
  }
  return expert;
}

void note_progress(std::int64_t step) { progress_step = step; }

std::unique_ptr<Parallel> single_process() { return std::make_unique<SoloParallel>(); }

std::unique_ptr<Parallel> connect(const Rendezvous& r, const Mesh& mesh, bool cuda, std::chrono::seconds timeout,
                                  std::optional<std::chrono::seconds> join_timeout, int expert_ranks) {
  const std::chrono::seconds join = join_timeout.value_or(timeout);
  if (mesh.world() != r.world)
    throw std::logic_error("mesh of " + std::to_string(mesh.world()) + " ranks for " + std::to_string(r.world) + " processes");
  if (expert_ranks < 1 || mesh.data % expert_ranks != 0)
    throw std::logic_error("expert groups of " + std::to_string(expert_ranks) + " over " + std::to_string(mesh.data) + " data ranks");
  ensure_open_files(r.rank, r.world);
  auto p = std::make_unique<C10dParallel>();
  p->mesh_ = mesh;
  p->rank_ = r.rank;
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(r.master_port);
  o.isServer = r.rank == 0;
  o.numWorkers = static_cast<std::size_t>(r.world);
  o.waitWorkers = false;
  o.timeout = join;
  try {
    p->store_ = c10::make_intrusive<c10d::TCPStore>(r.master_addr, o);
    // Every rank checks in with its run's identity; a rank that never does is named instead of a
    // bare timeout, and one of another run (sharing MASTER_PORT) is refused before any group forms.
    p->store_->set("loom/joined/" + std::to_string(r.rank), std::vector<std::uint8_t>(r.run.begin(), r.run.end()));
    std::vector<std::string> keys;
    for (int i = 0; i < r.world; ++i) keys.push_back("loom/joined/" + std::to_string(i));
    try {
      p->store_->wait(keys, join);
    } catch (const std::exception&) {
      std::string missing;
      for (int i = 0; i < r.world; ++i)
        if (!p->store_->check({keys[static_cast<std::size_t>(i)]})) missing += (missing.empty() ? "" : ", ") + std::to_string(i);
      throw UserError("rank " + std::to_string(r.rank) + ": rank(s) " + missing + " did not join the run at " + r.master_addr + ":" +
                      std::to_string(r.master_port) + " within [run] timeout = " + std::to_string(join.count()) + " s");
    }
    std::string strangers;
    for (int i = 0; i < r.world; ++i) {
      const auto id = p->store_->get(keys[static_cast<std::size_t>(i)]);
      if (std::string(id.begin(), id.end()) != r.run) strangers += (strangers.empty() ? "" : ", ") + std::to_string(i);
    }
    if (!strangers.empty()) {
      // The others must read what refuses them too before rank 0 takes the store away, or they
      // would report a vanished store instead of the reason.
      count_in_and_hold_store(*p->store_, "loom/read", r.rank, r.world, std::min(join, std::chrono::seconds(10)));
      throw UserError("rank " + std::to_string(r.rank) + ": the rank(s) " + strangers + " that joined the rendezvous at " + r.master_addr + ":" +
                      std::to_string(r.master_port) + " belong to another run (another pipeline or launch); give each run its own MASTER_PORT");
    }
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    throw UserError("rank " + std::to_string(r.rank) + ": cannot reach the rendezvous at " + r.master_addr + ":" + std::to_string(r.master_port) +
                    " (MASTER_ADDR, MASTER_PORT; " + r.source + "): " + reason(e) +
                    (r.rank == 0 ? "; another program (another run?) may be using that port" : ""));
  }
  // Every later key (heartbeats, groups, the finish count) under the run's identity: ranks of a
  // run that raced another past the check above still never meet its ranks.
  p->store_ = c10::make_intrusive<c10d::PrefixStore>("run/" + r.run + "/", p->store_);
  p->monitor_ = std::make_unique<Monitor>(p->store_, r.rank, r.world, timeout);
  const MeshCoord c = mesh.coord(r.rank);
  auto* monitor = p->monitor_.get();
  try {
    p->world_ = make_group(p->store_, "world/", r.rank, r.world, cuda, join, monitor, r.master_addr);
    // Each axis group holds the ranks that differ only on that axis; its store prefix names the
    // other coordinates, so every member derives the same one.
    const auto key = [](const std::string& axis, int a, int b) { return axis + "/" + std::to_string(a) + "/" + std::to_string(b) + "/"; };
    p->data_ = make_group(p->store_, key("data", c.pipeline, c.tensor), c.data, mesh.data, cuda, join, monitor, r.master_addr);
    p->pipeline_ = make_group(p->store_, key("pipeline", c.data, c.tensor), c.pipeline, mesh.pipeline, cuda, join, monitor, r.master_addr);
    p->tensor_ = make_group(p->store_, key("tensor", c.data, c.pipeline), c.tensor, mesh.tensor, cuda, join, monitor, r.master_addr);
    if (expert_ranks > 1) {
      // Runs of expert_ranks data ranks share out the experts; every expert_ranks-th data rank holds the same ones.
      const int run = c.data / expert_ranks, slot = c.data % expert_ranks;
      p->expert_ = make_group(p->store_, key("expert", c.pipeline, c.tensor) + std::to_string(run) + "/", slot, expert_ranks, cuda, join, monitor,
                              r.master_addr);
      p->expert_replicas_ = make_group(p->store_, key("expert-replicas", c.pipeline, c.tensor) + std::to_string(slot) + "/", run,
                                       mesh.data / expert_ranks, cuda, join, monitor, r.master_addr);
    }
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    // The store let every rank in, but the ranks could not connect to each other: two processes
    // with one RANK, or ranks of two runs that share MASTER_PORT.
    throw UserError("rank " + std::to_string(r.rank) + ": joined the rendezvous at " + r.master_addr + ":" + std::to_string(r.master_port) +
                    " but cannot connect to the other ranks: " + reason(e) +
                    "; check that every process has its own RANK and that no other run uses MASTER_PORT");
  }
  return p;
}

}  // namespace loom::core
