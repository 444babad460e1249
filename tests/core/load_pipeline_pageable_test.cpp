// The load pipeline under the engine where the system caps page-locked memory: blocks whose host
// copies are pageable are loaded through a pinned staging ring, exactly, and no load makes the host
// wait for the copy stream (Note [pageable host memory] in load_pipeline.cpp). On the emulated
// device, whose pinning caps as a system's would; compiled with BLOCKSWAP_TEST_CUDA (label gpu),
// the same cases on the CUDA backend, its pinning capped by CappedPinning below.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/planner.hpp"

#ifdef BLOCKSWAP_TEST_CUDA
#include <cuda_runtime_api.h>

#include "blockswap/device/cuda.hpp"
#else
#include "blockswap/device/emulated.hpp"
#endif

namespace blockswap {
namespace {

constexpr std::size_t kFloats = 1024; // 4 KiB per block
constexpr std::size_t kBytes = kFloats * sizeof(float);

float value(int64_t block, std::size_t j, int version = 0) {
  return float(block) * 1e4f + float(j) + float(version) * 0.5f;
}

#ifdef BLOCKSWAP_TEST_CUDA

// The CUDA backend with its page-locked host memory capped at `pinnable` bytes, counted as
// EmulatedDeviceOptions::pinnable_bytes counts them: past the cap, allocate_host returns what
// CudaDevice::allocate_host returns when the system refuses to pin (pageable memory, marked so),
// and the driver makes the host wait for each copy from or to it. The rest is the CUDA backend.
class CappedPinning final : public Backend {
public:
  explicit CappedPinning(std::size_t pinnable) : pinnable_(pinnable) {}

  std::string name() const override { return cuda_->name(); }
  Buffer allocate_host(std::size_t bytes) override {
    const std::size_t size = layout::align_up(std::max<std::size_t>(bytes, 1));
    std::unique_lock lock(state_->mutex);
    if (pinnable_ - state_->pinned >= size) {
      state_->pinned += size;
      lock.unlock();
      auto pinned = std::make_shared<Buffer>(cuda_->allocate_host(bytes));
      std::byte* data = pinned->data();
      return Buffer(data, bytes, [pinned, state = state_, size](std::byte*, std::size_t) {
        pinned->reset();
        std::lock_guard held(state->mutex);
        state->pinned -= size;
      });
    }
    lock.unlock();
    auto* data = static_cast<std::byte*>(std::aligned_alloc(4096, (size + 4095) / 4096 * 4096));
    if (data == nullptr) throw OutOfMemory("cannot allocate pageable host memory");
    {
      std::lock_guard held(state_->mutex);
      state_->pageable.emplace(data, size);
    }
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
  Buffer pin_host(std::byte* data, std::size_t bytes) override {
    return cuda_->pin_host(data, bytes);
  }
  Buffer allocate_device(std::size_t bytes) override { return cuda_->allocate_device(bytes); }
  void copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                      int64_t tag) override {
    count(host);
    cuda_->copy_to_device(device, host, bytes, tag);
  }
  void copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                    int64_t tag) override {
    count(host);
    cuda_->copy_to_host(host, device, bytes, tag);
  }
  void set_copy_observer(CopyObserver observer) override {
    cuda_->set_copy_observer(std::move(observer));
  }
  void poison(std::byte* device, std::size_t bytes) override { cuda_->poison(device, bytes); }
  std::unique_ptr<Event> make_event() override { return cuda_->make_event(); }
  std::unique_ptr<Event> make_timed_event() override { return cuda_->make_timed_event(); }
  void record(Event& event, Stream stream) override { cuda_->record(event, stream); }
  void wait(Stream stream, const Event& event) override { cuda_->wait(stream, event); }
  void synchronize(const Event& event) override { cuda_->synchronize(event); }
  void wait_host(Stream stream, std::function<void()> until) override {
    cuda_->wait_host(stream, std::move(until));
  }
  bool times_events() const override { return cuda_->times_events(); }
  std::optional<double> elapsed_seconds(const Event& start, const Event& end) const override {
    return cuda_->elapsed_seconds(start, end);
  }
  MemoryStats memory() const override { return cuda_->memory(); }
  std::unique_ptr<StagingReader> make_staging_reader(StagingSpec spec) override {
    return cuda_->make_staging_reader(std::move(spec));
  }

  // Copies from or to pageable host memory so far (EmulatedDevice::pageable_copies).
  std::size_t pageable_copies() const {
    std::lock_guard lock(state_->mutex);
    return state_->pageable_copies;
  }

private:
  struct State {
    std::mutex mutex;
    std::size_t pinned = 0;
    std::map<const std::byte*, std::size_t> pageable; // start, size
    std::size_t pageable_copies = 0;
  };

  void count(const std::byte* host) {
    std::lock_guard lock(state_->mutex);
    auto it = state_->pageable.upper_bound(host);
    if (it != state_->pageable.begin() && host < std::prev(it)->first + std::prev(it)->second) {
      ++state_->pageable_copies;
    }
  }

  const std::shared_ptr<CudaDevice> cuda_ = std::make_shared<CudaDevice>();
  const std::size_t pinnable_;
  const std::shared_ptr<State> state_ = std::make_shared<State>();
};
using TestDevice = CappedPinning;

std::shared_ptr<TestDevice> capped(std::size_t blocks) {
  return std::make_shared<CappedPinning>(blocks * layout::align_up(kBytes));
}

std::shared_ptr<TestDevice> uncapped() {
  return std::make_shared<CappedPinning>(std::numeric_limits<std::size_t>::max());
}

// What a computation reads from and writes to device memory now: copies on the compute stream
// (the legacy default stream: CudaDeviceOptions's default), after what it waits for.
std::vector<float> read_device(const std::byte* device) {
  std::vector<float> out(kFloats);
  EXPECT_EQ(cudaMemcpy(out.data(), device, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

void write_device(std::byte* device, std::size_t first, const std::vector<float>& floats) {
  EXPECT_EQ(cudaMemcpy(device + first * sizeof(float), floats.data() + first,
                       (kFloats - first) * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
}

#else

using TestDevice = EmulatedDevice;

// A device whose host memory pins at most `blocks` blocks' worth (one slot each here).
std::shared_ptr<TestDevice> capped(std::size_t blocks) {
  return std::make_shared<EmulatedDevice>(
      EmulatedDeviceOptions{.link_gbps = 4.0, .pinnable_bytes = blocks * layout::align_up(kBytes)});
}

std::shared_ptr<TestDevice> uncapped() {
  return std::make_shared<EmulatedDevice>();
}

// What a computation reads from and writes to device memory now: the bytes themselves (the
// emulated device's compute stream is the host).
std::vector<float> read_device(const std::byte* device) {
  std::vector<float> out(kFloats);
  std::memcpy(out.data(), device, kBytes);
  return out;
}

void write_device(std::byte* device, std::size_t first, const std::vector<float>& floats) {
  std::memcpy(device + first * sizeof(float), floats.data() + first,
              (kFloats - first) * sizeof(float));
}

#endif

class PageableHostMemory : public ::testing::Test {
protected:
  void SetUp() override {
#ifdef BLOCKSWAP_TEST_CUDA
    if (!CudaDevice::available()) GTEST_SKIP() << "no CUDA device";
#endif
  }
};

void fill(Engine& engine) {
  for (int64_t b = 0; b < engine.blocks(); ++b) {
    auto* host = reinterpret_cast<float*>(engine.host_data(b));
    for (std::size_t j = 0; j < kFloats; ++j) host[j] = value(b, j);
  }
}

// Block `b` on the device holds value(b, j) in its frozen floats and value(b, j, versions[b])
// in its last `trainable` floats.
void expect_on_device(const Engine& engine, int64_t b, std::size_t trainable = 0, int version = 0) {
  const std::vector<float> dev = read_device(engine.device_data(b));
  for (std::size_t j = 0; j < kFloats; ++j) {
    const float want = value(b, j, j >= kFloats - trainable ? version : 0);
    ASSERT_EQ(dev[j], want) << "block " << b << " float " << j;
  }
}

// A pass forward over blocks [0, `end`), and one backward in `order` (default: the reverse), each
// block checked on the device as expect_on_device does.
void forward(Engine& engine, std::size_t trainable = 0, int version = 0, int64_t end = -1) {
  for (int64_t b = 0; b < (end < 0 ? engine.blocks() : end); ++b) {
    engine.enter(b);
    expect_on_device(engine, b, trainable, version);
    engine.leave(b);
  }
}

void backward(Engine& engine, std::size_t trainable = 0, int version = 0,
              std::vector<int64_t> order = {}) {
  if (order.empty()) {
    for (int64_t b = engine.blocks() - 1; b >= 0; --b) order.push_back(b);
  }
  for (int64_t b : order) {
    engine.wait_for_block(b);
    expect_on_device(engine, b, trainable, version);
    engine.after_backward(b);
  }
}

TEST_F(PageableHostMemory, StagingBuffersTakeThePinnedMemoryOfTheLastBlocks) {
  // Inference, K 3: 3 blocks' worth pins: the first three in host_priority's order first, then
  // the ring's two buffers take the third's and the second's.
  auto device = capped(3);
  Engine engine(device, std::vector<std::size_t>(8, kBytes), {.blocks_to_swap = 3});
  const Schedule* schedules[] = {&engine.schedule()};
  const int64_t first = host_priority(8, schedules).front();
  std::vector<bool> pageable, expected;
  for (int64_t b = 0; b < 8; ++b) {
    pageable.push_back(engine.host_buffer(b)->pageable());
    expected.push_back(b != first);
  }
  EXPECT_EQ(pageable, expected);
}

// Pinned memory goes to the blocks that move first; a block that never moves is loaded once
// and needs none. Training, N 8, K 2: four blocks move. With room for six blocks and the ring,
// every load is from pinned memory, and the ring was never needed.
TEST_F(PageableHostMemory, PinnedMemoryGoesToTheBlocksThatMove) {
  auto device = capped(6);
  Engine engine(device, std::vector<std::size_t>(8, kBytes),
                {.blocks_to_swap = 2,
                 .supports_backward = true,
                 .trainable_bytes = std::vector<std::size_t>(8, 0)});
  fill(engine);
  std::vector<bool> moves(8, false);
  for (const Op& op : engine.schedule().pass()) {
    if (op.kind == Op::Kind::move) moves[op.move.in] = true;
  }
  for (int64_t b = 0; b < 8; ++b) {
    if (moves[b]) {
      EXPECT_FALSE(engine.host_buffer(b)->pageable()) << b;
    }
  }
  for (int step = 0; step < 2; ++step) {
    if (step == 1) engine.reset_stats(); // the first prepare staged the blocks that stay
    engine.prepare();
    forward(engine);
    backward(engine);
  }
  engine.synchronize();
  EXPECT_EQ(engine.stats().staged_bytes, 0u);
  EXPECT_GT(engine.stats().moves, 0u);
}

// Frozen blocks (the reader copies them ahead), and blocks whose bytes may all change (the
// default without trainable_bytes: the load copies them into the staging buffer itself).
TEST_F(PageableHostMemory, InferenceIsExactAndNoLoadWaitsForTheCopyStream) {
  for (const bool frozen : {true, false}) {
    for (int64_t k : {1, 3, 6}) {
      SCOPED_TRACE(::testing::Message() << "K " << k << (frozen ? " frozen" : " trainable"));
      auto device = capped(3);
      EngineOptions options{.blocks_to_swap = k};
      if (frozen) options.trainable_bytes.assign(8, 0);
      Engine engine(device, std::vector<std::size_t>(8, kBytes), options);
      fill(engine);
      engine.prepare();
      for (int pass = 0; pass < 3; ++pass) forward(engine);
      engine.synchronize();
      EXPECT_EQ(device->pageable_copies(), 0u);
      EXPECT_GT(engine.stats().staged_bytes, 0u);
      EXPECT_EQ(engine.stats().disk_bytes, 0u);
    }
  }
}

TEST_F(PageableHostMemory, AllPinnedStagesNothing) {
  auto device = uncapped();
  Engine engine(device, std::vector<std::size_t>(8, kBytes), {.blocks_to_swap = 3});
  fill(engine);
  engine.prepare();
  forward(engine);
  engine.synchronize();
  EXPECT_EQ(engine.stats().staged_bytes, 0u);
  EXPECT_EQ(device->pageable_copies(), 0u);
}

// Full fine-tuning: each backward changes a block's trainable floats on the device; the next
// load of the block, staged from pageable memory, carries the written-back values. Only the
// write-backs touch pageable memory directly (they make the host wait; loads never do).
TEST_F(PageableHostMemory, TrainingCarriesEveryWriteBackIntoTheNextLoad) {
  constexpr std::size_t kTrainable = 256;
  constexpr int64_t kBlocks = 6;
  for (int64_t k : {1, 2, 4}) {
    SCOPED_TRACE(k);
    auto device = capped(2); // the ring takes both: every block is pageable
    Engine engine(
        device, std::vector<std::size_t>(kBlocks, kBytes),
        {.blocks_to_swap = k,
         .supports_backward = true,
         .trainable_bytes = std::vector<std::size_t>(kBlocks, kTrainable * sizeof(float))});
    for (int64_t b = 0; b < kBlocks; ++b) ASSERT_TRUE(engine.host_buffer(b)->pageable()) << b;
    fill(engine);
    std::vector<int> version(kBlocks, 0);
    for (int step = 1; step <= 3; ++step) {
      engine.prepare();
      for (int64_t b = 0; b < kBlocks; ++b) { // each block at its own version
        engine.enter(b);
        expect_on_device(engine, b, kTrainable, version[b]);
        engine.leave(b);
      }
      for (int64_t b = kBlocks - 1; b >= 0; --b) {
        engine.wait_for_block(b);
        expect_on_device(engine, b, kTrainable, version[b]);
        version[b] = step;
        std::vector<float> dev(kFloats);
        for (std::size_t j = kFloats - kTrainable; j < kFloats; ++j) dev[j] = value(b, j, step);
        write_device(engine.device_data(b), kFloats - kTrainable, dev);
        engine.mark_dirty(b);
        engine.after_backward(b);
      }
    }
    engine.prepare(); // the last step's changes come back with the next loads
    forward(engine, kTrainable, 3);
    engine.synchronize();
    const uint64_t write_backs = engine.stats().d2h_bytes / (kTrainable * sizeof(float));
    EXPECT_GT(engine.stats().staged_bytes, 0u);
    EXPECT_LE(device->pageable_copies(), write_backs); // the spare regions may pin
  }
}

// Frozen bytes written by the caller between passes (a weight changed between steps: the host
// copy of a block off the device, the slot of one on it) reach every later load: no read made
// ahead before the write survives the next prepare().
TEST_F(PageableHostMemory, FrozenBytesWrittenBetweenPassesReachTheNextLoads) {
  constexpr int64_t kBlocks = 6;
  for (const bool train : {false, true}) {
    for (int64_t k : {1, 2, 4}) {
      SCOPED_TRACE(::testing::Message() << "K " << k << (train ? " training" : " inference"));
      auto device = capped(2);
      Engine engine(device, std::vector<std::size_t>(kBlocks, kBytes),
                    {.blocks_to_swap = k,
                     .supports_backward = train,
                     .trainable_bytes = std::vector<std::size_t>(kBlocks, 0)});
      fill(engine);
      for (int version = 0; version < 4; ++version) {
        engine.prepare();
        forward(engine, kFloats, version);
        if (train) backward(engine, kFloats, version);
        engine.synchronize();
        for (int64_t b = 0; b < kBlocks; ++b) { // the step's end: a weight changes
          auto* host = reinterpret_cast<float*>(engine.host_data(b));
          for (std::size_t j = 0; j < kFloats; ++j) host[j] = value(b, j, version + 1);
          if (engine.is_resident(b)) {
            engine.enter(b); // its load is done: its slot is what the block holds
            std::vector<float> dev(kFloats);
            for (std::size_t j = 0; j < kFloats; ++j) dev[j] = value(b, j, version + 1);
            write_device(engine.device_data(b), 0, dev);
          }
        }
      }
    }
  }
}

// Orders the schedule did not foresee (a mode switch in the middle of training, a pass
// stopped early) cancel the reads ahead and stay exact.
TEST_F(PageableHostMemory, UnforeseenOrdersStayExact) {
  auto device = capped(2);
  Engine engine(device, std::vector<std::size_t>(6, kBytes),
                {.blocks_to_swap = 2,
                 .supports_backward = true,
                 .trainable_bytes = std::vector<std::size_t>(6, 0)});
  fill(engine);
  engine.prepare();
  forward(engine, 0, 0, 3); // stopped early
  engine.set_forward_only(true);
  for (int pass = 0; pass < 2; ++pass) {
    engine.prepare();
    forward(engine);
  }
  engine.set_forward_only(false);
  engine.prepare();
  forward(engine);
  backward(engine, 0, 0, {5, 3, 4, 2, 1, 0}); // out of order
  engine.synchronize();
  EXPECT_EQ(device->pageable_copies(), 0u);
}

} // namespace
} // namespace blockswap
