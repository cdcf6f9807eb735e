#include "loom/communicator.hpp"
#include "loom/mesh.hpp"

namespace loom {

MeshCoord Mesh::coord(int rank) const { return {rank / (pipeline * tensor), (rank / tensor) % pipeline, rank % tensor}; }

int Mesh::rank(const MeshCoord& c) const { return (c.data * pipeline + c.pipeline) * tensor + c.tensor; }

std::string Mesh::str() const {
  return "data " + std::to_string(data) + " x pipeline " + std::to_string(pipeline) + " x tensor " + std::to_string(tensor);
}

Work::~Work() = default;
Communicator::~Communicator() = default;
Parallel::~Parallel() = default;
AllToAll::~AllToAll() = default;
ExpertParallel::~ExpertParallel() = default;

}  // namespace loom
