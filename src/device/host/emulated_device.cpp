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

struct EmulatedDevice::State {
  EmulatedDeviceOptions options;

  mutable std::mutex mutex;
  std::condition_variable changed; // queue grew, a mark completed, or stopping
  std::deque<Task> queue;
  bool stopping = false;
  std::exception_ptr pending_error; // a failed copy, waiting for the next record
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

  std::thread thread;

  void enqueue(Task task) {
    {
      std::lock_guard lock(mutex);
      if (task.kind == Task::Kind::copy && copies_until_failure-- == 0) {
        task.fail = true;
        task.fail_after = failure_copies_bytes;
      }
      if (task.kind == Task::Kind::copy && copies_until_throw-- == 0) task.throws = true;
      queue.push_back(std::move(task));
    }
    changed.notify_all();
  }

  void run() {
    std::unique_lock lock(mutex);
    for (;;) {
      changed.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return; // stopping, and everything enqueued is done
      Task task = std::move(queue.front());
      queue.pop_front();
      try {
        execute(task, lock);
      } catch (...) {
        // Whatever a task throws goes to the next waiter, as a failed copy does; the copy
        // stream carries on.
        if (!lock.owns_lock()) lock.lock();
        pending_error = std::current_exception();
      }
    }
  }

  // Runs one task; `lock` is held on entry and on a normal return.
  void execute(Task& task, std::unique_lock<std::mutex>& lock) {
    switch (task.kind) {
    case Task::Kind::wait:
      changed.wait(lock, [&] { return task.mark->done; });
      break;
    case Task::Kind::record:
      task.mark->error = std::exchange(pending_error, nullptr);
      task.mark->done = true;
      changed.notify_all();
      break;
    case Task::Kind::host:
      lock.unlock();
      task.until();
      lock.lock();
      break;
    case Task::Kind::decode:
      lock.unlock(); // a damaged block throws: run() makes it the next waiter's error
      codec::decode(std::span<const std::byte>(task.src, task.bytes),
                    std::span<std::byte>(task.dst, task.decoded));
      lock.lock();
      break;
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
        pending_error = std::make_exception_ptr(Error(
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
  state_->options = options;
  state_->account.capacity = options.capacity_bytes;
  state_->thread = std::thread([state = state_.get()] { state->run(); });
}

EmulatedDevice::~EmulatedDevice() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->changed.notify_all();
  state_->thread.join();
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
  state_->enqueue(std::move(task));
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
  state_->enqueue(Task{Task::Kind::record, nullptr, nullptr, 0, emulated->mark, false});
}

void EmulatedDevice::wait(Stream stream, const Event& event) {
  if (stream == Stream::compute) {
    synchronize(event);
    return;
  }
  const auto* emulated = dynamic_cast<const EmulatedEvent*>(&event);
  BLOCKSWAP_CHECK(emulated != nullptr, "emulated device: the event was not made by this backend");
  state_->enqueue(Task{Task::Kind::wait, nullptr, nullptr, 0, emulated->mark, false});
}

void EmulatedDevice::wait_host(Stream stream, std::function<void()> until) {
  if (stream == Stream::compute) { // the host is the compute stream
    until();
    return;
  }
  Task task;
  task.kind = Task::Kind::host;
  task.until = std::move(until);
  state_->enqueue(std::move(task));
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
