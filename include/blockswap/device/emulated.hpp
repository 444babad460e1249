// EmulatedDevice: a device emulated in host memory, for machines without a GPU and for tests.
//
// "Device" memory is a separate arena with an enforced capacity (going over throws
// OutOfMemory, as on a GPU). The compute stream is the calling thread: computing on the device
// means computing on the host, so waiting on the compute stream blocks the caller. The copy
// stream is a thread of its own that executes copies in order, optionally throttled to a link
// bandwidth so that copy/compute overlap can be studied on a laptop; the decode stream
// (Backend::decode) is another, optionally slowed (Note [the emulated decode stream] in
// emulated_device.cpp). Released memory is poisoned with NaN.
#pragma once

#include <cstddef>
#include <limits>
#include <memory>
#include <string>

#include "blockswap/core/backend.hpp"

namespace blockswap {

struct EmulatedDeviceOptions {
  std::size_t capacity_bytes = std::numeric_limits<std::size_t>::max();
  double link_gbps = 0; // copy bandwidth in GB/s (1e9 bytes/s); 0 = as fast as memcpy
  // How much host memory allocate_host may page-lock, as `ulimit -l` or WSL caps it: past it,
  // host buffers are pageable (Buffer::pageable), and a copy from or to one makes the host wait
  // until it is done, as cudaMemcpyAsync does with pageable memory.
  std::size_t pinnable_bytes = std::numeric_limits<std::size_t>::max();
  // decode throughput in GB/s of decoded bytes: each decode waits that long before it writes,
  // so that a read that does not wait for it shows; 0 = as fast as the decoder
  double decode_gbps = 0;
};

class EmulatedDevice final : public Backend {
public:
  explicit EmulatedDevice(EmulatedDeviceOptions options = {});
  ~EmulatedDevice() override; // finishes the work already enqueued, then stops the threads

  // not copyable, not movable: the copy thread refers to this object's state
  EmulatedDevice(const EmulatedDevice&) = delete;
  EmulatedDevice& operator=(const EmulatedDevice&) = delete;

  std::string name() const override;
  Buffer allocate_host(std::size_t bytes) override;
  Buffer allocate_device(std::size_t bytes) override;
  void copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                      int64_t tag) override;
  void copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                    int64_t tag) override;
  void set_copy_observer(CopyObserver observer) override;
  // codec::decode on the copy thread
  void decode(std::byte* out, const std::byte* compressed, std::size_t bytes,
              const codec::Parsed& parsed, int64_t tag) override;
  bool can_decode() const override;
  void poison(std::byte* device, std::size_t bytes) override;
  std::unique_ptr<Event> make_event() override;
  void record(Event& event, Stream stream) override;
  void wait(Stream stream, const Event& event) override;
  void wait_host(Stream stream, std::function<void()> until) override;
  void synchronize(const Event& event) override;
  MemoryStats memory() const override;

  // Fault injection: the copy enqueued `nth` copies from now (0 = the next one) fails after
  // copying its first `bytes_first` bytes (0: without touching either side), as a link that
  // drops part-way would; the failure reaches whoever waits on the next event recorded on the
  // copy stream.
  void fail_copy(std::size_t nth = 0, std::size_t bytes_first = 0);
  // Fault injection: the copy thread itself throws while executing the `nth` copy from now, as
  // a bug or an allocation failure inside a copy engine would. The thread survives; the
  // exception reaches whoever waits on the next event recorded on the copy stream.
  void throw_in_copy_thread(std::size_t nth = 0);
  // Seconds the copy thread has spent copying, throttle included.
  double copy_seconds() const;
  // Copies from or to pageable host memory so far (EmulatedDeviceOptions::pinnable_bytes).
  std::size_t pageable_copies() const;

private:
  void wait_if_pageable(const std::byte* host);

  struct State;
  std::shared_ptr<State> state_;
};

} // namespace blockswap
