// Activation offloading around code of your own (ActivationScope; ModelOffloader's run_block
// opens one with Options::offload_activations) and the counters of saved activations. Part of
// the LibTorch front end, blockswap/torch.hpp; this part needs only c10 and at::Tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace blockswap {

class Device; // blockswap/device/device.hpp

// The bytes of a torch device held by saved activations (Options::offload_activations,
// ActivationScope), shared by every offloader and scope of that device.
struct ActivationStats {
  uint64_t offloaded_bytes = 0;   // copied to host memory
  uint64_t restored_bytes = 0;    // copied back for a backward
  uint64_t device_bytes = 0;      // on the device now
  uint64_t peak_device_bytes = 0; // on the device at the peak
};
ActivationStats activation_stats(c10::Device device);
// Sets the counters to zero; the peak to the bytes on the device now.
void reset_activation_stats(c10::Device device);

// While it lives, what autograd saves on this thread for backward is block `label`'s
// activations on `device` (kCPU: the emulated device, or kCUDA): saved storages of at least
// `threshold_bytes` go to host memory when the next scope opens and come back one scope ahead
// of their backward (Note [offloaded activations] in blockswap/core/activation_rule.hpp); the
// others, and the storages of `weights` (the block's parameters and buffers), stay and are
// counted (weights are not). run_block opens one for each block with
// Options::offload_activations; open one yourself around code outside run_block that saves for
// a block's backward, or, with the default threshold, to count a model's saved activations
// without moving them. Does nothing under no grad and inside a backward (a recompute reads what
// it saves at once). `counted_by` (ModelOffloader's: its Device) counts what the scope's group
// moves in its TransferStats. Throws blockswap::Error when copying the earlier scopes'
// activations to host memory fails (they stay on the device).
//
// Process-wide: LibTorch has no saved-tensor hook stack a C++ program can push, so the first
// scope (or the first ModelOffloader with offload_activations) replaces this process's default
// autograd engine with an instance of LibTorch's own engine class that gives saved tensors their
// hooks while a scope is open on the saving thread; it stays for the rest of the process, and
// every later backward runs on it, blockswap's or not. Where the engine in charge is not
// LibTorch's own, the constructor throws blockswap::Error and changes nothing: a Python process
// (use the Python package's offload_activations, on torch's public saved_tensors_hooks), or
// another library that replaced the engine first.
class ActivationScope {
public:
  ActivationScope(c10::Device device, std::string label, const std::vector<at::Tensor>& weights,
                  std::size_t threshold_bytes = SIZE_MAX,
                  std::shared_ptr<Device> counted_by = nullptr);
  ~ActivationScope();
  // not copyable, not movable: it stands for a stretch of this thread's code
  ActivationScope(const ActivationScope&) = delete;
  ActivationScope& operator=(const ActivationScope&) = delete;
  ActivationScope(ActivationScope&&) = delete;
  ActivationScope& operator=(ActivationScope&&) = delete;

  struct State;

private:
  std::shared_ptr<State> state_;
  std::shared_ptr<State> previous_;
};

} // namespace blockswap
