// Data files through [data] format: the first line is the format, the rest the records, read as
// JSON lines (or a JSON array, when they start with '['), as CSV and as TSV; the first byte of the
// format line picks on_bad_line = "skip" (odd) or "error".
#include "config/data.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto parts = fuzz::split(data, size, "\n", 2);
  const auto dir = fuzz::scratch();
  const bool skip = !parts[0].empty() && (static_cast<unsigned char>(parts[0][0]) & 1);
  for (const char* name : {"data.jsonl", "data.csv", "data.tsv"}) {
    fuzz::write(dir / name, parts[1]);
    try {
      core::load_data(dir / name, parts[0], skip);
    } catch (const UserError&) {
    }
  }
  return 0;
}
