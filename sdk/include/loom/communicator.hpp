#pragma once
// How ranks talk: an interface over LibTorch's c10d process groups (NCCL between GPUs, Gloo on
// the CPU), implemented by the host. Plugins get one group per mesh axis from Parallel and never
// move bytes between processes any other way.
#include <memory>
#include <stdexcept>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/capability.hpp"
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

// Capability of a Communicator that exchanges rows with every rank of its group at once (SDK 3.11).
class LOOM_API AllToAll : public Capability {
 public:
  ~AllToAll() override;
  // input's first input_splits[0] rows go to rank 0, the next input_splits[1] to rank 1, ...;
  // output receives output_splits[i] rows from rank i, in rank order. Both contiguous on the
  // group's device with the same row shape; each list has size() counts summing to its tensor's rows.
  virtual std::unique_ptr<Work> all_to_all(at::Tensor& output, at::Tensor& input, const std::vector<std::int64_t>& output_splits,
                                           const std::vector<std::int64_t>& input_splits) = 0;
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

// Capability of a Parallel whose data ranks share out a mixture of experts' experts between them
// (SDK 3.11; [parallel] expert = N, N dividing data). Data rank d holds experts
// (d % N) * E/N .. (d % N + 1) * E/N - 1 of every sparse layer and sends each token's rows to the
// rank of the expert that takes it.
class LOOM_API ExpertParallel : public Capability {
 public:
  ~ExpertParallel() override;
  // The N data ranks that share out the experts: data ranks d with the same d / N (and the same
  // pipeline and tensor coordinates); its rank is d % N. Offers AllToAll.
  virtual Communicator& expert() = 0;
  // The data ranks that hold the same experts: the same d % N (and the same pipeline and tensor
  // coordinates). Gradients of the experts are summed over it, not over data().
  virtual Communicator& expert_replicas() = 0;
};

}  // namespace loom
