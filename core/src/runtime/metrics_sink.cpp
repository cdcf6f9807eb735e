#include "runtime/metrics_sink.hpp"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "config/data.hpp"

namespace loom::core {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string events_of(const nlohmann::json& row) {
  const double time = row.contains("time") && row["time"].is_number() ? row["time"].get<double>() : 0.0;
  return formats::tensorboard::scalars_event(time, row.at("step").get<std::int64_t>(), metric_scalars(row));
}

// A double as the nearest float, past float's range its infinity (a plain cast is undefined there).
float to_float(double value) {
  constexpr double kMax = std::numeric_limits<float>::max();
  if (value > kMax) return std::numeric_limits<float>::infinity();
  if (value < -kMax) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(value);
}

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

}  // namespace

formats::tensorboard::Scalars metric_scalars(const nlohmann::json& row) {
  formats::tensorboard::Scalars out;
  const bool eval = is_eval_row(row);
  const std::string group = eval ? "eval/" : "train/";
  const auto name_of = [&](std::string key) {
    if (eval && key.rfind("eval_", 0) == 0) key = key.substr(5);
    const bool bytes = key.size() > 6 && key.compare(key.size() - 6, 6, "_bytes") == 0;
    return std::make_pair(group + (bytes ? key.substr(0, key.size() - 6) + "_gib" : key), bytes ? 1.0 / kGiB : 1.0);
  };
  for (const auto& [key, value] : row.items()) {
    if (key == "step" || key == "time" || key == "eval") continue;
    const auto [tag, scale] = name_of(key);
    if (value.is_number()) {  // never a boolean in nlohmann::json
      out.emplace_back(tag, to_float(value.get<double>() * scale));
    } else if (value.is_object()) {
      for (const auto& [part, v] : value.items())
        if (v.is_number()) out.emplace_back(tag + "/" + part, to_float(v.get<double>() * scale));
    }
  }
  return out;
}

void MetricsSink::start_empty() const {
  kit::write_file_atomically(file_, "");
  kit::write_file_atomically(events_, formats::tensorboard::version_event(unix_now()));
}

void MetricsSink::write_events(const std::string& records, bool append) const {
  if (!append) {
    kit::write_file_atomically(events_, records);
    return;
  }
  std::ofstream out(events_, std::ios::app | std::ios::binary);
  out << records;
  out.flush();
  if (!out) throw UserError("cannot write " + events_.string() + ": " + std::strerror(errno) + " (is the disk full?)");
}

void MetricsSink::append(nlohmann::json row) const {
  if (!row.contains("time")) row["time"] = unix_now();
  std::ofstream out(file_, std::ios::app);
  out << row.dump() << "\n";
  out.flush();
  if (!out) throw UserError("cannot write " + file_.string() + ": " + std::strerror(errno) + " (is the disk full?)");
  write_events(events_of(row), true);
}

void for_each_metrics_line(const std::filesystem::path& file,
                           const std::function<bool(const std::string& line, const nlohmann::json* row)>& visit) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return;
  ::close(kit::open_regular_file(file, "metrics file"));
  std::ifstream metrics(file, std::ios::binary);
  std::string line;
  bool too_long = false;
  while (read_line(metrics, line, too_long)) {
    std::optional<nlohmann::json> row;
    if (!too_long) {
      try {
        row = kit::json::parse(line, file.string());
      } catch (const UserError&) {
      }
      if (row && !(row->is_object() && row->contains("step") && (*row)["step"].is_number_integer())) row.reset();
    }
    if (!visit(line, row ? &*row : nullptr)) return;
  }
}

void MetricsSink::keep_through(std::int64_t step) const {
  std::string kept;
  std::string events = formats::tensorboard::version_event(unix_now());
  // Lines that are not rows (a blank line, one torn by the kill, one that is not loom's) go; every
  // row through `step` stays, wherever it stands, as `loom report` reads them.
  for_each_metrics_line(file_, [&](const std::string& line, const nlohmann::json* row) {
    if (!row) return true;
    if ((*row)["step"].get<std::int64_t>() <= step) {
      kept += line + "\n";
      events += events_of(*row);
    }
    return true;
  });
  kit::write_file_atomically(file_, kept);
  write_events(events, false);
}

}  // namespace loom::core
