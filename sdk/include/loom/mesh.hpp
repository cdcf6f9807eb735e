#pragma once
#include <string>

#include "loom/export.hpp"

namespace loom {

// Where a rank sits on each axis of the process mesh.
struct MeshCoord {
  int data = 0;
  int pipeline = 0;
  int tensor = 0;
};

// The process mesh: data x pipeline x tensor ranks. Tensor is the fastest-varying axis, then
// pipeline, then data (as Megatron orders them), so the ranks of one tensor group are neighbours
// (one host, NVLink) and a data replica is a contiguous run of pipeline x tensor ranks.
struct LOOM_API Mesh {
  int data = 1;
  int pipeline = 1;
  int tensor = 1;

  int world() const { return data * pipeline * tensor; }
  int replica_size() const { return pipeline * tensor; }  // ranks holding one copy of the model
  MeshCoord coord(int rank) const;
  int rank(const MeshCoord& coord) const;
  std::string str() const;  // "data 2 x pipeline 1 x tensor 1"
  bool operator==(const Mesh& other) const { return data == other.data && pipeline == other.pipeline && tensor == other.tensor; }
  bool operator!=(const Mesh& other) const { return !(*this == other); }
};

}  // namespace loom
