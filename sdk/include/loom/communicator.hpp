#pragma once
// How ranks talk: an interface over LibTorch's c10d process groups (NCCL between GPUs, Gloo on
// the CPU), implemented by the host. Plugins get one group per mesh axis from Parallel and never
// move bytes between processes any other way.
#include <memory>
#include <stdexcept>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/mesh.hpp"

namespace loom {

enum class ReduceOp { kSum, kMax, kMin };

// An operation in flight; wait() blocks until it is done and throws CommunicationError on a
// failure or a timeout.
class LOOM_API Work {
 public:
  virtual ~Work();
  virtual void wait() = 0;
};

// A peer failed, hung past the run's timeout, or the group broke: names the rank when it can.
class LOOM_API CommunicationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One group of ranks. Ranks are the group's own (0 .. size()-1). Tensors must be on the group's
// device type (CUDA for NCCL, CPU for Gloo) and contiguous; collectives work in place.
class LOOM_API Communicator {
 public:
  virtual ~Communicator();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::unique_ptr<Work> all_reduce(std::vector<at::Tensor>& tensors, ReduceOp op) = 0;
  virtual std::unique_ptr<Work> broadcast(std::vector<at::Tensor>& tensors, int root) = 0;
  // outputs[i] receives rank i's input; every output has the input's shape.
  virtual std::unique_ptr<Work> all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) = 0;
  // output receives the reduction of every rank's inputs[rank()].
  virtual std::unique_ptr<Work> reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op) = 0;
  virtual std::unique_ptr<Work> send(std::vector<at::Tensor>& tensors, int to, int tag) = 0;
  virtual std::unique_ptr<Work> recv(std::vector<at::Tensor>& tensors, int from, int tag) = 0;
  virtual void barrier() = 0;

  // Blocking conveniences.
  void all_reduce_now(std::vector<at::Tensor> tensors, ReduceOp op) { all_reduce(tensors, op)->wait(); }
};

// This process's place in the mesh and its groups. In a one-process run every group has one rank.
class LOOM_API Parallel {
 public:
  virtual ~Parallel();
  virtual const Mesh& mesh() const = 0;
  virtual int rank() const = 0;  // in the world
  MeshCoord coord() const { return mesh().coord(rank()); }
  virtual Communicator& world() = 0;
  virtual Communicator& data() = 0;      // same pipeline and tensor coordinates
  virtual Communicator& pipeline() = 0;  // same data and tensor coordinates
  virtual Communicator& tensor() = 0;    // same data and pipeline coordinates
};

}  // namespace loom
