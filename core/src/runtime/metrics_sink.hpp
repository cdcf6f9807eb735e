#pragma once
// A run's metrics: metrics.jsonl (one JSON object per line) and, beside it, the same scalars as a
// TensorBoard event file, both appended as the run goes (rank 0 writes). A resumed run keeps the
// rows up to its checkpoint's step and logs the rest again, so both read as one uninterrupted run's;
// the event file is rebuilt from the kept rows, so the two never disagree.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/formats/tensorboard.hpp"

namespace loom::core {

// The scalars of a metrics row as TensorBoard tags: "train/loss", "train/lr", "eval/loss",
// "eval/exact_match", "train/peak_memory_gib/cuda:0", ... (every number of the row but its step and
// time; an eval row's "eval_" prefix becomes the "eval/" group; byte counts are shown in GiB).
formats::tensorboard::Scalars metric_scalars(const nlohmann::json& row);

// Whether a metrics row is a held-out evaluation's ("eval": true).
inline bool is_eval_row(const nlohmann::json& row) { return row.contains("eval") && row["eval"].is_boolean() && row["eval"].get<bool>(); }

// The key of a device's peak in a row's peak_memory_bytes: "cuda:0" in one process, "rank 1 cuda:0"
// over several.
inline std::string peak_memory_key(int world, std::int64_t rank, const std::string& device) {
  return world > 1 ? "rank " + std::to_string(rank) + " " + device : device;
}

// Calls `visit(line, row)` for each line of a metrics file in order (a line over 64 MiB: its first
// 64 MiB), `row` the line's object when it is one with an integer "step" and null otherwise (not
// JSON, another value, a line torn by a kill, one too long); stops when `visit` returns false. An absent file has no lines; a folder or a
// FIFO in its place is one clear error.
void for_each_metrics_line(const std::filesystem::path& file,
                           const std::function<bool(const std::string& line, const nlohmann::json* row)>& visit);

class MetricsSink {
 public:
  static constexpr const char* kEventFile = "events.out.tfevents.loom";  // TensorBoard finds files named *tfevents*

  explicit MetricsSink(const std::filesystem::path& dir) : file_(dir / "metrics.jsonl"), events_(dir / kEventFile) {}
  const std::filesystem::path& file() const { return file_; }
  const std::filesystem::path& events_file() const { return events_; }
  // Empty files, atomically (a new run, or a resume that found no checkpoint).
  void start_empty() const;
  // Appends `row` (an object with an integer "step"), stamped with "time" (Unix seconds) unless it
  // has one, to both files and flushes them; UserError naming the file when it cannot (a full disk).
  void append(nlohmann::json row) const;
  // Keeps the rows whose "step" is at most `step`, up to the first line that is not such a row (a
  // line torn by a kill, or one that is not loom's), atomically; an absent file becomes empty.
  void keep_through(std::int64_t step) const;

 private:
  void write_events(const std::string& records, bool append) const;
  std::filesystem::path file_, events_;
};

}  // namespace loom::core
