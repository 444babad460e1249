// The contract of blockswap::Backend (core/backend.hpp), verb by verb, as the engine relies on
// it: the same cases on every backend. Compiled for the CPU (label core) they run on the
// emulated and the timed devices; compiled with BLOCKSWAP_TEST_CUDA (label gpu), on the CUDA
// backend. Where a backend differs by its documentation (the timed device holds no data and
// models time; the emulated device's compute stream is the host; only CUDA pins memory it did
// not allocate) the case asserts that difference.
#include "blockswap/core/backend.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../core/codec_weights.hpp"
#include "blockswap/core/codec.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/file_source.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/simulator.hpp"

#ifdef BLOCKSWAP_TEST_CUDA
#include <cuda_runtime_api.h>

#include "blockswap/device/cuda.hpp"
#else
#include "blockswap/device/emulated.hpp"
#include "blockswap/device/timed.hpp"
#endif

namespace blockswap {
namespace {

using namespace std::chrono_literals;

// A backend under test and what its documentation says of it where backends differ.
struct Subject {
  std::string label; // the test's name
  std::string name;  // Backend::name()
  std::function<std::shared_ptr<Backend>()> make;
  bool holds_data = true;          // false: memory is address space only (the timed device)
  bool times_events = false;       // Backend::times_events
  bool host_is_compute = false;    // the host is the compute stream (the emulated device)
  bool host_functions_now = false; // wait_host is Backend's default: the host calls it now
  bool pins_caller_memory = false; // pin_host page-locks (else it returns an empty Buffer)
  bool pinned_host = false;        // MemoryStats::pinned_host
  std::size_t capacity = 0;        // MemoryStats::device_capacity; 0: the device's own
  std::optional<LinkModel> model;  // the time it models (the timed device): exact times
  // Enqueues `seconds` of computation on the compute stream.
  std::function<void(Backend&, double seconds)> compute;
  // What a computation enqueued now on the compute stream reads from device memory.
  std::function<void(std::byte* host, const std::byte* device, std::size_t bytes)> read_on_compute;
  std::function<double(Backend&)> host_clock;                  // the timed device's host clock
  std::function<std::optional<bool>(const void*)> page_locked; // CUDA: the driver's word

  // Whether wait_host's function runs on the calling thread before wait_host returns.
  bool runs_now(Stream stream) const {
    return host_functions_now || (stream == Stream::compute && host_is_compute);
  }
};

void PrintTo(const Subject& subject, std::ostream* out) {
  *out << subject.label;
}

std::vector<std::byte> pattern(std::size_t bytes, uint32_t seed) {
  std::vector<std::byte> out(bytes);
  uint32_t x = seed * 2654435761u + 1;
  for (std::byte& b : out) {
    x = x * 1664525u + 1013904223u;
    b = std::byte(x >> 24);
  }
  return out;
}

bool same(const std::byte* got, const std::vector<std::byte>& want) {
  return std::memcmp(got, want.data(), want.size()) == 0;
}

// Whether the process may read `p`: the kernel copies it into a pipe, or says EFAULT.
bool readable(const std::byte* p) {
  int fds[2];
  if (::pipe(fds) != 0) return true;
  const bool ok = ::write(fds[1], p, 1) == 1;
  ::close(fds[0]);
  ::close(fds[1]);
  return ok;
}

bool aligned(const std::byte* p) {
  return reinterpret_cast<uintptr_t>(p) % layout::kAlignment == 0;
}

struct ForeignEvent final : Event {};

// Holds `stream` at a Backend::wait_host until open(): the stream's later work waits. On a
// stream whose host functions the host calls at once (Subject::runs_now) it is open from the
// start. `then` runs as the stream passes, before passed() says so. So that a backend that waits
// wrongly fails the case instead of hanging it, the hold gives up after 20 s (timed_out()); the
// destructor opens it and waits for the stream to pass.
class Gate {
public:
  Gate(Backend& backend, Stream stream, bool runs_now, std::function<void()> then = {}) {
    if (runs_now) open();
    backend.wait_host(stream, [state = state_, then = std::move(then)] {
      std::unique_lock lock(state->mutex);
      state->timed_out = !state->changed.wait_for(lock, 20s, [&] { return state->open; });
      state->thread = std::this_thread::get_id();
      lock.unlock();
      if (then) then();
      lock.lock();
      state->passed = true;
      state->changed.notify_all();
    });
  }
  ~Gate() {
    open();
    if (opener_.joinable()) opener_.join();
    std::unique_lock lock(state_->mutex);
    state_->changed.wait_for(lock, 20s, [&] { return state_->passed; });
  }
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  void open() {
    std::lock_guard lock(state_->mutex);
    state_->open = true;
    state_->changed.notify_all();
  }
  // Opens it from another thread after `delay` (for a caller about to block on it).
  void open_after(std::chrono::milliseconds delay) {
    opener_ = std::thread([this, delay] {
      std::this_thread::sleep_for(delay);
      open();
    });
  }
  bool passed() const {
    std::lock_guard lock(state_->mutex);
    return state_->passed;
  }
  bool timed_out() const {
    std::lock_guard lock(state_->mutex);
    return state_->timed_out;
  }
  std::thread::id thread() const {
    std::lock_guard lock(state_->mutex);
    return state_->thread;
  }

private:
  struct State {
    mutable std::mutex mutex;
    std::condition_variable changed;
    bool open = false, passed = false, timed_out = false;
    std::thread::id thread;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::thread opener_;
};

class BackendContract : public ::testing::TestWithParam<Subject> {
protected:
  void SetUp() override {
#ifdef BLOCKSWAP_TEST_CUDA
    if (!CudaDevice::available()) GTEST_SKIP() << "no CUDA device";
#endif
    backend_ = GetParam().make();
  }

  const Subject& subject() const {
    return GetParam();
  }
  Backend& backend() {
    return *backend_;
  }
  // Blocks until `stream` has run everything enqueued on it so far.
  void drain(Stream stream = Stream::copy) {
    const std::unique_ptr<Event> done = backend_->make_event();
    backend_->record(*done, stream);
    backend_->synchronize(*done);
  }
  std::vector<std::byte> read_on_compute(const std::byte* device, std::size_t bytes) {
    std::vector<std::byte> out(bytes);
    subject().read_on_compute(out.data(), device, bytes);
    return out;
  }
  // Device seconds from `start` to `end`, two events on the compute stream, both complete.
  double elapsed(const Event& start, const Event& end) {
    const std::optional<double> seconds = backend_->elapsed_seconds(start, end);
    EXPECT_TRUE(seconds.has_value()) << "two completed events on a backend that times events";
    return seconds.value_or(-1);
  }

  std::shared_ptr<Backend> backend_;
};

TEST_P(BackendContract, NameIsShortAndSaysWhichDevice) {
  EXPECT_EQ(backend().name(), subject().name);
}

TEST_P(BackendContract, HostBuffersArePinnedAlignedAndHoldWhatIsWritten) {
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4096}, (std::size_t{1} << 20) + 3}) {
    SCOPED_TRACE(bytes);
    Buffer host = backend().allocate_host(bytes);
    ASSERT_TRUE(host);
    EXPECT_EQ(host.size(), bytes);
    EXPECT_FALSE(host.pageable()) << "nothing caps pinning here";
    EXPECT_TRUE(aligned(host.data()));
    if (!subject().holds_data) {
      EXPECT_FALSE(readable(host.data())) << "the timed device's memory is address space only";
      continue;
    }
    const auto bytes_in = pattern(bytes, 1);
    std::memcpy(host.data(), bytes_in.data(), bytes);
    EXPECT_TRUE(same(host.data(), bytes_in));
    if (subject().page_locked) {
      EXPECT_EQ(subject().page_locked(host.data()), true);
    }
  }
  EXPECT_EQ(backend().memory().pinned_host, subject().pinned_host);
}

// pin_host page-locks memory the caller allocated, or returns an empty Buffer where the backend
// does not pin; either way copies from it are right, and the memory stays the caller's.
TEST_P(BackendContract, PinHostPinsCallerMemoryOrReturnsEmptyAndFreesNothing) {
  constexpr std::size_t kBytes = 1 << 20;
  const std::unique_ptr<std::byte, void (*)(void*)> mine(
      static_cast<std::byte*>(std::aligned_alloc(4096, kBytes)), std::free);
  const auto in = pattern(kBytes, 2);
  std::memcpy(mine.get(), in.data(), kBytes);
  Buffer dev = backend().allocate_device(kBytes), back = backend().allocate_host(kBytes);
  {
    const Buffer pinned = backend().pin_host(mine.get(), kBytes);
    if (subject().pins_caller_memory) {
      ASSERT_TRUE(pinned) << "the system refused to pin 1 MiB";
      EXPECT_EQ(pinned.data(), mine.get());
      EXPECT_EQ(pinned.size(), kBytes);
      EXPECT_FALSE(pinned.pageable());
      if (subject().page_locked) {
        EXPECT_EQ(subject().page_locked(mine.get()), true);
      }
    } else {
      EXPECT_FALSE(pinned) << "a backend that does not pin host memory returns an empty Buffer";
    }
    if (subject().holds_data) {
      backend().copy_to_device(dev.data(), mine.get(), kBytes, 0);
      backend().copy_to_host(back.data(), dev.data(), kBytes, 1);
      drain();
      EXPECT_TRUE(same(back.data(), in));
    }
  }
  // The Buffer freed nothing: the memory is the caller's, as it was, and no longer pinned.
  EXPECT_TRUE(same(mine.get(), in));
  mine.get()[0] = std::byte{1};
  if (subject().page_locked) {
    EXPECT_EQ(subject().page_locked(mine.get()), false);
  }
}

TEST_P(BackendContract, DeviceMemoryIsAccountedWhileItIsHeld) {
  const MemoryStats fresh = backend().memory();
  EXPECT_EQ(fresh.device_bytes, 0u);
  EXPECT_EQ(fresh.peak_device_bytes, 0u);
  if (subject().capacity > 0) {
    EXPECT_EQ(fresh.device_capacity, subject().capacity);
  } else {
    EXPECT_GT(fresh.device_capacity, std::size_t{1} << 30);
  }
  constexpr std::size_t kA = 1 << 20, kB = 1000; // kA is aligned, kB is not
  Buffer a = backend().allocate_device(kA);
  Buffer b = backend().allocate_device(kB);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a.size(), kA);
  EXPECT_EQ(b.size(), kB);
  EXPECT_TRUE(aligned(a.data()) && aligned(b.data())) << "every tensor dtype must be aligned";
  const MemoryStats both = backend().memory();
  // At least what was asked; at most that rounded up to the alignment (the host-side devices
  // account their aligned allocations, CUDA the sizes asked).
  EXPECT_GE(both.device_bytes, kA + kB);
  EXPECT_LE(both.device_bytes, kA + layout::align_up(kB));
  EXPECT_EQ(both.peak_device_bytes, both.device_bytes);
  a.reset();
  EXPECT_EQ(backend().memory().device_bytes, both.device_bytes - kA);
  b.reset();
  EXPECT_EQ(backend().memory().device_bytes, 0u);
  EXPECT_EQ(backend().memory().peak_device_bytes, both.device_bytes);
}

TEST_P(BackendContract, DeviceMemoryPastTheCapacityIsOutOfMemoryNamingTheSize) {
  const Buffer kept = backend().allocate_device(4096);
  const MemoryStats before = backend().memory();
  const std::size_t request = before.device_capacity + 1;
  try {
    const Buffer huge = backend().allocate_device(request);
    FAIL() << "an allocation past the device's capacity succeeded";
  } catch (const OutOfMemory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(request)), std::string::npos) << what;
  }
  EXPECT_EQ(backend().memory().device_bytes, before.device_bytes);
  EXPECT_TRUE(backend().allocate_device(4096)) << "the backend goes on";
}

// The free functions need no backend: buffers may outlive it (tensors over a slot do).
TEST_P(BackendContract, BuffersOutliveTheirBackend) {
  Buffer host = backend().allocate_host(4096), dev = backend().allocate_device(4096);
  if (subject().holds_data) std::memset(host.data(), 7, 4096);
  backend_.reset();
  if (subject().holds_data) {
    EXPECT_EQ(std::to_integer<int>(host.data()[4095]), 7);
  }
  host.reset();
  dev.reset();
}

// Copies on the copy stream run in the order enqueued and move exactly the bytes asked, to and
// from any offset; the observer sees each, in order, with its direction, size and tag.
TEST_P(BackendContract, CopiesRoundTripExactlyInOrderAndAreObserved) {
  const std::size_t sizes[] = {1, 7, 4096, (std::size_t{3} << 20) + 5};
  constexpr std::size_t kOffset = 3, kLargest = (std::size_t{3} << 20) + 64;
  Buffer host = backend().allocate_host(kLargest), back = backend().allocate_host(kLargest);
  Buffer dev = backend().allocate_device(kLargest);
  std::mutex mutex;
  std::vector<CopyRecord> seen;
  backend().set_copy_observer([&](const CopyRecord& c) {
    std::lock_guard lock(mutex);
    seen.push_back(c);
  });
  int64_t tag = 0;
  for (std::size_t bytes : sizes) {
    SCOPED_TRACE(bytes);
    const auto in = pattern(bytes, uint32_t(bytes));
    if (subject().holds_data) {
      std::memcpy(host.data(), in.data(), bytes);
      std::memset(back.data(), 0xAB, bytes + 16);
    }
    backend().copy_to_device(dev.data() + kOffset, host.data(), bytes, tag++);
    backend().copy_to_host(back.data(), dev.data() + kOffset, bytes, tag++);
    drain();
    if (!subject().holds_data) continue;
    EXPECT_TRUE(same(back.data(), in));
    for (std::size_t i = bytes; i < bytes + 16; ++i) {
      ASSERT_EQ(std::to_integer<int>(back.data()[i]), 0xAB) << "a copy wrote past its bytes";
    }
  }
  if (subject().holds_data) { // two copies to the same bytes: the later one wins
    const auto first = pattern(4096, 11), second = pattern(4096, 12);
    std::memcpy(host.data(), first.data(), 4096);
    std::memcpy(host.data() + 4096, second.data(), 4096);
    backend().copy_to_device(dev.data(), host.data(), 4096, tag++);
    backend().copy_to_device(dev.data(), host.data() + 4096, 4096, tag++);
    backend().copy_to_host(back.data(), dev.data(), 4096, tag++);
    drain();
    EXPECT_TRUE(same(back.data(), second));
  } else {
    EXPECT_FALSE(readable(dev.data())) << "the timed device's memory is address space only";
  }
  backend().set_copy_observer(nullptr);
  std::lock_guard lock(mutex);
  ASSERT_EQ(seen.size(), std::size_t(tag)) << "after synchronize, every copy before is observed";
  for (std::size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].tag, int64_t(i));
    EXPECT_LE(seen[i].start, seen[i].end);
    if (i > 0) {
      EXPECT_GE(seen[i].start, seen[i - 1].end) << "one copy stream: one at a time";
    }
    if (i >= 2 * std::size(sizes)) continue;
    EXPECT_EQ(seen[i].to_device, i % 2 == 0);
    EXPECT_EQ(seen[i].bytes, sizes[i / 2]);
    if (subject().model) { // the timed device: each copy takes the link's time for its bytes
      const double seconds = std::chrono::duration<double>(seen[i].end - seen[i].start).count();
      EXPECT_NEAR(seconds, subject().model->seconds(sizes[i / 2]), 1e-6);
    }
  }
}

// Replacing the observer: the old one sees no later copy, none sees a copy while none is set.
TEST_P(BackendContract, TheObserverSeesOnlyTheCopiesMadeWhileItIsSet) {
  Buffer host = backend().allocate_host(4096), dev = backend().allocate_device(4096);
  std::mutex mutex;
  std::vector<int64_t> first, second;
  backend().set_copy_observer([&](const CopyRecord& c) {
    std::lock_guard lock(mutex);
    first.push_back(c.tag);
  });
  backend().copy_to_device(dev.data(), host.data(), 4096, 1);
  drain();
  backend().set_copy_observer(nullptr);
  backend().copy_to_device(dev.data(), host.data(), 4096, 2);
  drain();
  backend().set_copy_observer([&](const CopyRecord& c) {
    std::lock_guard lock(mutex);
    second.push_back(c.tag);
  });
  backend().copy_to_host(host.data(), dev.data(), 4096, 3);
  drain();
  backend().set_copy_observer(nullptr);
  std::lock_guard lock(mutex);
  EXPECT_EQ(first, std::vector<int64_t>{1});
  EXPECT_EQ(second, std::vector<int64_t>{3});
}

// copy_to_device and copy_to_host return at once: the host does not wait for the copy stream.
TEST_P(BackendContract, CopiesReturnAtOnce) {
  constexpr std::size_t kBytes = std::size_t{16} << 20;
  Buffer host = backend().allocate_host(kBytes), back = backend().allocate_host(kBytes);
  Buffer dev = backend().allocate_device(kBytes);
  if (subject().runs_now(Stream::copy)) {
    // The timed device: 16 MiB over its link take device time the host's clock does not pay
    // when it enqueues them, only when it waits for them.
    ASSERT_TRUE(subject().model && subject().host_clock);
    const double before = subject().host_clock(backend());
    backend().copy_to_device(dev.data(), host.data(), kBytes, 0);
    backend().copy_to_host(back.data(), dev.data(), kBytes, 1);
    EXPECT_LT(subject().host_clock(backend()) - before, 1e-3);
    drain();
    EXPECT_GE(subject().host_clock(backend()) - before, 2 * subject().model->seconds(kBytes));
    return;
  }
  const auto old = pattern(kBytes, 3), fresh = pattern(kBytes, 4);
  std::memcpy(host.data(), old.data(), kBytes);
  {
    // The stream's work ahead of the copies writes what they read.
    Gate gate(backend(), Stream::copy, false,
              [&] { std::memcpy(host.data(), fresh.data(), kBytes); });
    backend().copy_to_device(dev.data(), host.data(), kBytes, 0);
    backend().copy_to_host(back.data(), dev.data(), kBytes, 1);
    EXPECT_FALSE(gate.passed()) << "a copy made the host wait for the copy stream";
    gate.open();
    drain();
    EXPECT_FALSE(gate.timed_out());
  }
  EXPECT_TRUE(same(back.data(), fresh)) << "a copy ran before the work enqueued ahead of it";
}

// poison fills device memory with NaN, in the copy stream's order; the timed device has nothing
// to poison.
TEST_P(BackendContract, PoisonFillsWithNaNInTheCopyStreamsOrder) {
  constexpr std::size_t kBytes = 4096, kFrom = 256, kPoisoned = 1024;
  Buffer host = backend().allocate_host(kBytes), back = backend().allocate_host(kBytes);
  Buffer dev = backend().allocate_device(kBytes);
  if (!subject().holds_data) {
    backend().poison(dev.data(), kBytes); // touches nothing: its memory would fault
    backend().poison(dev.data(), 0);
    drain();
    EXPECT_FALSE(readable(dev.data()));
    return;
  }
  const auto in = pattern(kBytes, 5);
  std::memcpy(host.data(), in.data(), kBytes);
  backend().copy_to_device(dev.data(), host.data(), kBytes, 0);
  backend().poison(dev.data() + kFrom, kPoisoned); // after the copy before it
  backend().poison(dev.data(), 0);                 // nothing
  backend().copy_to_host(back.data(), dev.data(), kBytes, 1);
  drain();
  for (std::size_t i = 0; i < kBytes; ++i) {
    const bool poisoned = i >= kFrom && i < kFrom + kPoisoned;
    ASSERT_EQ(back.data()[i], poisoned ? std::byte{0xFF} : in[i]) << "byte " << i;
  }
  float f = 0;
  std::memcpy(&f, back.data() + kFrom, sizeof f);
  EXPECT_TRUE(std::isnan(f));
}

TEST_P(BackendContract, AnEventNotYetRecordedIsCompleteAndAForeignOneIsRefused) {
  Buffer host = backend().allocate_host(4096), back = backend().allocate_host(4096);
  Buffer dev = backend().allocate_device(4096);
  const std::unique_ptr<Event> fresh = backend().make_event();
  ASSERT_TRUE(fresh);
  backend().synchronize(*fresh); // returns at once
  backend().wait(Stream::compute, *fresh);
  backend().wait(Stream::copy, *fresh); // holds nothing back
  const auto in = pattern(4096, 6);
  if (subject().holds_data) std::memcpy(host.data(), in.data(), 4096);
  backend().copy_to_device(dev.data(), host.data(), 4096, 0);
  backend().copy_to_host(back.data(), dev.data(), 4096, 1);
  drain();
  if (subject().holds_data) {
    EXPECT_TRUE(same(back.data(), in));
  }
  ForeignEvent foreign;
  EXPECT_THROW(backend().record(foreign, Stream::copy), Error);
  EXPECT_THROW(backend().wait(Stream::copy, foreign), Error);
  EXPECT_THROW(backend().synchronize(foreign), Error);
}

// Compute → copy: a copy enqueued after wait(copy, e) runs after the computation before e.
TEST_P(BackendContract, TheCopyStreamWaitsForTheComputationsItIsToldTo) {
  constexpr std::size_t kBytes = 1 << 20;
  Buffer host = backend().allocate_host(kBytes), back = backend().allocate_host(kBytes);
  Buffer dev = backend().allocate_device(kBytes);
  if (subject().holds_data) {
    const auto old = pattern(kBytes, 7), fresh = pattern(kBytes, 8);
    std::memcpy(host.data(), old.data(), kBytes);
    {
      // The computation writes what the copy reads.
      Gate computation(backend(), Stream::compute, subject().runs_now(Stream::compute),
                       [&] { std::memcpy(host.data(), fresh.data(), kBytes); });
      const std::unique_ptr<Event> computed = backend().make_event();
      backend().record(*computed, Stream::compute);
      backend().wait(Stream::copy, *computed);
      backend().copy_to_device(dev.data(), host.data(), kBytes, 0);
      backend().copy_to_host(back.data(), dev.data(), kBytes, 1);
      if (!subject().runs_now(Stream::compute)) {
        EXPECT_FALSE(computation.passed()) << "wait(copy, e) made the host wait";
      }
      computation.open();
      drain();
      EXPECT_FALSE(computation.timed_out());
    }
    EXPECT_TRUE(same(back.data(), fresh)) << "the copy ran before the computation it waits for";
  }
  if (subject().times_events) {
    // In time: the copy starts after the computation; compute then waits for the copy.
    drain(); // an observer sees the copies that complete while it is set
    std::vector<CopyRecord> seen;
    backend().set_copy_observer([&](const CopyRecord& c) { seen.push_back(c); });
    const auto start = backend().make_timed_event(), computed = backend().make_timed_event();
    const auto copied = backend().make_timed_event(), end = backend().make_timed_event();
    backend().record(*start, Stream::compute);
    subject().compute(backend(), 0.05);
    backend().record(*computed, Stream::compute);
    backend().wait(Stream::copy, *computed);
    backend().copy_to_device(dev.data(), host.data(), kBytes, 2);
    backend().record(*copied, Stream::copy);
    backend().wait(Stream::compute, *copied);
    backend().record(*end, Stream::compute);
    backend().synchronize(*end);
    backend().set_copy_observer(nullptr);
    ASSERT_EQ(seen.size(), 1u);
    const double copy = std::chrono::duration<double>(seen[0].end - seen[0].start).count();
    if (subject().model) {
      EXPECT_NEAR(elapsed(*start, *end), 0.05 + subject().model->seconds(kBytes), 1e-3);
    } else {
      EXPECT_GE(elapsed(*start, *end), 0.05 + 0.9 * copy);
    }
  }
}

// Copy → compute: work enqueued on the compute stream after wait(compute, e) sees the copies
// before e. The host does not wait, except where it is the compute stream (emulated).
TEST_P(BackendContract, TheComputeStreamWaitsForTheCopiesItIsToldTo) {
  constexpr std::size_t kBytes = std::size_t{16} << 20;
  Buffer host = backend().allocate_host(kBytes), dev = backend().allocate_device(kBytes);
  const auto in = pattern(kBytes, 9);
  if (subject().holds_data) {
    std::memcpy(host.data(), in.data(), kBytes);
    backend().copy_to_device(dev.data(), host.data(), kBytes, 0);
    const std::unique_ptr<Event> copied = backend().make_event();
    backend().record(*copied, Stream::copy);
    backend().wait(Stream::compute, *copied);
    EXPECT_TRUE(read_on_compute(dev.data(), kBytes) == in) << "compute read a partial copy";
  }
  const std::unique_ptr<Event> held = backend().make_event();
  if (subject().runs_now(Stream::copy)) {
    // The timed device: the host's clock does not move to the copy's end.
    ASSERT_TRUE(subject().host_clock);
    const double before = subject().host_clock(backend());
    backend().copy_to_device(dev.data(), host.data(), kBytes, 1);
    backend().record(*held, Stream::copy);
    backend().wait(Stream::compute, *held);
    EXPECT_LT(subject().host_clock(backend()) - before, 1e-3) << "wait(compute) made the host wait";
  } else {
    Gate gate(backend(), Stream::copy, false);
    backend().record(*held, Stream::copy);
    if (subject().host_is_compute) {
      gate.open_after(50ms);
      backend().wait(Stream::compute, *held);
      EXPECT_TRUE(gate.passed()) << "the host is the compute stream: wait(compute) waits";
    } else {
      backend().wait(Stream::compute, *held);
      EXPECT_FALSE(gate.passed()) << "wait(compute) made the host wait";
      gate.open();
    }
    drain(Stream::compute);
    EXPECT_FALSE(gate.timed_out());
  }
  if (subject().times_events) {
    drain(); // an observer sees the copies that complete while it is set
    std::vector<CopyRecord> seen;
    backend().set_copy_observer([&](const CopyRecord& c) { seen.push_back(c); });
    const auto start = backend().make_timed_event(), copied = backend().make_timed_event();
    const auto end = backend().make_timed_event();
    backend().record(*start, Stream::compute);
    backend().copy_to_device(dev.data(), host.data(), kBytes, 2);
    backend().record(*copied, Stream::copy);
    backend().wait(Stream::compute, *copied);
    backend().record(*end, Stream::compute);
    backend().synchronize(*end);
    backend().set_copy_observer(nullptr);
    ASSERT_EQ(seen.size(), 1u);
    const double copy = std::chrono::duration<double>(seen[0].end - seen[0].start).count();
    if (subject().model) {
      EXPECT_NEAR(elapsed(*start, *end), subject().model->seconds(kBytes), 1e-3);
    } else {
      EXPECT_GE(elapsed(*start, *end), 0.9 * copy);
    }
  }
}

// synchronize blocks the host until the event has completed, and no longer.
// Backend::decode: a compressed block on the device decodes into device memory bit for bit, on
// the decode stream, ordered after its copy and before the copy back by events; a damaged one is
// an Error where the host next waits for the decode stream, and the stream goes on. (CUDA: a
// build without nvcc cannot decode, and says so.)
TEST_P(BackendContract, DecodeWritesTheRawBytesAndDamageFailsAtTheNextWait) {
  constexpr std::size_t kValues = 20'000;
  const std::vector<std::byte> raw =
      codec_testing::weights(codec::DType::bf16, kValues, 3); // 40 000 bytes
  const std::vector<codec::Range> ranges = {{0, raw.size(), codec::DType::bf16}};
  const std::vector<std::byte> packed = codec::encode(raw, ranges);
  ASSERT_LT(packed.size(), raw.size());
  const codec::Parsed parsed = codec::parse(packed);
  if (!backend().can_decode()) {
    EXPECT_THROW(backend().decode(nullptr, nullptr, packed.size(), parsed, 0), Error);
    return;
  }
  Buffer host = backend().allocate_host(packed.size()), back = backend().allocate_host(raw.size());
  Buffer in = backend().allocate_device(packed.size()), out = backend().allocate_device(raw.size());
  const std::unique_ptr<Event> copied = backend().make_event(), decoded = backend().make_event();
  // The copy in, then the decode after it (as the load pipeline orders them).
  auto copy_and_decode = [&](int64_t tag) {
    backend().copy_to_device(in.data(), host.data(), packed.size(), tag);
    backend().record(*copied, Stream::copy);
    backend().wait(Stream::decode, *copied);
    backend().decode(out.data(), in.data(), packed.size(), parsed, tag);
  };
  // Then the copy back after the decode.
  auto copy_back = [&](int64_t tag) {
    backend().record(*decoded, Stream::decode);
    backend().wait(Stream::copy, *decoded);
    backend().copy_to_host(back.data(), out.data(), raw.size(), tag);
    drain(Stream::decode);
    drain();
  };
  if (!subject().holds_data) { // decodes in modelled time, touching nothing
    copy_and_decode(0);
    drain(Stream::decode);
    return;
  }
  std::memcpy(host.data(), packed.data(), packed.size());
  copy_and_decode(0);
  copy_back(1);
  EXPECT_TRUE(same(back.data(), raw));

  host.data()[packed.size() - 5] ^= std::byte{0x04}; // a rest byte: only the checksum sees it
  copy_and_decode(2);
  EXPECT_THROW(drain(Stream::decode), Error);
  // The stream goes on: the block as it was decodes again.
  host.data()[packed.size() - 5] ^= std::byte{0x04};
  copy_and_decode(3);
  copy_back(4);
  EXPECT_TRUE(same(back.data(), raw));
}

TEST_P(BackendContract, SynchronizeBlocksTheHostUntilTheEvent) {
  const std::unique_ptr<Event> event = backend().make_event();
  if (subject().runs_now(Stream::copy)) {
    // The timed device: the host waits in device time, its clock moving to the event's.
    ASSERT_TRUE(subject().model && subject().host_clock);
    constexpr std::size_t kBytes = 100'000'000;
    Buffer host = backend().allocate_host(kBytes), dev = backend().allocate_device(kBytes);
    const double before = subject().host_clock(backend());
    backend().copy_to_device(dev.data(), host.data(), kBytes, 0);
    backend().record(*event, Stream::copy);
    backend().synchronize(*event);
    EXPECT_NEAR(subject().host_clock(backend()) - before, subject().model->seconds(kBytes), 1e-3);
    return;
  }
  Gate gate(backend(), Stream::copy, false);
  backend().record(*event, Stream::copy);
  auto waiter = std::async(std::launch::async, [&] {
    backend().synchronize(*event);
    return gate.passed();
  });
  EXPECT_EQ(waiter.wait_for(100ms), std::future_status::timeout) << "synchronize did not wait";
  gate.open();
  EXPECT_TRUE(waiter.get()) << "synchronize returned before the stream reached the event";
  EXPECT_FALSE(gate.timed_out());
}

// Recording again replaces the event's point; a wait already enqueued keeps the point it saw.
TEST_P(BackendContract, RecordingAgainMovesThePointAndEarlierWaitsKeepTheirs) {
  const std::unique_ptr<Event> event = backend().make_timed_event();
  backend().record(*event, Stream::copy);
  backend().synchronize(*event);
  if (subject().runs_now(Stream::copy)) {
    const auto start = backend().make_timed_event();
    backend().record(*start, Stream::compute);
    backend().record(*event, Stream::compute);
    subject().compute(backend(), 0.5);
    backend().record(*event, Stream::compute);
    backend().synchronize(*event);
    EXPECT_NEAR(elapsed(*start, *event), 0.5, 1e-3);
  } else {
    Gate gate(backend(), Stream::copy, false);
    backend().record(*event, Stream::copy); // now behind the gate
    auto waiter = std::async(std::launch::async, [&] {
      backend().synchronize(*event);
      return gate.passed();
    });
    EXPECT_EQ(waiter.wait_for(100ms), std::future_status::timeout) << "the first point was used";
    gate.open();
    EXPECT_TRUE(waiter.get());
  }
  // The copy stream waits for the compute stream's point as it was when wait() was called.
  Buffer host = backend().allocate_host(4096), dev = backend().allocate_device(4096);
  const std::unique_ptr<Event> computed = backend().make_event(), copied = backend().make_event();
  backend().record(*computed, Stream::compute);
  backend().wait(Stream::copy, *computed);
  const double before = subject().host_clock ? subject().host_clock(backend()) : 0;
  {
    Gate gate(backend(), Stream::compute, subject().runs_now(Stream::compute));
    if (subject().runs_now(Stream::compute) && subject().model) subject().compute(backend(), 0.5);
    backend().record(*computed, Stream::compute); // a later point
    backend().copy_to_device(dev.data(), host.data(), 4096, 0);
    backend().record(*copied, Stream::copy);
    backend().synchronize(*copied);
    if (!subject().runs_now(Stream::compute)) {
      EXPECT_FALSE(gate.passed()) << "the copy waited for a point recorded after its wait";
    }
    if (subject().host_clock) {
      EXPECT_LT(subject().host_clock(backend()) - before, 0.25)
          << "the copy waited for a point recorded after its wait";
    }
  }
  drain(Stream::compute);
}

// wait_host: the stream calls the function once it gets there, on a thread of the backend's,
// and its later work waits until it returns; the host does not wait. Backend's default (the
// timed device) and the emulated device's compute stream (the host) call it at once.
TEST_P(BackendContract, WaitHostRunsItsFunctionBeforeTheStreamsLaterWork) {
  for (const Stream stream : {Stream::compute, Stream::copy}) {
    SCOPED_TRACE(stream == Stream::compute ? "compute" : "copy");
    const bool now = subject().runs_now(stream);
    std::mutex mutex;
    std::vector<int> order;
    std::vector<std::thread::id> threads;
    {
      Gate gate(backend(), stream, now);
      for (int i = 1; i <= 3; ++i) {
        backend().wait_host(stream, [&, i] {
          std::lock_guard lock(mutex);
          order.push_back(i);
          threads.push_back(std::this_thread::get_id());
        });
      }
      {
        std::lock_guard lock(mutex);
        if (now) {
          EXPECT_EQ(order, (std::vector<int>{1, 2, 3})) << "the host calls it at once";
        } else {
          EXPECT_TRUE(order.empty()) << "a function ran before the stream's work ahead of it";
          EXPECT_FALSE(gate.passed());
        }
      }
      gate.open();
      drain(stream);
      EXPECT_FALSE(gate.timed_out());
    }
    std::lock_guard lock(mutex);
    EXPECT_EQ(order, (std::vector<int>{1, 2, 3})) << "once each, in order";
    for (const std::thread::id id : threads) {
      EXPECT_EQ(id == std::this_thread::get_id(), now) << "called on the wrong thread";
    }
  }
  // A function that takes its time: the copy after it still reads what it wrote.
  if (!subject().holds_data) return;
  constexpr std::size_t kBytes = 1 << 20;
  Buffer host = backend().allocate_host(kBytes), back = backend().allocate_host(kBytes);
  Buffer dev = backend().allocate_device(kBytes);
  const auto in = pattern(kBytes, 10);
  backend().wait_host(Stream::copy, [&] {
    std::this_thread::sleep_for(20ms);
    std::memcpy(host.data(), in.data(), kBytes);
  });
  backend().copy_to_device(dev.data(), host.data(), kBytes, 0);
  backend().copy_to_host(back.data(), dev.data(), kBytes, 1);
  drain();
  EXPECT_TRUE(same(back.data(), in));
}

// elapsed_seconds times two events of the compute stream once both have completed, where the
// backend times events (times_events); the emulated device cannot (its compute stream is the
// host).
TEST_P(BackendContract, ElapsedSecondsTimesTheComputeStreamWhereItCan) {
  EXPECT_EQ(backend().times_events(), subject().times_events);
  const auto start = backend().make_timed_event(), end = backend().make_timed_event();
  backend().record(*start, Stream::compute);
  subject().compute(backend(), 0.05);
  backend().record(*end, Stream::compute);
  backend().synchronize(*end);
  const std::optional<double> seconds = backend().elapsed_seconds(*start, *end);
  if (!subject().times_events) {
    EXPECT_FALSE(seconds.has_value());
    return;
  }
  ASSERT_TRUE(seconds.has_value());
  if (subject().model) {
    EXPECT_NEAR(*seconds, 0.05, 1e-3);
  } else {
    EXPECT_GE(*seconds, 0.049);
    EXPECT_LT(*seconds, 1.0);
  }
  if (subject().runs_now(Stream::compute)) return;
  // Not yet: the end is behind a computation that has not run.
  Gate gate(backend(), Stream::compute, false);
  backend().record(*end, Stream::compute);
  EXPECT_FALSE(backend().elapsed_seconds(*start, *end).has_value());
  gate.open();
  backend().synchronize(*end);
  EXPECT_TRUE(backend().elapsed_seconds(*start, *end).has_value());
  EXPECT_FALSE(gate.timed_out());
}

// make_event's events order the streams and cannot be timed (CUDA: cudaEventDisableTiming);
// where the backend times events, elapsed_seconds refuses them with an Error, so that a caller
// that forgets make_timed_event fails on the timed device here as it would on a GPU. Timed
// events order the streams as untimed ones do.
TEST_P(BackendContract, OnlyTimedEventsAreTimed) {
  const auto start = backend().make_event(), end = backend().make_event();
  const auto timed = backend().make_timed_event();
  backend().record(*start, Stream::compute);
  backend().record(*timed, Stream::compute);
  backend().record(*end, Stream::compute);
  backend().synchronize(*end);
  backend().wait(Stream::copy, *timed);
  backend().synchronize(*timed);
  if (!subject().times_events) {
    EXPECT_FALSE(backend().elapsed_seconds(*start, *end).has_value());
    EXPECT_FALSE(backend().elapsed_seconds(*timed, *timed).has_value());
    return;
  }
  EXPECT_THROW((void)backend().elapsed_seconds(*start, *end), Error);
  EXPECT_THROW((void)backend().elapsed_seconds(*timed, *end), Error);
  EXPECT_THROW((void)backend().elapsed_seconds(*start, *timed), Error);
  const std::optional<double> zero = backend().elapsed_seconds(*timed, *timed);
  ASSERT_TRUE(zero.has_value());
  EXPECT_EQ(*zero, 0.0);
}

// A file of `bytes` bytes with known contents, in a directory of this test's own.
struct TestFile {
  std::filesystem::path path;
  std::vector<std::byte> contents;
  explicit TestFile(std::size_t bytes) : contents(pattern(bytes, 13)) {
    const auto dir = std::filesystem::temp_directory_path() /
                     ("blockswap-backend-contract-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    path = dir / "model.bin";
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(contents.data()), std::streamsize(bytes));
  }
  ~TestFile() { std::filesystem::remove_all(path.parent_path()); }
};

// make_staging_reader: a reader over the file and pageable memory whose blocks, read into the
// ring's buffers, reach the device through copies ordered after their reads (copy_after); the
// timed device reads nothing and models the disk instead.
TEST_P(BackendContract, TheStagingReaderReadsWhatTheFileHolds) {
  if (!subject().holds_data) {
    // One block of 100 MB: its read takes the disk's time, and the copy out of it waits for it.
    ASSERT_TRUE(subject().model);
    constexpr std::size_t kBytes = 100'000'000;
    StagingSpec spec{{}, {FileBlock{{}, kBytes, nullptr}}, {}, "contract"};
    spec.staging.push_back(std::make_shared<Buffer>(backend().allocate_host(kBytes)));
    const std::unique_ptr<StagingReader> reader = backend().make_staging_reader(std::move(spec));
    Buffer dev = backend().allocate_device(kBytes);
    const auto start = backend().make_timed_event(), end = backend().make_timed_event();
    std::shared_ptr<Event> copied = backend().make_event();
    backend().record(*start, Stream::compute);
    reader->request(0);
    const StagingReader::Staged staged = reader->take();
    reader->copy_after(staged);
    backend().copy_to_device(dev.data(), staged.buffer->data(), kBytes, 0);
    backend().record(*copied, Stream::copy);
    reader->release(staged, copied);
    backend().wait(Stream::compute, *copied);
    backend().record(*end, Stream::compute);
    backend().synchronize(*end);
    const LinkModel& link = *subject().model;
    EXPECT_NEAR(elapsed(*start, *end), link.disk_seconds(kBytes) + link.seconds(kBytes), 1e-3);
    EXPECT_EQ(reader->bytes_read(), kBytes);
    return;
  }
  // Block 0: two ranges of the file, packed in the other order with a gap; block 1: one range
  // at an odd offset; block 2: pageable memory.
  const TestFile file(200'000);
  const auto memory = pattern(3000, 14);
  std::vector<FileBlock> blocks(3);
  blocks[0] = FileBlock{{{13, 5000, 4160}, {5013, 4096, 0}}, 9160, nullptr};
  blocks[1] = FileBlock{{{20'001, 70'000, 0}}, 70'000, nullptr};
  blocks[2] = FileBlock{{}, 3000, memory.data()};
  auto expected = [&](int b) {
    std::vector<std::pair<std::size_t, std::vector<std::byte>>> parts; // at, bytes
    if (blocks[b].memory) parts.emplace_back(0, memory);
    for (const FileRange& r : blocks[b].ranges) {
      const auto at = file.contents.begin() + std::ptrdiff_t(r.file_offset);
      parts.emplace_back(r.to, std::vector<std::byte>(at, at + std::ptrdiff_t(r.bytes)));
    }
    return parts;
  };
  StagingSpec spec{{file.path.string()}, blocks, {}, "contract"};
  spec.staging.push_back(std::make_shared<Buffer>(backend().allocate_host(70'000)));
  const std::unique_ptr<StagingReader> reader = backend().make_staging_reader(std::move(spec));
  // Read and waited for by the host: the staging buffer holds the block.
  for (int b = 0; b < 3; ++b) reader->request(b);
  for (int b = 0; b < 3; ++b) {
    const StagingReader::Staged staged = reader->next();
    ASSERT_EQ(staged.block, b);
    for (const auto& [at, bytes] : expected(b)) {
      EXPECT_TRUE(same(staged.buffer->data() + at, bytes)) << "block " << b << " at " << at;
    }
    reader->release(staged);
  }
  // Through the one staging buffer to the device, the host waiting for nothing: each copy waits
  // for its read on the copy stream, each read for the copy out of the buffer before it.
  std::vector<Buffer> devs;
  for (int b = 0; b < 3; ++b) devs.push_back(backend().allocate_device(70'000));
  for (int b = 0; b < 3; ++b) reader->request(b);
  std::vector<StagingReader::Staged> staged;
  for (int b = 0; b < 3; ++b) {
    staged.push_back(reader->take());
    reader->copy_after(staged.back());
    backend().copy_to_device(devs[b].data(), staged.back().buffer->data(), blocks[b].bytes, b);
    std::shared_ptr<Event> copied = backend().make_event();
    backend().record(*copied, Stream::copy);
    reader->release(staged.back(), copied);
  }
  drain();
  Buffer back = backend().allocate_host(70'000);
  for (int b = 0; b < 3; ++b) {
    reader->wait(staged[b]);
    backend().copy_to_host(back.data(), devs[b].data(), blocks[b].bytes, b);
    drain();
    for (const auto& [at, bytes] : expected(b)) {
      EXPECT_TRUE(same(back.data() + at, bytes)) << "block " << b << " at " << at;
    }
  }
  EXPECT_EQ(reader->bytes_read(), 2 * (9160u + 70'000u + 3000u));
}

#ifdef BLOCKSWAP_TEST_CUDA

Subject cuda() {
  Subject s;
  s.label = "cuda";
  s.name = "cuda:0";
  s.make = [] { return std::make_shared<CudaDevice>(); };
  s.times_events = true;
  s.pins_caller_memory = true;
  s.pinned_host = true;
  // A computation: the compute stream (the legacy default stream: CudaDeviceOptions's default)
  // waits for the host.
  s.compute = [](Backend& backend, double seconds) {
    backend.wait_host(Stream::compute, [seconds] {
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    });
  };
  s.read_on_compute = [](std::byte* host, const std::byte* device, std::size_t bytes) {
    ASSERT_EQ(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  };
  s.page_locked = [](const void* p) -> std::optional<bool> {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      cudaGetLastError();
      return std::nullopt;
    }
    return attributes.type == cudaMemoryTypeHost;
  };
  return s;
}

INSTANTIATE_TEST_SUITE_P(Cuda, BackendContract, ::testing::Values(cuda()),
                         [](const auto& test) { return test.param.label; });

#else

constexpr std::size_t kCapacity = std::size_t{8} << 30; // the host-side devices' memory

Subject emulated() {
  Subject s;
  s.label = "emulated";
  s.name = "emulated";
  // A link of 2 GB/s: a copy that is not waited for is seen unfinished.
  s.make = [] {
    return std::make_shared<EmulatedDevice>(
        EmulatedDeviceOptions{.capacity_bytes = kCapacity, .link_gbps = 2.0});
  };
  s.host_is_compute = true;
  s.capacity = kCapacity;
  s.compute = [](Backend&, double seconds) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  };
  s.read_on_compute = [](std::byte* host, const std::byte* device, std::size_t bytes) {
    std::memcpy(host, device, bytes);
  };
  return s;
}

Subject timed() {
  Subject s;
  s.label = "timed";
  s.name = "timed";
  s.model =
      LinkModel{.bytes_per_second = 1e9, .latency_seconds = 1e-4, .disk_bytes_per_second = 5e8};
  s.make = [link = *s.model] {
    return std::make_shared<TimedDevice>(TimedDeviceOptions{link, kCapacity});
  };
  s.holds_data = false;
  s.times_events = true;
  s.host_functions_now = true;
  s.capacity = kCapacity;
  s.compute = [](Backend& backend, double seconds) {
    dynamic_cast<TimedDevice&>(backend).compute(seconds);
  };
  s.host_clock = [](Backend& backend) { return dynamic_cast<TimedDevice&>(backend).now(); };
  return s;
}

INSTANTIATE_TEST_SUITE_P(Host, BackendContract, ::testing::Values(emulated(), timed()),
                         [](const auto& test) { return test.param.label; });

#endif

} // namespace
} // namespace blockswap
