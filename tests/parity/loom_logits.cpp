// Writes loom's fp32 CPU logits for an HF model folder (plus, optionally, an adapter folder) on the
// inputs of a parity fixture, for tests/parity/check_loom_adapter.py to compare with PEFT.
//   loom_logits MODEL_DIR INPUTS_JSON OUT.safetensors [ADAPTER_DIR]
#include <fstream>
#include <iostream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>

#include "runtime/executor.hpp"
#include "loom/adapter.hpp"
#include "loom/error.hpp"
#include "loom/kit/safetensors.hpp"
#include "plugins/plugin_registry.hpp"

int main(int argc, char** argv) {
  using namespace loom;
  if (argc < 4 || argc > 5) {
    std::cerr << "usage: loom_logits MODEL_DIR INPUTS_JSON OUT.safetensors [ADAPTER_DIR]\n";
    return 2;
  }
  try {
    core::PluginRegistry registry;
    registry.scan_directory(LOOM_BUILTIN_PLUGIN_DIR, true);
    const auto defaults = [&](const core::LoadedPlugin& p) {
      Options o;
      for (const auto& s : p.schema)
        if (s.default_value) o.set(s.name, *s.default_value);
      return o;
    };
    Options model_options = defaults(*registry.find("model", "llama"));
    model_options.set("path", std::string(argv[1]));
    auto model_object = registry.create(*registry.find("model", "llama"), model_options);
    auto& model = dynamic_cast<Model&>(*model_object);
    Plan plan;
    for (const auto& b : model.structure().blocks) plan.blocks.push_back({b.name, "cpu"});
    auto executor = core::load_executor(model, plan, DType::kFloat32, 0);
    std::unique_ptr<Plugin> adapter_object;
    if (argc == 5) {
      adapter_object = registry.create(*registry.find("adapter", "lora"), defaults(*registry.find("adapter", "lora")));
      dynamic_cast<Adapter&>(*adapter_object).load(executor->model(), argv[4]);
    }
    std::ifstream in(argv[2]);
    const auto j = nlohmann::json::parse(in);
    const auto tensor = [](const nlohmann::json& rows) {
      std::vector<std::int64_t> flat;
      for (const auto& r : rows)
        for (const auto& v : r) flat.push_back(v.get<std::int64_t>());
      return at::tensor(flat, at::kLong).view({static_cast<std::int64_t>(rows.size()), -1});
    };
    at::NoGradGuard no_grad;
    executor->model().set_training(false);
    const at::Tensor logits = executor->forward(tensor(j["input_ids"]), tensor(j["position_ids"]), tensor(j["attention_mask"]));
    kit::write_safetensors(argv[3], {{"logits", logits}});
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "loom_logits: " << e.what() << "\n";
    return 1;
  }
}
