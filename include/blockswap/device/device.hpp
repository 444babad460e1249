// Device: one accelerator (or the emulated one), shared by every offloader of a model.
//
// A model with two block lists (FLUX, HunyuanVideo, HiDream: double and single blocks) has an
// offloader per list. They share one Device: one copy stream (or emulated copy engine), so
// that loads run one after another in the order the blocks compute; one account of the device
// memory their slots hold; and an optional budget for all of them together.
//
//   auto device = blockswap::Device::open("cuda", {.budget_bytes = 20ull << 30});
//   // each offloader: options.shared_device = device (the LibTorch front end, torch.hpp)
//
// Device::open is the one place that knows which backends this build has. An engine runs on
// the Backend that attach() returns: the device's own backend, seen through the account.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "blockswap/core/backend.hpp"

struct CUstream_st; // cudaStream_t is CUstream_st*

namespace blockswap {

struct DeviceOptions {
  // Device bytes that the slots of every offloader on this device may hold together; over it,
  // a slot allocation throws OutOfMemory. 0 = no budget but the device's memory.
  std::size_t budget_bytes = 0;
  // The emulated device: its copy bandwidth in GB/s (0 = memcpy speed) and its memory in bytes
  // (0 = no limit).
  double emulated_link_gbps = 0;
  std::size_t emulated_capacity_bytes = 0;
  // The emulated device: how much host memory it may page-lock (EmulatedDeviceOptions::
  // pinnable_bytes: a low `ulimit -l`, WSL); empty = no cap.
  std::optional<std::size_t> emulated_pinnable_bytes = std::nullopt;
  // CUDA: the stream blocks are computed on, asked at every use (the LibTorch front end passes
  // torch's current stream); empty = the legacy default stream.
  std::function<CUstream_st*()> compute_stream = nullptr;
  // CUDA: gives back the device memory another allocator of this process keeps cached, and
  // says what it still holds, when a slot does not fit (CudaDeviceOptions::
  // release_cached_memory; the LibTorch front end passes torch's emptyCache); empty = none.
  std::function<std::string()> release_cached_memory = nullptr;
};

// Bytes that move between host and device and are not block weights: the activations the
// LibTorch front end's store offloads for an offloader on this device. They copy on torch's own
// streams into torch's pinned memory, not on the Device's copy stream (docs/performance.md,
// "Offloaded activations and the Device" says why); the Device counts them.
struct TransferStats {
  std::size_t host_bytes = 0;      // host memory holding them now
  std::size_t peak_host_bytes = 0; // the most it has held
  std::uint64_t bytes_d2h = 0;     // copied device->host
  std::uint64_t bytes_h2d = 0;     // copied back host->device
};

// Host memory blockswap page-locks through a Device (Note [exact host memory] in
// src/device/host_memory.cpp): block copies and their spares, the staging ring, offloaded
// activations, a fine-tuner's host state and gradients, a node's shared copy. Each buffer has
// exactly the size asked, counted as the system locks it (whole pages); every offloader on the
// device together, since the device opened.
struct HostMemoryStats {
  std::size_t pinned_bytes = 0; // page-locked now
  std::size_t peak_pinned_bytes = 0;
  std::size_t kept_bytes = 0; // what those buffers hold now
  std::size_t peak_kept_bytes = 0;
  // Host buffers the system refused to page-lock (Buffer::pageable: a low `ulimit -l`, WSL).
  std::size_t pageable_bytes = 0;
  // Bytes page-locked per byte kept, at their peaks: 1 is nothing wasted (torch's caching
  // pinned allocator, rounding up to powers of two, gives up to 2); 0 while nothing was kept.
  double pinned_per_kept() const {
    return peak_kept_bytes == 0 ? 0.0 : double(peak_pinned_bytes) / double(peak_kept_bytes);
  }
};

class Device {
public:
  // "emulated" (or "cpu"), "cuda" (device 0), "cuda:N". Throws Error naming the devices this
  // build has when it has no such backend, or the backend's error when it cannot be used.
  static std::shared_ptr<Device> open(std::string_view name, DeviceOptions options = {});
  // The kinds of device this build can open: "emulated", and "cuda" when built with CUDA.
  static std::vector<std::string> kinds();
  // Whether a device of this kind can be opened here now: "emulated" always, "cuda" when built
  // with CUDA and a GPU is present.
  static bool present(std::string_view kind);

  // A device over a backend made elsewhere (a test double, a backend of your own).
  explicit Device(std::shared_ptr<Backend> backend, std::size_t budget_bytes = 0);
  ~Device();

  // not copyable, not movable: attached backends refer to its state
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  std::string name() const; // the backend's: "emulated", "cuda:0"
  bool is_cuda() const;
  // The shared backend: its copy stream is the one every attached engine copies on.
  Backend& backend() const;
  std::size_t budget_bytes() const; // 0 = none
  // What the budget leaves for more slots: the budget minus what attached engines hold now
  // (the most a size_t holds when there is no budget).
  std::size_t available_bytes() const;
  // Device memory held through attach(), every engine together: now and at most.
  MemoryStats memory() const;

  // Counts a transfer that is not block weights (TransferStats): `bytes` copied device->host
  // into host memory held until count_host_freed(bytes); `bytes` copied back host->device.
  void count_d2h(std::size_t bytes);
  void count_h2d(std::size_t bytes);
  void count_host_freed(std::size_t bytes);
  TransferStats transfers() const;
  // What blockswap's host buffers on this device lock and hold (HostMemoryStats).
  HostMemoryStats host_memory() const;
  // A page-locked host buffer of exactly `bytes` for memory that comes and goes every step
  // (offloaded activations), from this device's pool: resetting it gives it back, and a later
  // request of the same size takes it again. The pool never holds more than the most its
  // buffers held at once. Where the system refuses to lock, the buffer is pageable (and marked).
  Buffer pooled_host(std::size_t bytes);
  // Frees the pool's buffers that nobody holds.
  void trim_host_pool();

  // The backend for one engine (one offloader). Its device allocations count against the
  // budget, and the OutOfMemory it throws names `label`; its copies go on the shared copy
  // stream in the order they are enqueued; the copy observer it is given sees only its own
  // copies; memory() reports its own allocations. It keeps the device alive.
  std::shared_ptr<Backend> attach(std::string label);

  struct State;

private:
  std::shared_ptr<State> state_;
};

} // namespace blockswap
