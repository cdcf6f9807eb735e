// Placement plugin `tensor-parallel`: every block on one device of each rank of the tensor group
// ([parallel] tensor = N), each rank holding its part of every split weight (Megatron's column and
// row split, as the model declares it; the embedding and head by vocabulary rows). The memory per
// rank counts the split and the whole parts; a rank that cannot hold its part is refused with the
// numbers. Stages across ranks (tensor x pipeline) are the pipeline placement's.
#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/placement.hpp"
#include "loom/plugin.hpp"

namespace loom::tensor_parallel_placement {
namespace {

std::vector<OptionSpec> options() {
  return {
      OptionSpec::string("device", "", "the device each rank uses, as the rank sees it (\"cuda:0\", \"cpu\"); empty: its first GPU, else the cpu"),
      OptionSpec::string("reserve", "1GiB", "headroom kept free on every GPU (CUDA context, allocator fragmentation, communication buffers)"),
  };
}

class TensorParallelPlacement final : public Placement {
 public:
  TensorParallelPlacement(std::string device, std::uint64_t reserve) : device_(std::move(device)), reserve_(reserve) {}

  Plan plan(const PlacementRequest& request) const override {
    const int tensor = request.mesh.tensor;
    if (request.mesh.pipeline > 1)
      throw UserError("[parallel] pipeline = " + std::to_string(request.mesh.pipeline) +
                      " with tensor parallelism: use [placement] plugin = \"pipeline\", which cuts the stages and splits each over the tensor ranks");
    const std::string device = rank_device(request.ranks.at(0), device_);
    Plan plan;
    plan.strategy = "tensor-parallel";
    for (const auto& b : request.model.blocks) plan.blocks.push_back({b.name, device});
    plan.devices = kit::device_usage(request, plan.blocks);
    const DeviceUsage& use = plan.devices.front();
    const std::uint64_t reserve = device == "cpu" ? 0 : reserve_;
    const std::uint64_t room = use.capacity > reserve ? use.capacity - reserve : 0;
    if (use.capacity > 0 && use.total() > room)
      throw UserError("each of the " + std::to_string(tensor) + " tensor ranks needs " + format_bytes(use.total()) + " on " + device + " (weights " +
                      format_bytes(use.weights) + ", grads+optimizer " + format_bytes(use.trainable_state) + ", activations " +
                      format_bytes(use.activations) + ", working " + format_bytes(use.working) + ") but has " + format_bytes(room) +
                      (reserve ? " (" + format_bytes(use.capacity) + " less the reserve of " + format_bytes(reserve) + ")" : std::string()) +
                      "; split over more tensor ranks, turn on [train] activation_checkpointing, lower [train] batch_size or [data] "
                      "max_length, or add pipeline stages (the pipeline placement with [parallel] pipeline)");
    PlacementRequest whole = request;
    whole.mesh.tensor = 1;
    const std::uint64_t unsplit = kit::device_usage(whole, plan.blocks).front().weights;
    if (tensor < 2)  // [parallel] tensor = 1, or a one-process command (loom generate) on a split pipeline
      plan.notes.push_back("all " + std::to_string(plan.blocks.size()) + " blocks on " + device + ", whole: one tensor rank splits nothing");
    else
      plan.notes.push_back("all " + std::to_string(plan.blocks.size()) + " blocks on " + device + " of each of the " + std::to_string(tensor) +
                           " tensor ranks: weights " + format_bytes(use.weights) + " per rank of " + format_bytes(unsplit) + " whole");
    return plan;
  }

 private:
  std::string device_;
  std::uint64_t reserve_;
};

std::unique_ptr<Plugin> create(const Options& o) {
  return std::make_unique<TensorParallelPlacement>(o.get_string("device").empty() ? "" : parse_device(o.get_string("device")).str(),
                                                   parse_bytes(o.get_string("reserve")));
}

}  // namespace
}  // namespace loom::tensor_parallel_placement

LOOM_PLUGIN(loom::kKindPlacement, "tensor-parallel", "0.1.0",
            "every layer split over the tensor ranks (Megatron's column/row split, vocabulary-parallel head)",
            loom::tensor_parallel_placement::options, loom::tensor_parallel_placement::create)
