// Columnar data files: the input is written as a Parquet file and as an Arrow IPC file (stream or
// file form, by its first bytes) and read through [data] format, as training reads them.
#include "config/data.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto dir = fuzz::scratch();
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  for (const char* name : {"data.parquet", "data.arrow"}) {
    fuzz::write(dir / name, bytes);
    try {
      core::load_data(dir / name, "{question} {answer} {id} {n32} {score} {flag}", false);
    } catch (const UserError&) {
    }
  }
  return 0;
}
