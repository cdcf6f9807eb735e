#pragma once
#include <exception>
#include <filesystem>
#include <string>

#include "runtime/metrics_sink.hpp"

namespace loom::core {

// A run's output folder, held for as long as the run lives: an advisory lock on the folder itself
// (flock; the kernel drops it when the process ends, however it ends) keeps a second run, or a
// --resume of a live one, out of it. A new run starts only where the names it writes are free, so
// everything under those names is its own and a failure before its first step can remove them.
class OutputFolder {
 public:
  // What a run writes in its folder.
  static constexpr const char* kNames[] = {"run.json", "metrics.jsonl", MetricsSink::kEventFile, "report.html", "checkpoints", "adapter", "merged", "model"};

  // Checks the folder without touching it: a new run needs every name free, a resume a run.json.
  // Every rank calls it before the rendezvous; throws UserError.
  static void check(const std::filesystem::path& dir, bool resume);

  // Creates the folder when missing, takes its lock and checks it again under the lock.
  OutputFolder(std::filesystem::path dir, bool resume);
  ~OutputFolder();
  OutputFolder(const OutputFolder&) = delete;
  OutputFolder& operator=(const OutputFolder&) = delete;

  // A new run that failed before its first step: removes what it wrote (the names were free when
  // it started) and the folder when this run created it and it is empty.
  void discard_new_run() noexcept;

 private:
  std::filesystem::path dir_;
  int fd_ = -1;
  bool created_ = false;
};

// An exception's text for a user: a filesystem error as "PATH: REASON" (the OS's words), not the
// C++ library's "filesystem error: cannot create directories: ...".
std::string describe_error(const std::exception& e);

}  // namespace loom::core
