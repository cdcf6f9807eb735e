#include "runtime/replica_check.hpp"

#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>

namespace loom::core {

void check_replicas(Communicator& group, const std::string& axis, const std::vector<NamedParameter>& params, const std::vector<bool>& include,
                    std::int64_t step, const c10::Device& comm_device) {
  if (group.size() < 2) return;
  std::vector<const NamedParameter*> checked;
  std::vector<at::Tensor> rows;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!include[i]) continue;
    const at::Tensor values = params[i].tensor.detach().to(at::kDouble);
    rows.push_back(at::stack({values.sum(), values.square().sum()}).to(comm_device));
    checked.push_back(&params[i]);
  }
  if (rows.empty()) return;
  at::Tensor mine = at::stack(rows).contiguous();
  std::vector<at::Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(at::empty_like(mine));
  group.all_gather(all, mine)->wait();
  const at::Tensor first = all[0].to(at::kCPU);
  for (int r = 1; r < group.size(); ++r) {
    const at::Tensor other = all[static_cast<std::size_t>(r)].to(at::kCPU);
    const at::Tensor differs = (other != first).any(1);
    if (!differs.any().item<bool>()) continue;
    const auto at = static_cast<std::size_t>(differs.nonzero()[0][0].item<std::int64_t>());
    std::ostringstream why;
    why.precision(17);
    why << "step " << step + 1 << ": weight '" << checked[at]->name << "' is whole on every " << axis << " rank, but " << axis << " rank " << r
        << "'s copy differs from rank 0's (sum " << other[static_cast<std::int64_t>(at)][0].item<double>() << " vs "
        << first[static_cast<std::int64_t>(at)][0].item<double>() << "): "
        << (axis == "tensor" ? "each tensor rank computed its own part of its gradient and they were not summed; the model plugin must mark "
                               "where each rank uses its part (kit::copy_to_tensor_region)"
                             : "the data ranks' gradients or optimizer steps were not the same");
    throw std::logic_error(why.str());
  }
}

}  // namespace loom::core
