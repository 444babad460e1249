// CudaDevice: the backend for NVIDIA GPUs, on the CUDA runtime API (no kernels).
//
// Host buffers are pinned (cudaHostAlloc; else cudaHostRegister; else pageable memory, with one
// loud warning: copies then run at about half speed). Device memory comes from cudaMalloc,
// once per slot. Copies run on one non-blocking copy stream, decodes of compressed weights on a
// non-blocking decode stream; compute runs on the stream the `compute_stream` function returns
// at each call (the LibTorch front end passes the current torch stream). Ordering between them
// is by events only: the host never waits for compute.
// Every call runs with `device` current and gives the caller's current device back, so that
// a thread may have any device current when it calls.
// Available when blockswap is built with BLOCKSWAP_CUDA (target blockswap::cuda).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "blockswap/core/backend.hpp"

struct CUstream_st; // cudaStream_t is CUstream_st*

namespace blockswap {

struct CudaDeviceOptions {
  int device = 0;
  // The stream blocks are computed on; nullptr (the default) is the legacy default stream.
  std::function<CUstream_st*()> compute_stream = nullptr;
  // Called when a slot allocation runs out of device memory: gives back to the driver what
  // another allocator of this process keeps cached on the device (the LibTorch front end:
  // torch's caching allocator) and returns what that allocator still holds, in words, for the
  // OutOfMemory message; the allocation is then tried once more. Empty: no second try.
  std::function<std::string()> release_cached_memory = nullptr;
};

class CudaDevice final : public Backend {
public:
  // Throws Error naming the CUDA error when the device cannot be used, and the devices present
  // when `options.device` is not one of them.
  explicit CudaDevice(CudaDeviceOptions options = {});
  ~CudaDevice() override; // waits for the copy and decode streams; never throws

  // not copyable, not movable: events and buffers refer to its stream
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  std::string name() const override;
  Buffer allocate_host(std::size_t bytes) override;
  Buffer pin_host(std::byte* data, std::size_t bytes) override;
  Buffer allocate_device(std::size_t bytes) override;
  void copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                      int64_t tag) override;
  void copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                    int64_t tag) override;
  // Times each copy with events around it on the copy stream; the observer is called for the
  // copies found complete at later calls into this backend (and at destruction).
  void set_copy_observer(CopyObserver observer) override;
  // the codec's CUDA decoder (codec_decode.hpp) on the decode stream
  void decode(std::byte* out, const std::byte* compressed, std::size_t bytes,
              const codec::Parsed& parsed, int64_t tag) override;
  bool can_decode() const override;
  void poison(std::byte* device, std::size_t bytes) override;
  // Events for ordering only, made with cudaEventDisableTiming; make_timed_event's can be timed.
  std::unique_ptr<Event> make_event() override;
  std::unique_ptr<Event> make_timed_event() override;
  void record(Event& event, Stream stream) override;
  void wait(Stream stream, const Event& event) override;
  // cudaLaunchHostFunc: a CUDA thread calls `until` and the stream waits for it to return.
  void wait_host(Stream stream, std::function<void()> until) override;
  void synchronize(const Event& event) override;
  bool times_events() const override { return true; }
  std::optional<double> elapsed_seconds(const Event& start, const Event& end) const override;
  MemoryStats memory() const override;

  // Whether the CUDA runtime sees at least one device (false without a driver).
  static bool available();

private:
  struct State;
  std::shared_ptr<State> state_;
};

} // namespace blockswap
