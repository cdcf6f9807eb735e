#pragma once
// Weights every rank of a group holds whole must stay equal there: a data group's ranks each hold
// every trainable weight of their stage, a tensor group's the weights it does not split. A copy
// that drifts (a weight each tensor rank applies to its own heads, whose gradient each rank sees
// only part of, trained without the sum over the group) trains on silently; `[run] check_replicas`
// finds it after the step where it happened.
#include <cstdint>
#include <string>
#include <vector>

#include "loom/communicator.hpp"
#include "loom/model.hpp"

namespace loom::core {

// Compares, over `group` (the `axis` named in messages: "data", "tensor"), each of `params` whose
// `include` is true, by a fingerprint per weight (its sum and sum of squares in float64) gathered on
// `comm_device`. Copies kept bit-identical, as loom keeps them, have equal fingerprints. Throws
// std::logic_error (loom's or the plugin's bug, not the user's) naming the first weight that
// differs, the ranks and the step.
void check_replicas(Communicator& group, const std::string& axis, const std::vector<NamedParameter>& params, const std::vector<bool>& include,
                    std::int64_t step, const c10::Device& comm_device);

}  // namespace loom::core
