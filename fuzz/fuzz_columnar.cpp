// Columnar data files, through the formats library alone: the input is written as a Parquet file
// and as an Arrow IPC file (stream or file form, by its first bytes) and read row by row, every
// value checked as training's reader checks it.
#include <nlohmann/json.hpp>

#include "fuzz_files.hpp"
#include "loom/error.hpp"
#include "loom/formats/table_rows.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto dir = fuzz::scratch();
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  for (const char* name : {"data.parquet", "data.arrow"}) {
    fuzz::write(dir / name, bytes);
    try {
      const auto rows = std::string(name) == "data.parquet" ? formats::open_parquet(dir / name) : formats::open_arrow(dir / name);
      nlohmann::ordered_json row;
      while (rows->next(row)) {
      }
    } catch (const UserError&) {
    }
  }
  return 0;
}
