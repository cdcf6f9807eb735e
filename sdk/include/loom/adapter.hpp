#pragma once
#include <cstdint>
#include <vector>

#include "loom/export.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"

namespace loom {

class LOOM_API Adapter : public Plugin {
 public:
  ~Adapter() override;  // defined in the SDK library: one typeinfo for host and plugins
  // Trainable parameters the adapter adds to each block, in the order of model.blocks. Metadata
  // only, so a plan can count adapter weights, gradients and optimizer state before any weight
  // is loaded. Throws UserError when the adapter cannot apply (e.g. a target module the model lacks).
  virtual std::vector<std::uint64_t> trainable_parameters(const ModelStructure& model) const = 0;
};

}  // namespace loom
