#pragma once
// Tensor parallelism applied by the host, torchtitan's way: a model that declares how each of its
// linears splits (LinearInfo::parallel in its structure) but does not split itself (it offers no
// TensorParallelModel) is loaded whole on every tensor rank, then each declared linear's weight is
// cut to this rank's part (column: its output rows, the bias with them; row: its input columns, the
// output summed over the group, the bias added once). The model writes no sharding code and no
// collective: the parts' products go through the kit's split weights, its parameters name the
// parts, the gradient norm and the replica check read shard_dim(), and saving gathers the parts.
#include <memory>
#include <string>
#include <vector>

#include "loom/adapter.hpp"
#include "loom/model.hpp"

namespace loom::core {

// The linears a model declares split (column or row), from its structure.
std::vector<LinearInfo> declared_splits(const ModelStructure& structure);

// Whether the host can split `structure` over `tensor` ranks: "" where it can, else why not.
// `notes` gets what the split does, for the plan.
std::string host_split_refusal(const ModelStructure& structure, int tensor, std::vector<std::string>& notes);

// `model` (loaded whole) with every declared linear it holds cut to this rank's part of `group`;
// `storing`: the adapter that stores the base its own way (4-bit), which then stores each part.
std::unique_ptr<LoadedModel> split_by_host(std::unique_ptr<LoadedModel> model, const ModelStructure& structure, Communicator& group,
                                           const BaseStoringAdapter* storing);

}  // namespace loom::core
