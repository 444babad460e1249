// The emulated device's streams (device/emulated.hpp): its state, shared by the Backend methods
// (emulated_device.cpp) and the copy and decode threads that run its tasks in order
// (emulated_streams.cpp). Implementer-only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"
#include "device_account.hpp"

namespace blockswap {
namespace emulated {

// One recording of an event: done once the stream reaches it.
struct Mark {
  bool done = false;
  std::exception_ptr error;
};

class EmulatedEvent final : public Event {
public:
  std::shared_ptr<Mark> mark = std::make_shared<Mark>(Mark{true, nullptr});
};

struct Task {
  enum class Kind { copy, poison, wait, record, host, decode };
  Kind kind = Kind::copy;
  std::byte* dst = nullptr;
  const std::byte* src = nullptr;
  std::size_t bytes = 0;
  std::shared_ptr<Mark> mark;
  bool fail = false;
  bool to_device = true;
  int64_t tag = -1;
  bool throws = false;
  std::size_t fail_after = 0;            // with `fail`: the bytes copied before the failure
  std::function<void()> until = nullptr; // host: Backend::wait_host's
  std::size_t decoded = 0;               // decode: the bytes it writes at `dst`
};

// 0xFF in every byte: a NaN in float32, float16 and bfloat16 alike.
void poison_bytes(std::byte* data, std::size_t bytes);

} // namespace emulated

// Note [the emulated decode stream] in emulated_streams.cpp.
struct EmulatedDevice::State {
  using Clock = std::chrono::steady_clock;
  using Mark = emulated::Mark;
  using Task = emulated::Task;

  struct Lane {
    std::deque<Task> queue;
    std::exception_ptr pending_error; // a failed task, waiting for the next record
    std::thread thread;
  };
  static constexpr int kCopy = 0, kDecode = 1;
  static int lane(Stream stream) { return stream == Stream::decode ? kDecode : kCopy; }

  EmulatedDeviceOptions options;

  mutable std::mutex mutex;
  std::condition_variable changed; // a queue grew, a mark completed, or stopping
  Lane lanes[2];                   // the copy stream, the decode stream
  bool stopping = false;
  std::size_t copies_until_failure = std::numeric_limits<std::size_t>::max();
  std::size_t failure_copies_bytes = 0; // how much of the failing copy happens first
  std::size_t copies_until_throw = std::numeric_limits<std::size_t>::max();
  double copy_seconds = 0;
  CopyObserver observer;
  std::size_t pinned_bytes = 0;                     // host memory page-locked (emulated)
  std::map<const std::byte*, std::size_t> pageable; // pageable host buffers: start, size
  std::size_t pageable_copies = 0;

  bool is_pageable(const std::byte* host) const { // under `mutex`
    auto it = pageable.upper_bound(host);
    if (it == pageable.begin()) return false;
    --it;
    return host < it->first + it->second;
  }

  host::DeviceAccount account; // capacity set by the constructor

  void enqueue(Task task, int on = kCopy) {
    {
      std::lock_guard lock(mutex);
      if (task.kind == Task::Kind::copy && copies_until_failure-- == 0) {
        task.fail = true;
        task.fail_after = failure_copies_bytes;
      }
      if (task.kind == Task::Kind::copy && copies_until_throw-- == 0) task.throws = true;
      lanes[on].queue.push_back(std::move(task));
    }
    changed.notify_all();
  }

  // A stream's thread: runs its lane's tasks in order until stopping and empty.
  void run(int on);
  // Runs one task; `lock` is held on entry and on a normal return.
  void execute(Task& task, Lane& lane, std::unique_lock<std::mutex>& lock);
  // Copies at the link's pace, chunk by chunk, so that a reader that does not wait sees a
  // partial copy for the whole duration of the transfer, as on a real link.
  void copy_paced(const Task& task, Clock::time_point start) const;

  std::shared_ptr<Mark> wait_mark(const Event& event) {
    const auto* emulated = dynamic_cast<const emulated::EmulatedEvent*>(&event);
    BLOCKSWAP_CHECK(emulated != nullptr, "emulated device: the event was not made by this backend");
    std::shared_ptr<Mark> mark = emulated->mark;
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return mark->done; });
    return mark;
  }
};

} // namespace blockswap
