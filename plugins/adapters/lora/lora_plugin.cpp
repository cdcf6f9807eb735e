// Adapter plugin `lora`: the kit's LoRA (loom/kit/lora.hpp), with PEFT's semantics and file format.
#include "loom/kit/lora.hpp"
#include "loom/plugin.hpp"

namespace loom::lora {
namespace {
std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<kit::LoraAdapter>(o); }
}  // namespace
}  // namespace loom::lora

LOOM_PLUGIN(loom::kKindAdapter, "lora", "0.1.0", "LoRA adapters with PEFT semantics, saved and loaded as PEFT folders", loom::kit::lora_options,
            loom::lora::create)
