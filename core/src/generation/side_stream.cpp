#include "generation/side_stream.hpp"

#ifdef LOOM_WITH_CUDA
#include <map>
#include <mutex>

namespace loom::core {

c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
  static std::mutex guard;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  const std::lock_guard<std::mutex> lock(guard);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  return it->second;
}

}  // namespace loom::core
#endif
