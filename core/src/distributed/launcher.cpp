#include "distributed/launcher.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <iostream>
#include <random>
#include <string>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "loom/error.hpp"

namespace loom::core {
namespace {

std::atomic<int> forwarded_signal{0};

// A port nothing listens on now (the kernel's pick); rank 0 binds it a moment later.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw UserError(std::string("cannot open a socket to find a free port: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw UserError(std::string("cannot find a free port on 127.0.0.1: ") + std::strerror(errno));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

struct Worker {
  pid_t pid = -1;
  int out = -1, err = -1;           // read ends of its stdout and stderr
  std::string out_line, err_line;  // partial lines
  bool running = true;
  int status = 0;
};

// Whether the workers print a JSON document on stdout (--json): rank 0's stdout then passes
// through as it is, so it stays one document a program can read.
bool json_output = false;

// Writes complete lines of `buffer` with the rank prefix (none for rank 0's stdout under --json);
// keeps the rest.
void flush_lines(std::string& buffer, int rank, std::ostream& to, bool all) {
  const std::string prefix = json_output && rank == 0 && &to == &std::cout ? "" : "[rank " + std::to_string(rank) + "] ";
  std::size_t start = 0, nl;
  while ((nl = buffer.find('\n', start)) != std::string::npos) {
    to << prefix << buffer.substr(start, nl - start) << "\n";
    start = nl + 1;
  }
  buffer.erase(0, start);
  if (all && !buffer.empty()) {
    to << prefix << buffer << "\n";
    buffer.clear();
  }
  to.flush();
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sig == SIGKILL ? "SIGKILL" : sig == SIGSEGV ? "SIGSEGV" : sig == SIGABRT ? "SIGABRT" : sig == SIGTERM ? "SIGTERM" : nullptr;
    return "was killed by signal " + std::to_string(sig) + (name ? std::string(" (") + name + ")" : std::string());
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

// The launcher's environment with a worker's variables set over it, as execve takes it.
struct Environment {
  std::vector<std::string> entries;
  std::vector<char*> pointers;
  explicit Environment(const std::vector<std::pair<std::string, std::string>>& set) {
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const auto name = entry.substr(0, entry.find('='));
      if (std::none_of(set.begin(), set.end(), [&](const auto& kv) { return kv.first == name; })) entries.push_back(entry);
    }
    for (const auto& [name, value] : set) entries.push_back(name + "=" + value);
    for (auto& e : entries) pointers.push_back(e.data());
    pointers.push_back(nullptr);
  }
};

int exit_code(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

}  // namespace

int launch_local_workers(int nproc, const std::vector<std::string>& args) {
  if (nproc < 1 || nproc > 1024) throw UserError("--nproc-per-node " + std::to_string(nproc) + ": use 1 to 1024 processes");
  json_output = std::find(args.begin(), args.end(), "--json") != args.end();
  const std::string port = std::to_string(free_port());
  std::vector<Worker> workers;
  workers.reserve(static_cast<std::size_t>(nproc));
  const pid_t launcher = ::getpid();
  // Workers started before one fails to start do not outlive the refusal.
  const auto stop_started = [&](const std::string& why) {
    const int error = errno;
    for (auto& w : workers) ::kill(w.pid, SIGKILL);
    for (auto& w : workers) {
      ::waitpid(w.pid, nullptr, 0);
      ::close(w.out);
      ::close(w.err);
    }
    std::string hint;
    if (error == EMFILE || error == ENFILE) {
      rlimit limit{};
      if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) hint = " (open files are limited to " + std::to_string(limit.rlim_cur) + ": raise `ulimit -n`)";
    } else if (error == EAGAIN) {
      hint = " (the process limit, `ulimit -u`, or memory)";
    }
    throw UserError("cannot start " + std::to_string(nproc) + " worker processes: " + why + ": " + std::strerror(error) + hint + "; none was left running");
  };
  // Arguments and environments are made before forking: between fork and exec a child of a
  // threaded process may only make async-signal-safe calls.
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The launch's identity, shared by its workers: a worker of another launch that reaches their
  // rendezvous (one MASTER_PORT for two runs) is refused rather than joined (Rendezvous::run).
  std::random_device entropy;
  const std::string run_id = std::to_string(::getpid()) + "-" + std::to_string(entropy()) + std::to_string(entropy());
  std::vector<Environment> envs;
  envs.reserve(static_cast<std::size_t>(nproc));  // never moved: their pointers point into them
  for (int rank = 0; rank < nproc; ++rank) {
    const std::string r = std::to_string(rank), n = std::to_string(nproc);
    envs.emplace_back(std::vector<std::pair<std::string, std::string>>{{"RANK", r},
                                                                      {"LOCAL_RANK", r},
                                                                      {"WORLD_SIZE", n},
                                                                      {"LOCAL_WORLD_SIZE", n},
                                                                      {"MASTER_ADDR", "127.0.0.1"},
                                                                      {"MASTER_PORT", port},
                                                                      {"LOOM_RUN_ID", run_id},
                                                                      {"LOOM_NPROC_PER_NODE", n}});  // for the command that resumes the run
  }
  for (int rank = 0; rank < nproc; ++rank) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0) stop_started("cannot create a pipe for rank " + std::to_string(rank));
    if (::pipe2(err, O_CLOEXEC) != 0) {
      const int error = errno;
      ::close(out[0]), ::close(out[1]);
      errno = error;
      stop_started("cannot create a pipe for rank " + std::to_string(rank));
    }
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int error = errno;
      for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
      errno = error;
      stop_started("cannot start rank " + std::to_string(rank));
    }
    if (pid == 0) {
      // Dies with the launcher, however the launcher ends (SIGKILL included): a worker alone would
      // train on with nobody to stop it. The launcher may have died before this line.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(128 + SIGKILL);
      // Own process group: a Ctrl-C reaches the launcher only, which forwards it once.
      ::setpgid(0, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execve("/proc/self/exe", argv.data(), envs[static_cast<std::size_t>(rank)].pointers.data());
      std::fprintf(stderr, "loom: cannot start a worker: %s\n", std::strerror(errno));
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    workers.push_back({pid, out[0], err[0], "", "", true, 0});
  }

  struct sigaction forward {}, old_int {}, old_term {};
  forward.sa_handler = [](int sig) { forwarded_signal = sig; };
  sigemptyset(&forward.sa_mask);
  ::sigaction(SIGINT, &forward, &old_int);
  ::sigaction(SIGTERM, &forward, &old_term);

  int first_failure = -1, failure_code = 0;
  int sent = 0;
  std::size_t running = workers.size();
  char buf[65536];
  while (running > 0) {
    if (const int sig = forwarded_signal.exchange(0); sig != 0) {
      sent = sig;
      for (auto& w : workers)
        if (w.running) ::kill(w.pid, sig);
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<std::size_t, bool>> owner;  // worker, is stdout
    for (std::size_t i = 0; i < workers.size(); ++i) {
      if (workers[i].out >= 0) fds.push_back({workers[i].out, POLLIN, 0}), owner.emplace_back(i, true);
      if (workers[i].err >= 0) fds.push_back({workers[i].err, POLLIN, 0}), owner.emplace_back(i, false);
    }
    if (!fds.empty() && ::poll(fds.data(), fds.size(), 100) > 0) {
      for (std::size_t k = 0; k < fds.size(); ++k) {
        if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        auto& w = workers[owner[k].first];
        const bool is_out = owner[k].second;
        const ssize_t n = ::read(fds[k].fd, buf, sizeof buf);
        std::string& line = is_out ? w.out_line : w.err_line;
        if (n > 0) {
          line.append(buf, static_cast<std::size_t>(n));
          flush_lines(line, static_cast<int>(owner[k].first), is_out ? std::cout : std::cerr, false);
        } else {
          flush_lines(line, static_cast<int>(owner[k].first), is_out ? std::cout : std::cerr, true);
          ::close(fds[k].fd);
          (is_out ? w.out : w.err) = -1;
        }
      }
    } else if (fds.empty()) {
      ::usleep(100000);
    }
    for (std::size_t i = 0; i < workers.size(); ++i) {
      auto& w = workers[i];
      if (!w.running) continue;
      int status = 0;
      const pid_t done = ::waitpid(w.pid, &status, WNOHANG);
      if (done != w.pid) continue;
      w.running = false;
      w.status = status;
      --running;
      const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      if (failed && first_failure < 0 && sent == 0) {
        first_failure = static_cast<int>(i);
        failure_code = exit_code(status);
        std::cerr << "loom: rank " << i << " " << describe_status(status) << "; stopping the other ranks" << std::endl;
        // The others cannot go on without it; their last words are not needed.
        for (auto& other : workers)
          if (other.running) ::kill(other.pid, SIGKILL);
      }
    }
  }
  // Whatever the workers printed last.
  for (std::size_t i = 0; i < workers.size(); ++i) {
    auto& w = workers[i];
    for (int* fd : {&w.out, &w.err}) {
      if (*fd < 0) continue;
      ssize_t n;
      std::string& line = fd == &w.out ? w.out_line : w.err_line;
      while ((n = ::read(*fd, buf, sizeof buf)) > 0) line.append(buf, static_cast<std::size_t>(n));
      flush_lines(line, static_cast<int>(i), fd == &w.out ? std::cout : std::cerr, true);
      ::close(*fd);
    }
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  if (first_failure >= 0) return failure_code;
  // Stopped by a signal: every rank checkpointed and exited with 128 + signal; pass that on.
  for (const auto& w : workers)
    if (!(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)) return exit_code(w.status);
  return 0;
}

}  // namespace loom::core
