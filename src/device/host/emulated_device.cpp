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
#include "emulated_streams.hpp"

namespace blockswap {
namespace {

using emulated::EmulatedEvent;
using emulated::Mark;
using emulated::poison_bytes;
using emulated::Task;
using layout::kAlignment; // as cudaMalloc: every tensor dtype is aligned

} // namespace

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
