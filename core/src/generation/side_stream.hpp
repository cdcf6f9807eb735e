#pragma once
// The process's one side stream per CUDA device, for work kept off the compute stream: decode
// graphs' captures, offloaded checkpoints' copies. One for the process, not a pool stream per use:
// cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it has run on, so a new pool stream
// per capture (GRPO captures once a step) grew the memory by that much a step until the pool's 32
// streams came round again.
#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

namespace loom::core {
c10::cuda::CUDAStream side_stream(c10::DeviceIndex device);
}  // namespace loom::core
#endif
