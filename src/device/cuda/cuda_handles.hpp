// Move-only owners of CUDA runtime handles (streams, events) and the current-device scope.
// Implementer-only (src/device/cuda). Destructors never throw: a CUDA error there is logged
// (BLOCKSWAP_CUDA_LOG), since by then nobody can act on it.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

#include "cuda_check.hpp"

namespace blockswap::cuda {

// Makes `device` current for the scope; the previous device comes back afterwards. Cheap where
// `device` is current already (the usual case): one cudaGetDevice, a read of the runtime's
// per-thread state; cudaSetDevice runs only to switch, and to switch back.
class DeviceScope {
public:
  explicit DeviceScope(int device) {
    BLOCKSWAP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      BLOCKSWAP_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceScope() {
    if (switched_) BLOCKSWAP_CUDA_LOG(cudaSetDevice(previous_));
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

private:
  int previous_ = 0;
  bool switched_ = false;
};

// A non-blocking stream on one device.
class StreamHandle {
public:
  StreamHandle() = default;
  explicit StreamHandle(int device) : device_(device) {
    DeviceScope scope(device);
    BLOCKSWAP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~StreamHandle() { reset(); }

  // move-only
  StreamHandle(const StreamHandle&) = delete;
  StreamHandle& operator=(const StreamHandle&) = delete;
  StreamHandle(StreamHandle&& other) noexcept
      : stream_(std::exchange(other.stream_, nullptr)), device_(other.device_) {}
  StreamHandle& operator=(StreamHandle&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
      device_ = other.device_;
    }
    return *this;
  }

  cudaStream_t get() const { return stream_; }
  explicit operator bool() const { return stream_ != nullptr; }
  // Waits for the stream's work, then destroys it; logs what fails. Never throws.
  void reset() noexcept {
    if (stream_ == nullptr) return;
    BLOCKSWAP_CUDA_LOG(cudaStreamSynchronize(stream_));
    BLOCKSWAP_CUDA_LOG(cudaStreamDestroy(stream_));
    stream_ = nullptr;
  }

private:
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

// An event without timing, for ordering only.
class EventHandle {
public:
  EventHandle() = default;
  // `timing`: the event can be timed (cudaEventElapsedTime); otherwise it is lighter.
  explicit EventHandle(int device, bool timing = false) {
    DeviceScope scope(device);
    BLOCKSWAP_CUDA_CHECK(
        cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~EventHandle() { reset(); }

  // move-only
  EventHandle(const EventHandle&) = delete;
  EventHandle& operator=(const EventHandle&) = delete;
  EventHandle(EventHandle&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  EventHandle& operator=(EventHandle&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }

  cudaEvent_t get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }
  void reset() noexcept {
    if (event_ == nullptr) return;
    BLOCKSWAP_CUDA_LOG(cudaEventDestroy(event_));
    event_ = nullptr;
  }

private:
  cudaEvent_t event_ = nullptr;
};

} // namespace blockswap::cuda
