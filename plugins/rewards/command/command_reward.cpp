// Reward plugin `command`: an external program scores the completions. It reads JSON lines
// {"prompt", "completion", "sample"} on its standard input (one per completion, then end of file)
// and writes one score per line on its standard output, in order. It must finish within `timeout`
// seconds and exit 0; a line that is not a finite number, too few or too many lines, a failure or
// a timeout is one error naming the line (and the program's last words on standard error).
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/plugin.hpp"
#include "loom/reward.hpp"

namespace loom::command_reward {
namespace {

constexpr std::size_t kMaxOutput = std::size_t{64} << 20;  // a program that floods its output is stopped, not buffered without end

std::vector<OptionSpec> options() {
  return {
      OptionSpec::string_list("command", std::nullopt, "the program and its arguments, e.g. [\"python3\", \"score.py\"] (run without a shell)").require(),
      OptionSpec::real("timeout", 60.0, "seconds the program may take for one step's completions").at_least(0.001).at_most(86400),
  };
}

struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() {
    if (::pipe2(fd, O_CLOEXEC) != 0) throw UserError(std::string("reward command: cannot make a pipe: ") + std::strerror(errno));
  }
  ~Pipe() {
    for (int f : fd)
      if (f >= 0) ::close(f);
  }
  void close(int i) {
    if (fd[i] >= 0) ::close(fd[i]);
    fd[i] = -1;
  }
};

class CommandReward final : public Reward {
 public:
  explicit CommandReward(const Options& o) : argv_(o.get_string_list("command")), timeout_s_(o.get_float("timeout")) {
    if (argv_.empty() || argv_[0].empty()) throw UserError("command is empty; name the program to run, e.g. [\"python3\", \"score.py\"]");
  }

  std::vector<double> score(const std::vector<Scored>& completions) const override {
    std::string input;
    for (const auto& c : completions) {
      nlohmann::json line = {{"prompt", c.prompt}, {"completion", c.completion}, {"sample", nlohmann::json::parse(c.record)}};
      input += line.dump() + "\n";
    }
    std::string out, err;
    const int status = run(input, out, err);
    const std::string who = "reward command '" + argv_[0] + "'";
    const std::string last_words = err.empty() ? "" : "; it wrote on standard error: " + tail(err);
    if (status == -1) throw UserError(who + " did not finish within " + std::to_string(timeout_s_) + " s and was stopped" + last_words);
    if (WIFSIGNALED(status)) throw UserError(who + " was killed by signal " + std::to_string(WTERMSIG(status)) + last_words);
    if (WEXITSTATUS(status) == 127 && out.empty()) throw UserError(who + " could not be run (not found, or not executable)" + last_words);
    if (WEXITSTATUS(status) != 0) throw UserError(who + " exited with status " + std::to_string(WEXITSTATUS(status)) + last_words);
    std::vector<double> scores;
    std::size_t start = 0, line = 0;
    while (start < out.size()) {
      auto end = out.find('\n', start);
      if (end == std::string::npos) end = out.size();
      std::string text = out.substr(start, end - start);
      start = end + 1;
      ++line;
      if (!text.empty() && text.back() == '\r') text.pop_back();
      char* stop = nullptr;
      errno = 0;
      const double v = std::strtod(text.c_str(), &stop);
      const bool blank_after = stop != nullptr && std::string(stop).find_first_not_of(" \t") == std::string::npos;
      if (text.empty() || stop == text.c_str() || !blank_after || !std::isfinite(v))
        throw UserError(who + ": output line " + std::to_string(line) + " is \"" + text.substr(0, 80) +
                        "\"; each line must be one finite number, the score of the completion on that input line");
      scores.push_back(v);
    }
    if (scores.size() != completions.size())
      throw UserError(who + " wrote " + std::to_string(scores.size()) + " score(s) for " + std::to_string(completions.size()) +
                      " completions; it must write one line per input line, in order" + last_words);
    return scores;
  }

 private:
  static std::string tail(const std::string& s) { return s.size() <= 400 ? s : "..." + s.substr(s.size() - 400); }

  // Runs the program with `input` on its standard input; returns its wait status, or -1 when it
  // ran past the timeout. Its answer is what it wrote by the time it exited: a child it left
  // behind holding the pipes open is not waited for. Its whole process group ends with the call,
  // so nothing it started outlives the step.
  int run(const std::string& input, std::string& out, std::string& err) const {
    Pipe in, to_host, errors;
    std::vector<char*> args;
    for (const auto& a : argv_) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw UserError(std::string("reward command: cannot start a process: ") + std::strerror(errno));
    if (pid == 0) {
      // Its own process group, so the terminal's Ctrl-C (or a job's SIGTERM) reaches the trainer,
      // which stops at the step's end, and not the scorer mid-step; killed with its rank; SIGPIPE
      // as programs expect it (the host ignores it, which exec would pass on).
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::signal(SIGPIPE, SIG_DFL);
      ::dup2(in.fd[0], 0);
      ::dup2(to_host.fd[1], 1);
      ::dup2(errors.fd[1], 2);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also from here: the group exists before anything below signals it
    in.close(0);
    to_host.close(1);
    errors.close(1);
    ::fcntl(in.fd[1], F_SETFL, O_NONBLOCK);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    std::size_t written = 0;
    if (input.empty()) in.close(1);
    // Reads what the pipes hold now (after the exit: all the program wrote, since it cannot exit
    // while a write of its own waits for room).
    const auto drain = [&](Pipe& pipe, std::string& into) {
      if (pipe.fd[0] < 0) return;
      ::fcntl(pipe.fd[0], F_SETFL, O_NONBLOCK);
      char buf[65536];
      for (ssize_t k; (k = ::read(pipe.fd[0], buf, sizeof buf)) > 0 || (k < 0 && errno == EINTR);)
        if (k > 0 && into.size() < kMaxOutput) into.append(buf, static_cast<std::size_t>(k));
    };
    // Ends the group (the program and whatever it started), then reaps the program.
    const auto end_group = [&](int& status) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    };
    int status = 0;
    bool exited = false;  // seen exited, not yet reaped: its pid (and group id) stay reserved
    while (true) {
      siginfo_t info{};
      if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid) exited = true;
      if (exited || (to_host.fd[0] < 0 && errors.fd[0] < 0)) break;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) {
        in.close(1);
        end_group(status);
        return -1;
      }
      pollfd fds[3];
      int n = 0;
      if (in.fd[1] >= 0) fds[n++] = {in.fd[1], POLLOUT, 0};
      if (to_host.fd[0] >= 0) fds[n++] = {to_host.fd[0], POLLIN, 0};
      if (errors.fd[0] >= 0) fds[n++] = {errors.fd[0], POLLIN, 0};
      // A short wait: the program's exit is looked for between reads (a child of its own may keep
      // the pipes open after it).
      if (n > 0 && ::poll(fds, static_cast<nfds_t>(n), static_cast<int>(std::min<long long>(left, 20))) < 0 && errno != EINTR) break;
      if (n == 0) ::usleep(1000);
      for (int i = 0; i < n; ++i) {
        if (fds[i].revents == 0) continue;
        if (fds[i].fd == in.fd[1]) {
          const ssize_t k = ::write(in.fd[1], input.data() + written, input.size() - written);
          if (k > 0) written += static_cast<std::size_t>(k);
          if ((k < 0 && errno != EAGAIN && errno != EINTR) || written == input.size()) in.close(1);  // EPIPE: it stopped reading
        } else {
          char buf[65536];
          const ssize_t k = ::read(fds[i].fd, buf, sizeof buf);
          std::string& into = fds[i].fd == to_host.fd[0] ? out : err;
          if (k > 0 && into.size() < kMaxOutput) into.append(buf, static_cast<std::size_t>(k));
          if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) (fds[i].fd == to_host.fd[0] ? to_host : errors).close(0);
        }
      }
    }
    in.close(1);
    // Output closed: the program is ending; it still has until the deadline to exit.
    while (!exited) {
      siginfo_t info{};
      if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        end_group(status);
        return -1;
      }
      ::usleep(1000);
    }
    drain(to_host, out);
    drain(errors, err);
    end_group(status);  // what it left running; the exited program, not yet reaped, keeps its group's id reserved
    return status;
  }

  std::vector<std::string> argv_;
  double timeout_s_;
};

std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<CommandReward>(o); }

}  // namespace
}  // namespace loom::command_reward

LOOM_PLUGIN(loom::kKindReward, "command", "0.1.0", "an external program scores completions: JSON lines in, one score per line out, time-bounded",
            loom::command_reward::options, loom::command_reward::create)
