// The device interface the engine talks to: memory, three streams, events.
//
// A backend has a compute stream (where blocks are computed), one copy stream (where weights
// move) and a decode stream (where compressed weights are decoded, Backend::decode). Work on one
// stream runs in the order it was enqueued; ordering across streams is by events only; a backend
// may run the decode stream's work on its copy stream (more ordering, never less). `final`
// implementations: EmulatedDevice (emulated.hpp) runs anywhere and is the test double;
// TimedDevice (timed.hpp) holds no data and models time; the CUDA backend runs on a GPU;
// Device::attach (device.hpp) wraps one of them for each engine that shares it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "blockswap/core/codec.hpp"

namespace blockswap {

class StagingReader; // core/staging_ring.hpp
struct StagingSpec;

// Move-only owner of a range of host or device memory; frees it with the function it was made
// with. The free function must not need the backend object that made it.
class Buffer {
public:
  using Free = std::function<void(std::byte* data, std::size_t bytes)>;
  // Host memory the system refused to page-lock (Backend::allocate_host's fallback): a copy
  // from or to it makes the host wait for the copy stream (Note [pageable host memory] in
  // load_pipeline.cpp).
  enum class Pinning { pinned_or_device, pageable };

  Buffer() = default;
  Buffer(std::byte* data, std::size_t bytes, Free free, Pinning pinning = Pinning::pinned_or_device)
      : data_(data), bytes_(bytes), free_(std::move(free)), pinning_(pinning) {}
  ~Buffer() { reset(); }

  // move-only
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)),
        free_(std::move(other.free_)), pinning_(other.pinning_) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      free_ = std::move(other.free_);
      pinning_ = other.pinning_;
    }
    return *this;
  }

  std::byte* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  bool pageable() const { return pinning_ == Pinning::pageable; }
  explicit operator bool() const { return data_ != nullptr; }

  void reset() {
    if (data_ != nullptr && free_) free_(data_, bytes_);
    data_ = nullptr;
    bytes_ = 0;
  }

private:
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  Free free_;
  Pinning pinning_ = Pinning::pinned_or_device;
};

// `decode`: Backend::decode's (Note [a decode step] in load_pipeline.cpp). A backend without a
// decode stream of its own runs its work on the copy stream, in the order enqueued there.
enum class Stream { compute, copy, decode };

// A point in a stream's work, made by Backend::make_event and recorded by Backend::record.
// Re-recording replaces the point; waits use the point recorded last before them.
class Event {
public:
  virtual ~Event() = default;
};

// A finished copy, for traces.
struct CopyRecord {
  bool to_device = true;
  std::size_t bytes = 0;
  int64_t tag = -1; // what the caller said the copy was for (the engine: the block index)
  std::chrono::steady_clock::time_point start, end;
};
using CopyObserver = std::function<void(const CopyRecord&)>;

struct MemoryStats {
  std::size_t device_bytes = 0;      // device memory allocated through this backend now
  std::size_t peak_device_bytes = 0; // the most it has been
  std::size_t device_capacity = 0;   // what the device can hold
  bool pinned_host = false;          // host buffers are page-locked
};

class Backend {
public:
  virtual ~Backend() = default;

  // A short name for messages: "emulated", "cuda:0".
  virtual std::string name() const = 0;
  // Host memory for a block's weights, page-locked when possible; where the system refuses,
  // pageable memory, marked so (Buffer::pageable) and warned about once. Synchronous.
  virtual Buffer allocate_host(std::size_t bytes) = 0;
  // Page-locks `bytes` of host memory allocated elsewhere (EngineOptions::host_memory: the
  // node-shared weights, which the device only reads) while the returned Buffer lives; that
  // Buffer frees nothing else. Empty where the backend does not pin host memory, or where the
  // system refuses (its copies are then staged: slower, still right). Synchronous.
  virtual Buffer pin_host(std::byte* /*data*/, std::size_t /*bytes*/) { return {}; }
  // Device memory. Synchronous. Throws OutOfMemory naming the sizes when it does not fit.
  virtual Buffer allocate_device(std::size_t bytes) = 0;
  // Enqueues a host-to-device copy on the copy stream; returns at once. `tag` is reported to
  // the copy observer.
  virtual void copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                              int64_t tag) = 0;
  // Enqueues a device-to-host copy on the copy stream; returns at once.
  virtual void copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                            int64_t tag) = 0;
  // Calls `observer` after each copy completes, on whichever thread sees it complete. A backend
  // that cannot time its copies never calls it.
  virtual void set_copy_observer(CopyObserver observer) = 0;
  // Enqueues on the decode stream the decode of the compressed block (core/codec.hpp) of `bytes`
  // bytes at `compressed` (device memory, copied there before on the copy stream: the caller
  // orders the decode after that copy with an event) into `out` (device memory of
  // parsed.decoded_bytes); `parsed` is codec::parse of the same bytes on the host. Returns at
  // once. A damaged block fails as a failed copy does: its Error is rethrown where the host next
  // waits for an event recorded on the decode stream after it, and `out` holds garbage or NaN
  // (Note [a decode step] in load_pipeline.cpp). Default: throws Error (the backend cannot
  // decode).
  virtual void decode(std::byte* out, const std::byte* compressed, std::size_t bytes,
                      const codec::Parsed& parsed, int64_t tag);
  // Whether decode works here (the CUDA backend: where nvcc built the decoder).
  virtual bool can_decode() const { return false; }
  // Whether host and device memory hold bytes (the timed device's hold none: it models time).
  virtual bool holds_data() const { return true; }
  // Enqueues filling released device memory with NaN on the copy stream, so that a read of a
  // released slot shows; returns at once. A backend may do nothing.
  virtual void poison(std::byte* device, std::size_t bytes) = 0;
  // A new event, not yet recorded (waiting on it returns at once), for ordering only: it
  // cannot be timed, which makes it lighter to record and wait for (CUDA: no timestamp).
  virtual std::unique_ptr<Event> make_event() = 0;
  // A new event that elapsed_seconds can time, where the backend times events; otherwise the
  // same as make_event (the default). A backend that forwards times_events to another forwards
  // this too.
  virtual std::unique_ptr<Event> make_timed_event() { return make_event(); }
  // Records `event` at the current end of `stream`; returns at once. An error of a copy or a
  // decode enqueued before it on that stream is rethrown where the host waits for it.
  virtual void record(Event& event, Stream stream) = 0;
  // Makes later work on `stream` wait for `event`. The host does not wait, except where the
  // host itself is the compute stream (EmulatedDevice). Rethrows a failed copy's error when
  // the host waits. The decode stream, waiting for an event after a failed copy, carries that
  // error on to its next event on the emulated device (a decode never hides a failed copy).
  virtual void wait(Stream stream, const Event& event) = 0;
  // Blocks the host until `event` has completed; rethrows the error of a copy (or decode) that
  // failed before it on its stream.
  virtual void synchronize(const Event& event) = 0;
  // Makes later work on `stream` wait until `until` returns: the stream calls it, on a thread
  // of the backend's, once it gets there, and the host does not wait (the staging ring's copy
  // waits so for its read, Note [the file tier] in load_pipeline.cpp). `until` may block
  // waiting for another host thread, as long as nothing it waits for is behind it on the
  // stream; it must not throw, nor call into the backend. Default: the host calls it now.
  virtual void wait_host(Stream /*stream*/, std::function<void()> until) { until(); }
  // Whether elapsed_seconds can time this backend's events.
  virtual bool times_events() const { return false; }
  // The device time from `start` to `end`, two events made by make_timed_event and recorded on
  // the compute stream, once both have completed; nullopt while they have not, or when the
  // backend cannot time events (the emulated device: its compute stream is the host). Throws
  // Error for an event from make_event where the backend times events. The engine measures
  // stalls with it.
  virtual std::optional<double> elapsed_seconds(const Event& /*start*/,
                                                const Event& /*end*/) const {
    return std::nullopt;
  }
  virtual MemoryStats memory() const = 0;
  // The reader of the load pipeline's staging ring (core/staging_ring.hpp): a StagingRing over
  // the file and pageable memory (FileReader, defined in file_source.cpp); the timed device
  // models a disk instead.
  virtual std::unique_ptr<StagingReader> make_staging_reader(StagingSpec spec);
};

} // namespace blockswap
