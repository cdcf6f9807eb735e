#pragma once
// A run's metrics.jsonl: one JSON object per line, appended as the run goes (rank 0 writes). A
// resumed run keeps the rows up to its checkpoint's step and logs the rest again, so the file reads
// as one uninterrupted run's.
#include <cstdint>
#include <filesystem>

#include <nlohmann/json.hpp>

namespace loom::core {

class MetricsSink {
 public:
  explicit MetricsSink(std::filesystem::path file) : file_(std::move(file)) {}
  const std::filesystem::path& file() const { return file_; }
  // An empty file, atomically (a new run, or a resume that found no checkpoint).
  void start_empty() const;
  // Appends `row` as a line and flushes it; UserError naming the file when it cannot (a full disk).
  void append(const nlohmann::json& row) const;
  // Keeps the rows whose "step" is at most `step`, up to the first line that is not such a row (a
  // line torn by a kill, or one that is not loom's), atomically; an absent file becomes empty.
  void keep_through(std::int64_t step) const;

 private:
  std::filesystem::path file_;
};

}  // namespace loom::core
