#pragma once
// [train] activation_checkpointing = "offload": a recomputed layer's saved input lives in pinned
// host memory between its forward and its backward. The copy out starts as the forward passes
// the layer, on a side stream; a layer's backward starts the copy back of the layer before it, so
// that copy runs while this one recomputes and backpropagates.
#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace loom::core {

class OffloadedInput : public torch::CustomClassHolder {
 public:
  // Starts moving `input` (a layer's input) to the host; `previous` is the input of the layer
  // before it in the same pass (null for the first), which take() brings back early. A CPU input
  // stays where it is.
  OffloadedInput(const at::Tensor& input, c10::intrusive_ptr<OffloadedInput> previous);
  ~OffloadedInput() override;
  // The input on its device, for the layer's backward (once); starts bringing back the previous one.
  at::Tensor take();
  // Starts the copy back to the device (no-op if started, or on the CPU).
  void prefetch();

 private:
  struct Transfers;  // the CUDA event of the copy back (empty without CUDA)
  at::Tensor kept_;  // the CPU input itself, or the host copy of a device input
  at::Tensor back_;  // the prefetched copy on the device
  c10::Device device_;
  std::unique_ptr<Transfers> transfers_;
  c10::intrusive_ptr<OffloadedInput> previous_;
};

// Pinned host bytes offloaded inputs hold now, and the most at once since the process started.
std::uint64_t offloaded_bytes_now();
std::uint64_t offloaded_bytes_peak();

}  // namespace loom::core
