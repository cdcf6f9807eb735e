#include "generation/decode_graph.hpp"
#include "generation/side_stream.hpp"

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

void DecodeGraph::capture(const std::function<void()>& step) {
  recorded_ = std::make_unique<Recorded>();
  // Capture needs a stream other than the legacy default one; the warm-up runs there too, so that
  // what the first run of a kernel sets up per stream exists before recording starts.
  const c10::cuda::CUDAStream side = side_stream(c10::cuda::current_device());
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
