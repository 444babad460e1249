#include "blockswap/device/timed.hpp"

#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "device_account.hpp"

namespace blockswap {
namespace {

using Clock = std::chrono::steady_clock;

// One recording of an event: done once its stream reaches it, at device time `time`.
struct Mark {
  bool done = false;
  double time = 0;
};

class TimedEvent final : public Event {
public:
  TimedEvent(uint64_t maker, bool timed) : device(maker), timing(timed) {}
  uint64_t device; // the id of the TimedDevice that made it
  bool timing;     // made by make_timed_event: elapsed_seconds may time it
  std::shared_ptr<Mark> mark = std::make_shared<Mark>(Mark{true, 0});
};

struct Task {
  enum class Kind { busy, wait, record };
  Kind kind = Kind::busy;
  double enqueued = 0; // the host's clock when it was enqueued: it cannot start earlier
  double seconds = 0;  // busy
  int64_t tag = -1;
  bool copy = false; // busy: a copy (else a computation)
  bool to_device = true;
  bool activations = false; // a copy of offloaded activations: not the engine's, not observed
  bool decode = false;      // a decode (Backend::decode): not the link
  std::size_t bytes = 0;
  std::shared_ptr<Mark> mark; // wait, record
};

const TimedEvent& timed(const Event& event, uint64_t device) {
  const auto* e = dynamic_cast<const TimedEvent*>(&event);
  BLOCKSWAP_CHECK(e != nullptr && e->device == device,
                  "timed device: the event was not made by this backend");
  return *e;
}

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

std::atomic<uint64_t> next_id{0}; // TimedDevice ids, for the host clock's thread-local record

// Address space that holds no data: any access faults.
Buffer reserve(std::size_t bytes) {
  const std::size_t size = layout::align_up(std::max<std::size_t>(bytes, 1));
  void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    throw OutOfMemory(
        detail::concat("timed device: cannot reserve ", bytes, " bytes of address space"));
  }
  return Buffer(static_cast<std::byte*>(p), bytes,
                [size](std::byte* data, std::size_t) { munmap(data, size); });
}

} // namespace

// Note [device time]
// Each stream (compute, copy, the activations' channel out, decode) runs its tasks in order on its
// own thread and keeps its own clock, `free`: the device time at which it finished its last task. A
// task starts at max(free, enqueued): no earlier than the host enqueued it. A wait moves the clock
// to the awaited mark's time; a record stamps its mark with the clock. The threads are woken only
// by a wait (the host's, or a stream's for the other's mark) and at destruction, not by each
// enqueue. The host's clock advances by the CPU time the host thread spends between its calls into
// the device (the engine's own work counts; time the thread is not running, preempted by other
// processes, does not), and jumps to a mark's time when the host waits for it (the threads' own
// wake-ups do not count either). Everything is under one mutex; the threads only sleep on condition
// variables: their own queue's, and the one for completed marks.
struct TimedDevice::State {
  struct StreamState {
    std::deque<Task> queue;
    double free = 0;
    std::condition_variable work; // the queue grew, or stopping
    std::thread thread;
  };

  TimedDeviceOptions options;
  mutable std::mutex mutex;
  std::condition_variable marked; // a mark completed
  bool stopping = false;
  // compute, copy, the device->host channel of offloaded activations (copy_out_after_compute),
  // and decode (Backend::decode; the copy stream's when !LinkModel::decode_stream)
  StreamState streams[4];
  static constexpr int kActivationsOut = 2, kDecode = 3;
  const uint64_t id = next_id.fetch_add(1) + 1;
  double host_time = 0; // the host's clock (Note [device time])
  Clock::time_point epoch = Clock::now();
  std::vector<ComputeRecord> log;
  double link_busy = 0;
  CopyObserver observer;
  host::DeviceAccount account; // capacity set by the constructor

  int index(Stream stream) const {
    if (stream == Stream::decode) return options.link.decode_stream ? kDecode : 1;
    return stream == Stream::compute ? 0 : 1;
  }

  // The host's clock now: it advances by the CPU time the calling thread has spent since its
  // last call into this device (the first call from a thread adds nothing).
  double host_now_locked() {
    thread_local uint64_t last_device = 0; // by id: a new device may reuse an old one's address
    thread_local double last_cpu = 0;
    const double cpu = thread_cpu_seconds();
    if (last_device == id) host_time += std::max(0.0, cpu - last_cpu);
    last_device = id;
    last_cpu = cpu;
    return host_time;
  }

  // The host waited until device time `time` (or not at all, when it is past).
  void host_resumes_locked(double time) { host_time = std::max(host_now_locked(), time); }

  void enqueue(Stream stream, Task task) { enqueue_on(index(stream), std::move(task)); }

  void enqueue_on(int s, Task task) {
    {
      std::lock_guard lock(mutex);
      task.enqueued = host_now_locked();
      streams[s].queue.push_back(std::move(task));
    }
    // No wake-up here: the streams run when someone waits (wake_streams), so the host pays a
    // lock per call, not a thread wake-up; in device time nothing changes.
  }

  // Called by whoever is about to wait for a mark: the streams run what they have.
  void wake_streams() {
    for (StreamState& stream : streams) stream.work.notify_one();
  }

  // A copy: the copy stream busy for the link's time for `bytes`.
  void enqueue_copy(std::size_t bytes, int64_t tag, bool to_device) {
    Task task;
    task.kind = Task::Kind::busy;
    task.seconds = options.link.seconds(bytes);
    task.tag = tag;
    task.copy = true;
    task.to_device = to_device;
    task.bytes = bytes;
    enqueue(Stream::copy, std::move(task));
  }

  void run(int s) {
    StreamState& stream = streams[s];
    std::unique_lock lock(mutex);
    for (;;) {
      stream.work.wait(lock, [&] { return stopping || !stream.queue.empty(); });
      if (stream.queue.empty()) return; // stopping, and everything enqueued is done
      Task& task = stream.queue.front();
      if (task.kind == Task::Kind::wait) {
        const std::shared_ptr<Mark> mark = task.mark;
        if (!mark->done) wake_streams(); // the other stream completes it
        marked.wait(lock, [&] { return mark->done; });
      }
      Task done = std::move(stream.queue.front());
      stream.queue.pop_front();
      execute(stream, done, lock);
      if (done.kind == Task::Kind::record) marked.notify_all();
    }
  }

  void execute(StreamState& stream, Task& task, std::unique_lock<std::mutex>& lock) {
    const double start = std::max(stream.free, task.enqueued);
    switch (task.kind) {
    case Task::Kind::wait:
      stream.free = std::max(start, task.mark->time);
      break;
    case Task::Kind::record:
      stream.free = start;
      task.mark->time = start;
      task.mark->done = true;
      break;
    case Task::Kind::busy:
      stream.free = start + task.seconds;
      if (!task.copy) {
        // The idle time before a computation: since the previous task on this stream ended.
        log.push_back(ComputeRecord{task.tag, start, stream.free, start - last_compute_end});
        last_compute_end = stream.free;
        break;
      }
      if (task.decode) {
        decode_busy += task.seconds;
        break;
      }
      (&stream == &streams[kActivationsOut] ? activations_out_busy : link_busy) += task.seconds;
      if (observer && !task.activations) {
        const CopyObserver notify = observer;
        const CopyRecord record{task.to_device, task.bytes, task.tag, at(start), at(stream.free)};
        lock.unlock();
        notify(record);
        lock.lock();
      }
      break;
    }
  }

  Clock::time_point at(double seconds) const {
    return epoch +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }

  // Blocks until `mark` is done; returns its time.
  double wait_for(const std::shared_ptr<Mark>& mark) {
    std::unique_lock lock(mutex);
    if (!mark->done) wake_streams();
    marked.wait(lock, [&] { return mark->done; });
    host_resumes_locked(mark->time);
    return mark->time;
  }

  double last_compute_end = 0;
  double activations_out_busy = 0;
  double decode_busy = 0; // the decodes (Backend::decode), on whichever stream runs them
  double disk_busy = 0;
  double disk_free = 0; // one disk for every engine's reader
};

namespace {

// The modelled disk (timed.hpp), one per device: every engine's reader reads from it. A read is
// computed when take() or cancel() needs it, in the order asked: it starts at the latest of its
// request, the end of the disk's read before it and the moment its staging buffer is free (the
// copy out of that buffer's last block ended, which this thread waits for the copy stream to
// reach: it is ahead of the waits copy_after enqueues). Buffers go to reads in the order they
// are released, as FileReader gives them.
class TimedReader final : public StagingReader {
public:
  TimedReader(std::shared_ptr<TimedDevice::State> state, StagingSpec spec, uint64_t device)
      : state_(std::move(state)), blocks_(std::move(spec.blocks)), label_(std::move(spec.label)),
        device_(device) {
    BLOCKSWAP_CHECK(state_->options.link.disk_bytes_per_second > 0, "[", label_,
                    "] timed device: the file tier needs the disk's bandwidth "
                    "(LinkModel::disk_bytes_per_second)");
    for (auto& buffer : spec.staging) free_.push_back(Slot{std::move(buffer), nullptr, 0});
    BLOCKSWAP_CHECK(!free_.empty(), "[", label_, "] the file tier needs a staging buffer");
  }

  void request(int64_t block) override {
    BLOCKSWAP_CHECK(block >= 0 && block < static_cast<int64_t>(blocks_.size()), "[", label_,
                    "] block index ", block, " is out of range");
    std::lock_guard lock(state_->mutex);
    requests_.push_back(Request{block, state_->host_now_locked()});
  }

  Staged take() override {
    BLOCKSWAP_CHECK(!requests_.empty(), "[", label_, "] take() with no block requested");
    BLOCKSWAP_CHECK(!free_.empty(), "[", label_,
                    "] every staging buffer is held: release() blocks before taking more");
    const Request request = requests_.front();
    requests_.pop_front();
    Slot slot = std::move(free_.front());
    free_.pop_front();
    const double end = read(request, slot);
    return Staged{request.block, slot.buffer, std::make_shared<double>(end)};
  }

  void copy_after(const Staged& staged) override {
    Task task;
    task.kind = Task::Kind::wait;
    task.mark = std::make_shared<Mark>(Mark{true, end_of(staged)});
    state_->enqueue(Stream::copy, std::move(task));
  }

  void wait(const Staged& staged) override {
    std::lock_guard lock(state_->mutex);
    state_->host_resumes_locked(end_of(staged)); // the host waited for the read
  }

  void release(const Staged& staged, std::shared_ptr<const Event> copied) override {
    if (!staged.buffer) return;
    free_.push_back(
        Slot{staged.buffer, copied ? timed(*copied, device_).mark : nullptr, end_of(staged)});
  }

  // The reads already under way when the host cancels them finish (the disk is busy for them);
  // the others never start.
  void cancel() override {
    double now = 0;
    {
      std::lock_guard lock(state_->mutex);
      now = state_->host_now_locked();
    }
    std::deque<Slot> used;
    for (const Request& request : requests_) {
      if (free_.empty() || start_of(request, free_.front()) > now) break;
      used.push_back(std::move(free_.front()));
      free_.pop_front();
      used.back().free_at = read(request, used.back());
    }
    free_.insert(free_.begin(), std::make_move_iterator(used.begin()),
                 std::make_move_iterator(used.end()));
    requests_.clear();
  }

  // The modelled read takes the new size: a compressed block's read is its compressed bytes'.
  void repoint(int64_t block, const std::byte* memory, std::size_t bytes) override {
    BLOCKSWAP_CHECK(block >= 0 && block < static_cast<int64_t>(blocks_.size()) &&
                        blocks_[block].memory != nullptr,
                    "[", label_, "] block ", block,
                    " is not read from host memory: only such a block can be given a new place "
                    "to read from");
    for (const Request& request : requests_) {
      BLOCKSWAP_CHECK(request.block != block, "[", label_, "] block ", block,
                      " is given a new place while a read of it is requested: cancel() first");
    }
    blocks_[block].memory = memory;
    blocks_[block].bytes = bytes;
  }

  uint64_t bytes_read() const override { return bytes_read_; }

private:
  struct Slot {
    std::shared_ptr<Buffer> buffer;
    std::shared_ptr<Mark> copied; // the copy out of it (null: free at free_at)
    double free_at = 0;
  };
  struct Request {
    int64_t block;
    double requested;
  };

  static double end_of(const Staged& staged) {
    return *static_cast<const double*>(staged.read.get());
  }

  // When `slot` is free: the copy out of it ended (waiting for the copy stream to get there).
  double free_time(Slot& slot) {
    if (slot.copied) {
      std::unique_lock lock(state_->mutex);
      if (!slot.copied->done) state_->wake_streams();
      state_->marked.wait(lock, [&] { return slot.copied->done; });
      slot.free_at = std::max(slot.free_at, slot.copied->time);
      slot.copied = nullptr;
    }
    return slot.free_at;
  }

  double start_of(const Request& request, Slot& slot) {
    const double buffer_free = free_time(slot);
    std::lock_guard lock(state_->mutex);
    return std::max({state_->disk_free, request.requested, buffer_free});
  }

  // Reads `request` into `slot`; returns when the read ends.
  double read(const Request& request, Slot& slot) {
    const double start = start_of(request, slot);
    const std::size_t bytes = blocks_[request.block].bytes;
    const double seconds = state_->options.link.disk_seconds(bytes);
    bytes_read_ += bytes;
    std::lock_guard lock(state_->mutex);
    state_->disk_free = start + seconds;
    state_->disk_busy += seconds;
    return start + seconds;
  }

  std::shared_ptr<TimedDevice::State> state_;
  std::vector<FileBlock> blocks_;
  std::string label_;
  uint64_t device_;
  std::deque<Slot> free_; // in the order they are given out
  std::deque<Request> requests_;
  uint64_t bytes_read_ = 0;
};

} // namespace

TimedDevice::TimedDevice(TimedDeviceOptions options) : state_(std::make_shared<State>()) {
  BLOCKSWAP_CHECK(std::isfinite(options.link.bytes_per_second) &&
                      std::isfinite(options.link.latency_seconds) &&
                      options.link.bytes_per_second > 0 && options.link.latency_seconds >= 0,
                  "timed device: the link needs bytes_per_second > 0 and latency_seconds >= 0, "
                  "got ",
                  options.link.bytes_per_second, " and ", options.link.latency_seconds);
  BLOCKSWAP_CHECK(std::isfinite(options.link.decode_bytes_per_second) &&
                      options.link.decode_bytes_per_second >= 0,
                  "timed device: decode_bytes_per_second must be >= 0 (0: decoding takes no "
                  "time), got ",
                  options.link.decode_bytes_per_second);
  state_->options = options;
  state_->account.capacity = options.capacity_bytes;
  for (int s = 0; s < 4; ++s) {
    state_->streams[s].thread = std::thread([state = state_.get(), s] { state->run(s); });
  }
}

TimedDevice::~TimedDevice() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  for (auto& stream : state_->streams) stream.work.notify_all();
  for (auto& stream : state_->streams) stream.thread.join();
}

std::string TimedDevice::name() const {
  return "timed";
}

Buffer TimedDevice::allocate_host(std::size_t bytes) {
  return reserve(bytes);
}

Buffer TimedDevice::allocate_device(std::size_t bytes) {
  const std::size_t size = layout::align_up(std::max<std::size_t>(bytes, 1));
  {
    std::lock_guard lock(state_->mutex);
    state_->account.claim(size, bytes, "timed device");
  }
  Buffer memory = reserve(bytes);
  std::byte* data = memory.data();
  return Buffer(data, bytes,
                [memory = std::make_shared<Buffer>(std::move(memory)), state = state_,
                 size](std::byte*, std::size_t) {
                  memory->reset();
                  std::lock_guard lock(state->mutex);
                  state->account.release(size);
                });
}

void TimedDevice::copy_to_device(std::byte*, const std::byte*, std::size_t bytes, int64_t tag) {
  state_->enqueue_copy(bytes, tag, true);
}

void TimedDevice::copy_to_host(std::byte*, const std::byte*, std::size_t bytes, int64_t tag) {
  state_->enqueue_copy(bytes, tag, false);
}

void TimedDevice::decode(std::byte*, const std::byte*, std::size_t, const codec::Parsed& parsed,
                         int64_t tag) {
  const double seconds = state_->options.link.decode_seconds(parsed.decoded_bytes);
  if (seconds <= 0) return;
  Task task;
  task.kind = Task::Kind::busy;
  task.seconds = seconds;
  task.tag = tag;
  task.copy = true;
  task.decode = true;
  state_->enqueue(Stream::decode, std::move(task));
}

bool TimedDevice::can_decode() const {
  return true;
}

void TimedDevice::compute(double seconds, int64_t tag) {
  BLOCKSWAP_CHECK(std::isfinite(seconds) && seconds >= 0,
                  "timed device: a computation cannot take ", seconds, " seconds");
  Task task;
  task.kind = Task::Kind::busy;
  task.seconds = seconds;
  task.tag = tag;
  state_->enqueue(Stream::compute, std::move(task));
}

void TimedDevice::set_copy_observer(CopyObserver observer) {
  std::lock_guard lock(state_->mutex);
  state_->observer = std::move(observer);
}

void TimedDevice::poison(std::byte*, std::size_t) {}

std::unique_ptr<Event> TimedDevice::make_event() {
  return std::make_unique<TimedEvent>(state_->id, false);
}

std::unique_ptr<Event> TimedDevice::make_timed_event() {
  return std::make_unique<TimedEvent>(state_->id, true);
}

void TimedDevice::record(Event& event, Stream stream) {
  auto& e = const_cast<TimedEvent&>(timed(event, state_->id));
  e.mark = std::make_shared<Mark>();
  Task task;
  task.kind = Task::Kind::record;
  task.mark = e.mark;
  state_->enqueue(stream, std::move(task));
}

void TimedDevice::wait(Stream stream, const Event& event) {
  Task task;
  task.kind = Task::Kind::wait;
  task.mark = timed(event, state_->id).mark;
  state_->enqueue(stream, std::move(task));
}

void TimedDevice::synchronize(const Event& event) {
  state_->wait_for(timed(event, state_->id).mark);
}

// Untimed events are refused as CUDA refuses them (cudaEventDisableTiming), so that a caller
// that forgets make_timed_event fails here, on the CPU, and not first on a GPU.
std::optional<double> TimedDevice::elapsed_seconds(const Event& start, const Event& end) const {
  const TimedEvent &first = timed(start, state_->id), &last = timed(end, state_->id);
  BLOCKSWAP_CHECK(first.timing && last.timing,
                  "timed device: elapsed_seconds needs events from make_timed_event; make_event's "
                  "cannot be timed");
  const std::shared_ptr<Mark> a = first.mark, b = last.mark;
  std::lock_guard lock(state_->mutex);
  if (!a->done || !b->done) {
    state_->wake_streams(); // so that a later call finds them done
    return std::nullopt;
  }
  return b->time - a->time;
}

MemoryStats TimedDevice::memory() const {
  std::lock_guard lock(state_->mutex);
  return MemoryStats{state_->account.held, state_->account.peak, state_->options.capacity_bytes,
                     false};
}

double TimedDevice::now() const {
  std::lock_guard lock(state_->mutex);
  return state_->host_now_locked();
}

double TimedDevice::finish() {
  double end = 0;
  for (int s = 0; s < 4; ++s) {
    Task task;
    task.kind = Task::Kind::record;
    task.mark = std::make_shared<Mark>();
    const std::shared_ptr<Mark> mark = task.mark;
    state_->enqueue_on(s, std::move(task));
    end = std::max(end, state_->wait_for(mark));
  }
  std::lock_guard lock(state_->mutex);
  state_->host_resumes_locked(end);
  return end;
}

// Offloaded activations: the channel out waits for the compute stream's work so far (the block
// that saved them), as the front end's device->host stream waits on an event of the compute
// stream; the copy back waits for the copy out and for the compute stream's work so far (the
// memory it fills was allocated there).
std::unique_ptr<Event> TimedDevice::copy_out_after_compute(std::size_t bytes) {
  auto computed = std::make_unique<TimedEvent>(state_->id, true);
  record(*computed, Stream::compute);
  const int s = state_->options.link.duplex ? State::kActivationsOut : 1;
  Task wait;
  wait.kind = Task::Kind::wait;
  wait.mark = computed->mark;
  state_->enqueue_on(s, std::move(wait));
  Task copy;
  copy.kind = Task::Kind::busy;
  copy.seconds = state_->options.link.seconds(bytes);
  copy.copy = true;
  copy.to_device = false;
  copy.activations = true;
  copy.bytes = bytes;
  state_->enqueue_on(s, std::move(copy));
  auto done = std::make_unique<TimedEvent>(state_->id, true);
  done->mark = std::make_shared<Mark>();
  Task record_done;
  record_done.kind = Task::Kind::record;
  record_done.mark = done->mark;
  state_->enqueue_on(s, std::move(record_done));
  return done;
}

std::unique_ptr<Event> TimedDevice::copy_in_after(std::size_t bytes, const Event& out) {
  TimedEvent computed(state_->id, true);
  record(computed, Stream::compute);
  wait(Stream::copy, computed);
  wait(Stream::copy, out);
  Task copy;
  copy.kind = Task::Kind::busy;
  copy.seconds = state_->options.link.seconds(bytes);
  copy.copy = true;
  copy.activations = true;
  copy.bytes = bytes;
  state_->enqueue(Stream::copy, std::move(copy));
  auto done = make_event();
  record(*done, Stream::copy);
  return done;
}

double TimedDevice::activations_out_busy_seconds() const {
  std::lock_guard lock(state_->mutex);
  return state_->activations_out_busy;
}

std::vector<ComputeRecord> TimedDevice::take_compute_log() {
  std::lock_guard lock(state_->mutex);
  return std::exchange(state_->log, {});
}

std::unique_ptr<StagingReader> TimedDevice::make_staging_reader(StagingSpec spec) {
  return std::make_unique<TimedReader>(state_, std::move(spec), state_->id);
}

double TimedDevice::disk_busy_seconds() const {
  std::lock_guard lock(state_->mutex);
  return state_->disk_busy;
}

double TimedDevice::link_busy_seconds() const {
  std::lock_guard lock(state_->mutex);
  return state_->link_busy;
}

double TimedDevice::decode_busy_seconds() const {
  std::lock_guard lock(state_->mutex);
  return state_->decode_busy;
}

} // namespace blockswap
