#pragma once
// One decode step recorded as a CUDA graph and replayed per token: the whole step (every layer,
// the head, the draw and the rows' bookkeeping) goes to the GPU as one launch instead of hundreds,
// which is what eager LibTorch from C++ pays per token. The step must work in place on tensors
// made before the capture and never wait for the host.
#include <functional>
#include <memory>

namespace loom::core {

class DecodeGraph {
 public:
  // Whether this build can capture (a CUDA build of LibTorch).
  static bool available();
  DecodeGraph();
  ~DecodeGraph();
  DecodeGraph(const DecodeGraph&) = delete;
  DecodeGraph& operator=(const DecodeGraph&) = delete;
  // Runs `step` once for real on a side stream (its kernels, cuBLAS workspace and memory warmed
  // there, as capture needs), then records it without running it.
  void capture(const std::function<void()>& step);
  // Runs the recorded step on the current stream.
  void replay();

 private:
  struct Recorded;
  std::unique_ptr<Recorded> recorded_;
};

}  // namespace loom::core
