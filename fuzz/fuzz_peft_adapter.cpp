// A PEFT adapter folder (adapter_config.json, then adapter_model.safetensors after
// "\n=====\n"), loaded by the lora plugin onto a tiny random Llama, then saved and merged.
#include "fuzz_support.hpp"
#include "loom/adapter.hpp"
#include "loom/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto parts = fuzz::split(data, size, "\n=====\n", 2);
  const auto dir = fuzz::scratch();
  std::filesystem::create_directories(dir / "adapter");
  fuzz::write(dir / "adapter/adapter_config.json", parts[0]);
  fuzz::write(dir / "adapter/adapter_model.safetensors", parts[1]);
  static const auto model = fuzz::plugin<Model>("model", "llama",
                                                {{"init", std::string("random")}, {"hidden_size", std::int64_t{16}}, {"intermediate_size", std::int64_t{32}},
                                                 {"num_hidden_layers", std::int64_t{1}}, {"num_attention_heads", std::int64_t{2}},
                                                 {"vocab_size", std::int64_t{64}}});
  LoadRequest request;
  request.block_devices.assign(model->structure().blocks.size(), c10::Device(c10::kCPU));
  const auto loaded = model->load(request);
  auto lora = fuzz::plugin<Adapter>("adapter", "lora", {{"target_modules", std::string("all-linear")}});
  try {
    lora->load(*loaded, dir / "adapter");
    lora->save(*loaded, dir / "saved");
    lora->merge(*loaded);
  } catch (const UserError&) {
  }
  return 0;
}
