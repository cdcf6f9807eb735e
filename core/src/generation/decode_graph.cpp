#include "generation/decode_graph.hpp"

#include <map>
#include <mutex>
#include <stdexcept>

#ifdef LOOM_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::core {

#ifdef LOOM_WITH_CUDA
struct DecodeGraph::Recorded {
  at::cuda::CUDAGraph graph;
};

bool DecodeGraph::available() { return true; }

namespace {

// The stream every capture on `device` runs on, the same one for the process: cuBLAS keeps a
// workspace (32 MiB on Hopper) for each stream it has run on, so a new pool stream per capture
// (GRPO captures once a step) grew the memory by that much a step until the pool's 32 streams
// came round again.
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device) {
  static std::mutex guard;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  const std::lock_guard<std::mutex> lock(guard);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  return it->second;
}

}  // namespace

void DecodeGraph::capture(const std::function<void()>& step) {
  recorded_ = std::make_unique<Recorded>();
  // Capture needs a stream other than the legacy default one; the warm-up runs there too, so that
  // what the first run of a kernel sets up per stream exists before recording starts.
  const c10::cuda::CUDAStream side = capture_stream(c10::cuda::current_device());
  c10::cuda::device_synchronize();
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    step();
  }
  side.synchronize();
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    recorded_->graph.capture_begin();
    step();
    recorded_->graph.capture_end();
  }
  side.synchronize();
}

void DecodeGraph::replay() { recorded_->graph.replay(); }
#else
struct DecodeGraph::Recorded {};
bool DecodeGraph::available() { return false; }
void DecodeGraph::capture(const std::function<void()>&) { throw std::logic_error("DecodeGraph: a CPU-only build cannot capture CUDA graphs"); }
void DecodeGraph::replay() { throw std::logic_error("DecodeGraph: a CPU-only build cannot replay CUDA graphs"); }
#endif

DecodeGraph::DecodeGraph() = default;
DecodeGraph::~DecodeGraph() = default;

}  // namespace loom::core
