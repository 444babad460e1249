#include "blockswap/device/emulated.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "blockswap/core/codec.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/log.hpp"
#include "device_account.hpp"

namespace blockswap {
namespace {

using Clock = std::chrono::steady_clock;
using layout::kAlignment; // as cudaMalloc: every tensor dtype is aligned

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

void poison_bytes(std::byte* data, std::size_t bytes) {
  // 0xFF in every byte is a NaN in float32, float16 and bfloat16 alike.
  std::memset(data, 0xFF, bytes);
}

} // namespace

// Note [the emulated decode stream]
// The copy stream and the decode stream are a thread each, with a queue of its own, so that a
// load's decode runs beside the next load's copy as on a GPU, and a missing wait between them
// shows (EmulatedDeviceOptions::decode_gbps makes the decode slow enough to see). A failed
// task's error waits for the next record on its own stream. A wait of the decode stream for an
// event that carries an error takes that error on: the decode of bytes whose copy failed fails
// too, and the decode is skipped (its output keeps what it had: the load's event raises).
struct EmulatedDevice::State {
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

  void run(int on) {
    Lane& lane = lanes[on];
    std::unique_lock lock(mutex);
    for (;;) {
      changed.wait(lock, [&] { return stopping || !lane.queue.empty(); });
      if (lane.queue.empty()) return; // stopping, and everything enqueued is done
      Task task = std::move(lane.queue.front());
      lane.queue.pop_front();
      try {
        execute(task, lane, lock);
      } catch (...) {
        // Whatever a task throws goes to the next waiter, as a failed copy does; the stream
        // carries on.
        if (!lock.owns_lock()) lock.lock();
        lane.pending_error = std::current_exception();
      }
    }
  }

  // Runs one task; `lock` is held on entry and on a normal return.
  void execute(Task& task, Lane& lane, std::unique_lock<std::mutex>& lock) {
    switch (task.kind) {
    case Task::Kind::wait:
      changed.wait(lock, [&] { return task.mark->done; });
      // Note [the emulated decode stream]: a decode after a failed copy fails.
      if (&lane == &lanes[kDecode] && task.mark->error && !lane.pending_error) {
        lane.pending_error = task.mark->error;
      }
      break;
    case Task::Kind::record:
      task.mark->error = std::exchange(lane.pending_error, nullptr);
      task.mark->done = true;
      changed.notify_all();
      break;
    case Task::Kind::host:
      lock.unlock();
      task.until();
      lock.lock();
      break;
    case Task::Kind::decode: {
      if (lane.pending_error) break; // its bytes' copy failed
      lock.unlock(); // a damaged block throws: run() makes it the next waiter's error
      if (options.decode_gbps > 0) { // slow: the slot keeps its old bytes meanwhile
        std::this_thread::sleep_for(
            std::chrono::duration<double>(task.decoded / (options.decode_gbps * 1e9)));
      }
      codec::decode(std::span<const std::byte>(task.src, task.bytes),
                    std::span<std::byte>(task.dst, task.decoded));
      lock.lock();
      break;
    }
    case Task::Kind::poison:
      lock.unlock();
      poison_bytes(task.dst, task.bytes);
      lock.lock();
      break;
    case Task::Kind::copy: {
      if (task.fail) {
        lock.unlock();
        std::memcpy(task.dst, task.src, std::min(task.fail_after, task.bytes));
        lock.lock();
        lane.pending_error = std::make_exception_ptr(Error(
            detail::concat("emulated device: injected failure of a ", task.bytes, "-byte copy")));
        break;
      }
      lock.unlock();
      if (task.throws) throw Error("emulated device: injected exception in the copy thread");
      const auto start = Clock::now();
      copy_paced(task, start);
      const auto end = Clock::now();
      lock.lock();
      copy_seconds += std::chrono::duration<double>(end - start).count();
      if (observer) {
        const CopyObserver notify = observer;
        lock.unlock();
        notify(CopyRecord{task.to_device, task.bytes, task.tag, start, end});
        lock.lock();
      }
      break;
    }
    }
  }

  // Copies at the link's pace, chunk by chunk, so that a reader that does not wait sees a
  // partial copy for the whole duration of the transfer, as on a real link.
  void copy_paced(const Task& task, Clock::time_point start) const {
    if (options.link_gbps <= 0) {
      std::memcpy(task.dst, task.src, task.bytes);
      return;
    }
    constexpr std::size_t kChunk = std::size_t{1} << 20;
    for (std::size_t done = 0; done < task.bytes;) {
      const std::size_t n = std::min(kChunk, task.bytes - done);
      std::memcpy(task.dst + done, task.src + done, n);
      done += n;
      const std::chrono::duration<double> due(done / (options.link_gbps * 1e9));
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(due));
    }
  }

  std::shared_ptr<Mark> wait_mark(const Event& event) {
    const auto* emulated = dynamic_cast<const EmulatedEvent*>(&event);
    BLOCKSWAP_CHECK(emulated != nullptr, "emulated device: the event was not made by this backend");
    std::shared_ptr<Mark> mark = emulated->mark;
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return mark->done; });
    return mark;
  }
};

EmulatedDevice::EmulatedDevice(EmulatedDeviceOptions options) : state_(std::make_shared<State>()) {
  BLOCKSWAP_CHECK(options.link_gbps >= 0, "emulated device: link_gbps must be >= 0, got ",
                  options.link_gbps);
  BLOCKSWAP_CHECK(options.decode_gbps >= 0, "emulated device: decode_gbps must be >= 0, got ",
                  options.decode_gbps);
  state_->options = options;
  state_->account.capacity = options.capacity_bytes;
  for (int on : {State::kCopy, State::kDecode}) {
    state_->lanes[on].thread = std::thread([state = state_.get(), on] { state->run(on); });
  }
}

EmulatedDevice::~EmulatedDevice() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->changed.notify_all();
  for (State::Lane& lane : state_->lanes) lane.thread.join();
}

std::string EmulatedDevice::name() const {
  return "emulated";
}

Buffer EmulatedDevice::allocate_host(std::size_t bytes) {
  // More than the machine's memory is refused before asking: the sanitizers' allocators abort
  // on such a request where the system's returns null.
  static const std::size_t physical = static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) *
                                      static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  if (bytes > physical) {
    throw Error(detail::concat("cannot allocate ", bytes, " bytes of host memory: the machine has ",
                               physical));
  }
  const std::size_t size = layout::align_up(std::max<std::size_t>(bytes, 1));
  auto* data = static_cast<std::byte*>(std::aligned_alloc(kAlignment, size));
  if (data == nullptr)
    throw Error(detail::concat("cannot allocate ", bytes, " bytes of host memory"));
  std::unique_lock lock(state_->mutex);
  if (state_->options.pinnable_bytes - state_->pinned_bytes >= size) {
    state_->pinned_bytes += size;
    return Buffer(data, bytes, [state = state_, size](std::byte* p, std::size_t) {
      std::free(p);
      std::lock_guard held(state->mutex);
      state->pinned_bytes -= size;
    });
  }
  state_->pageable.emplace(data, size);
  lock.unlock();
  static std::once_flag once; // as the CUDA backend says it
  std::call_once(once, [&] {
    warn("", detail::concat("WARNING: cannot pin ", bytes,
                            " bytes of host memory (emulated device: pinnable_bytes ",
                            state_->options.pinnable_bytes,
                            "); using pageable memory; the engine stages loads from it through "
                            "a few pinned buffers"));
  });
  return Buffer(
      data, bytes,
      [state = state_](std::byte* p, std::size_t) {
        {
          std::lock_guard held(state->mutex);
          state->pageable.erase(p);
        }
        std::free(p);
      },
      Buffer::Pinning::pageable);
}

Buffer EmulatedDevice::allocate_device(std::size_t bytes) {
  const std::size_t size = layout::align_up(std::max<std::size_t>(bytes, 1));
  {
    std::lock_guard lock(state_->mutex);
    state_->account.claim(size, bytes, "emulated device");
  }
  auto* data = static_cast<std::byte*>(std::aligned_alloc(kAlignment, size));
  if (data == nullptr) {
    std::lock_guard lock(state_->mutex);
    state_->account.release(size);
    throw OutOfMemory(detail::concat("emulated device: the host could not provide ", bytes,
                                     " bytes for device memory"));
  }
  poison_bytes(data, size); // fresh device memory holds garbage, as on a GPU
  // The buffer may outlive this object (e.g. a tensor still refers to it): share the state.
  return Buffer(data, bytes, [state = state_, size](std::byte* p, std::size_t) {
    std::free(p);
    std::lock_guard lock(state->mutex);
    state->account.release(size);
  });
}

void EmulatedDevice::copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                                    int64_t tag) {
  state_->enqueue(Task{Task::Kind::copy, device, host, bytes, nullptr, false, true, tag});
  wait_if_pageable(host);
}

void EmulatedDevice::copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                                  int64_t tag) {
  state_->enqueue(Task{Task::Kind::copy, host, device, bytes, nullptr, false, false, tag});
  wait_if_pageable(host);
}

// cudaMemcpyAsync with pageable host memory returns once the copy stream has reached the copy
// and the copy is done (staged, to the device): the host waits.
void EmulatedDevice::wait_if_pageable(const std::byte* host) {
  {
    std::lock_guard lock(state_->mutex);
    if (!state_->is_pageable(host)) return;
    ++state_->pageable_copies;
  }
  auto mark = std::make_shared<Mark>();
  state_->enqueue(Task{Task::Kind::record, nullptr, nullptr, 0, mark, false});
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] { return mark->done; });
  if (mark->error) std::rethrow_exception(mark->error);
}

void EmulatedDevice::decode(std::byte* out, const std::byte* compressed, std::size_t bytes,
                            const codec::Parsed& parsed, int64_t tag) {
  Task task;
  task.kind = Task::Kind::decode;
  task.dst = out;
  task.src = compressed;
  task.bytes = bytes;
  task.tag = tag;
  task.decoded = parsed.decoded_bytes;
  state_->enqueue(std::move(task), State::kDecode);
}

bool EmulatedDevice::can_decode() const {
  return true;
}

void EmulatedDevice::set_copy_observer(CopyObserver observer) {
  std::lock_guard lock(state_->mutex);
  state_->observer = std::move(observer);
}

void EmulatedDevice::poison(std::byte* device, std::size_t bytes) {
  if (bytes > 0) state_->enqueue(Task{Task::Kind::poison, device, nullptr, bytes, nullptr, false});
}

std::unique_ptr<Event> EmulatedDevice::make_event() {
  return std::make_unique<EmulatedEvent>();
}

void EmulatedDevice::record(Event& event, Stream stream) {
  auto* emulated = dynamic_cast<EmulatedEvent*>(&event);
  BLOCKSWAP_CHECK(emulated != nullptr, "emulated device: the event was not made by this backend");
  if (stream == Stream::compute) {
    // The host is the compute stream: everything enqueued on it has already run.
    emulated->mark = std::make_shared<Mark>(Mark{true, nullptr});
    return;
  }
  emulated->mark = std::make_shared<Mark>();
  state_->enqueue(Task{Task::Kind::record, nullptr, nullptr, 0, emulated->mark, false},
                  State::lane(stream));
}

void EmulatedDevice::wait(Stream stream, const Event& event) {
  if (stream == Stream::compute) {
    synchronize(event);
    return;
  }
  const auto* emulated = dynamic_cast<const EmulatedEvent*>(&event);
  BLOCKSWAP_CHECK(emulated != nullptr, "emulated device: the event was not made by this backend");
  state_->enqueue(Task{Task::Kind::wait, nullptr, nullptr, 0, emulated->mark, false},
                  State::lane(stream));
}

void EmulatedDevice::wait_host(Stream stream, std::function<void()> until) {
  if (stream == Stream::compute) { // the host is the compute stream
    until();
    return;
  }
  Task task;
  task.kind = Task::Kind::host;
  task.until = std::move(until);
  state_->enqueue(std::move(task), State::lane(stream));
}

void EmulatedDevice::synchronize(const Event& event) {
  const std::shared_ptr<Mark> mark = state_->wait_mark(event);
  if (mark->error) std::rethrow_exception(mark->error);
}

MemoryStats EmulatedDevice::memory() const {
  std::lock_guard lock(state_->mutex);
  return MemoryStats{state_->account.held, state_->account.peak, state_->options.capacity_bytes,
                     false};
}

void EmulatedDevice::throw_in_copy_thread(std::size_t nth) {
  std::lock_guard lock(state_->mutex);
  state_->copies_until_throw = nth;
}

void EmulatedDevice::fail_copy(std::size_t nth, std::size_t bytes_first) {
  std::lock_guard lock(state_->mutex);
  state_->copies_until_failure = nth;
  state_->failure_copies_bytes = bytes_first;
}

std::size_t EmulatedDevice::pageable_copies() const {
  std::lock_guard lock(state_->mutex);
  return state_->pageable_copies;
}

double EmulatedDevice::copy_seconds() const {
  std::lock_guard lock(state_->mutex);
  return state_->copy_seconds;
}

} // namespace blockswap
