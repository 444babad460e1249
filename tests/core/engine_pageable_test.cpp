// The engine where the system caps page-locked memory: blocks whose host copies are pageable
// are loaded through a pinned staging ring, exactly, and no load makes the host wait for the
// copy stream (Note [pageable host memory] in engine_staging.cpp).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

constexpr std::size_t kFloats = 1024; // 4 KiB per block
constexpr std::size_t kBytes = kFloats * sizeof(float);

float value(int64_t block, std::size_t j, int version = 0) {
  return float(block) * 1e4f + float(j) + float(version) * 0.5f;
}

// A device whose host memory pins at most `blocks` blocks' worth (one slot each here).
std::shared_ptr<EmulatedDevice> capped(std::size_t blocks) {
  return std::make_shared<EmulatedDevice>(
      EmulatedDeviceOptions{.link_gbps = 4.0, .pinnable_bytes = blocks * layout::align_up(kBytes)});
}

void fill(Engine& engine) {
  for (int64_t b = 0; b < engine.blocks(); ++b) {
    auto* host = reinterpret_cast<float*>(engine.host_data(b));
    for (std::size_t j = 0; j < kFloats; ++j) host[j] = value(b, j);
  }
}

// Block `b` on the device holds value(b, j) in its frozen floats and value(b, j, versions[b])
// in its last `trainable` floats.
void expect_on_device(const Engine& engine, int64_t b, std::size_t trainable = 0, int version = 0) {
  const auto* dev = reinterpret_cast<const float*>(engine.device_data(b));
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

TEST(PageableHostMemory, StagingBuffersTakeThePinnedMemoryOfTheLastBlocks) {
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
TEST(PageableHostMemory, PinnedMemoryGoesToTheBlocksThatMove) {
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
TEST(PageableHostMemory, InferenceIsExactAndNoLoadWaitsForTheCopyStream) {
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

TEST(PageableHostMemory, AllPinnedStagesNothing) {
  auto device = std::make_shared<EmulatedDevice>();
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
TEST(PageableHostMemory, TrainingCarriesEveryWriteBackIntoTheNextLoad) {
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
        auto* dev = reinterpret_cast<float*>(engine.device_data(b));
        version[b] = step;
        for (std::size_t j = kFloats - kTrainable; j < kFloats; ++j) dev[j] = value(b, j, step);
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
TEST(PageableHostMemory, FrozenBytesWrittenBetweenPassesReachTheNextLoads) {
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
            auto* dev = reinterpret_cast<float*>(engine.device_data(b));
            for (std::size_t j = 0; j < kFloats; ++j) dev[j] = value(b, j, version + 1);
          }
        }
      }
    }
  }
}

// Orders the schedule did not foresee (a mode switch in the middle of training, a pass
// stopped early) cancel the reads ahead and stay exact.
TEST(PageableHostMemory, UnforeseenOrdersStayExact) {
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
