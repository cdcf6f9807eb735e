#include "runtime/metrics_sink.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "config/data.hpp"

namespace loom::core {

void MetricsSink::start_empty() const { kit::write_file_atomically(file_, ""); }

void MetricsSink::append(const nlohmann::json& row) const {
  std::ofstream out(file_, std::ios::app);
  out << row.dump() << "\n";
  out.flush();
  if (!out) throw UserError("cannot write " + file_.string() + ": " + std::strerror(errno) + " (is the disk full?)");
}

void MetricsSink::keep_through(std::int64_t step) const {
  std::string kept;
  std::error_code ec;
  if (std::filesystem::exists(file_, ec)) {
    ::close(kit::open_regular_file(file_, "metrics file"));  // a folder or a FIFO in its place is one clear error
    std::ifstream metrics(file_, std::ios::binary);
    std::string line;
    bool too_long = false;
    while (read_line(metrics, line, too_long) && !too_long) {
      try {
        const auto row = kit::json::parse(line, "metrics.jsonl");
        if (!row.is_object() || !row.contains("step") || !row["step"].is_number_integer()) break;
        if (row["step"].get<std::int64_t>() <= step) kept += line + "\n";
      } catch (const UserError&) {
        break;  // a torn last line from the kill
      }
    }
  }
  kit::write_file_atomically(file_, kept);
}

}  // namespace loom::core
