// The emulated device's copy and decode streams (emulated_streams.hpp): a thread each, running
// its tasks in order.
#include "emulated_streams.hpp"

#include <algorithm>
#include <cstring>
#include <span>

#include "blockswap/core/codec.hpp"

namespace blockswap {
namespace emulated {

void poison_bytes(std::byte* data, std::size_t bytes) {
  std::memset(data, 0xFF, bytes);
}

} // namespace emulated

using emulated::poison_bytes;

// Note [the emulated decode stream]
// The copy stream and the decode stream are a thread each, with a queue of its own, so that a
// load's decode runs beside the next load's copy as on a GPU, and a missing wait between them
// shows (EmulatedDeviceOptions::decode_gbps makes the decode slow enough to see). A failed
// task's error waits for the next record on its own stream. A wait of the decode stream for an
// event that carries an error takes that error on: the decode of bytes whose copy failed fails
// too, and the decode is skipped (its output keeps what it had: the load's event raises).
void EmulatedDevice::State::run(int on) {
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

void EmulatedDevice::State::execute(Task& task, Lane& lane, std::unique_lock<std::mutex>& lock) {
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
    lock.unlock();                 // a damaged block throws: run() makes it the next waiter's error
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

void EmulatedDevice::State::copy_paced(const Task& task, Clock::time_point start) const {
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

} // namespace blockswap
