// A run folder's state as --resume reads it: checkpoints/latest, the named checkpoint's
// trainer.json and run.json, separated by "\n=====\n".
#include "fuzz_support.hpp"
#include "loom/kit/json.hpp"
#include "runtime/checkpointer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto parts = fuzz::split(data, size, "\n=====\n", 3);
  const auto dir = fuzz::scratch();
  std::filesystem::create_directories(dir / "checkpoints/step-00000010");
  fuzz::write(dir / "checkpoints/latest", parts[0]);
  fuzz::write(dir / "checkpoints/step-00000010/trainer.json", parts[1]);
  fuzz::write(dir / "run.json", parts[2]);
  try {
    core::read_checkpoint_state(dir / "checkpoints", {100, 8, 1000});
  } catch (const UserError&) {
  }
  try {
    kit::json::read_file(dir / "run.json", 64u << 20, "run manifest");
  } catch (const UserError&) {
  }
  return 0;
}
