// `loom report`'s reading of a run folder: run.json and metrics.jsonl, separated by "\n=====\n",
// turned into the page (the manifest's plan, outputs and versions; the metrics' curves).
#include "cli/run_page.hpp"
#include "fuzz_support.hpp"
#include "loom/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto parts = fuzz::split(data, size, "\n=====\n", 2);
  const auto dir = fuzz::scratch();
  fuzz::write(dir / "run.json", parts[0]);
  fuzz::write(dir / "metrics.jsonl", parts[1]);
  try {
    core::run_page_html(dir);
  } catch (const UserError&) {
  }
  return 0;
}
