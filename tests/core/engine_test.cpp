#include "blockswap/core/engine.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>

#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"
#include "engine_fakes.hpp"

namespace blockswap {
namespace {

TEST(Engine, ForwardOnlyLoadsOnlyWhatIsMissing) {
  const FakeModel model = uniform(24);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 6, .rotating_slots = 2});
  model.fill(engine);
  engine.prepare();
  engine.reset_stats();
  for (int pass = 0; pass < 3; ++pass) {
    engine.prepare();
    forward(engine, model);
    if (HasFatalFailure()) return;
    const Stats stats = engine.stats();
    EXPECT_EQ(stats.moves, 8u * (pass + 1));
    EXPECT_EQ(stats.h2d_bytes, 8u * (pass + 1) * 4096 * sizeof(float));
    EXPECT_EQ(stats.d2h_bytes, 0u);
  }
  EXPECT_EQ(engine.stats().peak_device_bytes, 18u * 4096 * sizeof(float));
}

// A mode switched between prepare() and the pass (found by an outside tester): the blocks are
// where the other mode's schedule starts, so the first move fails, and its error says why; the
// next prepare() places them for the new mode.
TEST(Engine, AModeSwitchedAfterPrepareIsNamedAndTheNextPrepareRecovers) {
  const FakeModel model = uniform(7);
  Engine engine(slow_device(0), model.bytes(), {.blocks_to_swap = 2, .supports_backward = true});
  model.fill(engine);
  engine.prepare();
  engine.set_forward_only(true);
  engine.wait_for_block(0);
  try {
    engine.after_forward(0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the mode changed since the last one"), std::string::npos)
        << e.what();
  }
  engine.prepare();
  forward(engine, model);
}

TEST(Engine, TrainingStepLoadsTwoKBlocksAndCopiesNothingBack) {
  const FakeModel model = uniform(24);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 6, .supports_backward = true});
  model.fill(engine);
  engine.prepare();
  engine.reset_stats();
  for (int step = 0; step < 3; ++step) {
    engine.prepare();
    forward(engine, model);
    backward(engine, model);
    if (HasFatalFailure()) return;
  }
  const Stats stats = engine.stats();
  EXPECT_EQ(stats.moves, 3u * 12);
  EXPECT_EQ(stats.h2d_bytes, 3u * 12 * 4096 * sizeof(float));
  EXPECT_EQ(stats.d2h_bytes, 0u);
  EXPECT_EQ(stats.peak_device_bytes, 18u * 4096 * sizeof(float));
}

// EngineOptions::host_memory: the caller's host copies (node-shared weights) are used as they
// are, never copied into or written; nothing of them may change on the device.
TEST(Engine, HostMemoryOfTheCallersIsUsedInPlace) {
  const FakeModel model = uniform(6);
  std::vector<std::vector<std::byte>> storage;
  std::vector<std::shared_ptr<Buffer>> host;
  for (std::size_t bytes : model.bytes()) {
    storage.emplace_back(bytes + 64);
    host.push_back(std::make_shared<Buffer>(storage.back().data(), bytes + 64, nullptr));
  }
  Engine engine(slow_device(), model.bytes(),
                {.blocks_to_swap = 2, .supports_backward = true, .host_memory = host});
  for (int64_t b = 0; b < 6; ++b) ASSERT_EQ(engine.host_data(b), storage[b].data());
  model.fill(engine);
  const auto before = model.snapshot(engine);
  for (int step = 0; step < 2; ++step) {
    engine.prepare();
    forward(engine, model);
    backward(engine, model);
    if (HasFatalFailure()) return;
  }
  engine.synchronize();
  EXPECT_EQ(engine.stats().d2h_bytes, 0u);
  EXPECT_EQ(model.snapshot(engine), before);
  engine.prepare();
  engine.wait_for_block(0);
  EXPECT_THROW(engine.mark_dirty(0), Error); // no trainable bytes: nothing may change

  const auto refused = [&](EngineOptions options, const std::string& words) {
    try {
      Engine bad(slow_device(), model.bytes(), std::move(options));
      ADD_FAILURE() << "accepted: " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused({.host_memory = {host.begin(), host.begin() + 3}}, "one per block");
  refused({.trainable_bytes = std::vector<std::size_t>(6, 4), .host_memory = host},
          "trainable bytes");
  refused({.algorithm = Algorithm::seed, .host_memory = host}, "seed");
  auto small = host;
  small[2] = std::make_shared<Buffer>(storage[2].data(), 8, nullptr);
  refused({.host_memory = small}, "block 2");
}

TEST(Engine, BackwardInTheSchedulesOrderLoadsNothingExtra) {
  for (int64_t k : {1, 3, 6}) {
    const FakeModel model = uniform(8, 1024);
    Engine engine(slow_device(8), model.bytes(), {.blocks_to_swap = k, .supports_backward = true});
    model.fill(engine);
    engine.prepare();
    engine.reset_stats();
    for (int step = 0; step < 3; ++step) {
      engine.prepare();
      const Graph graph = forward_recording(engine, model);
      EXPECT_TRUE(backward_from(engine, model, graph, 7)) << "K=" << k;
    }
    EXPECT_EQ(engine.stats().h2d_bytes, 3u * 2 * k * 1024 * sizeof(float)) << "K=" << k;
    for (int64_t b = 0; b < 8; ++b) EXPECT_EQ(engine.is_resident(b), b < 8 - k);
  }
}

TEST(Engine, BackwardInAnyOrderFindsEveryBlockInItsSlot) {
  for (int64_t k : {1, 3, 6}) {
    for (int64_t last : {0, 2, 5, 7}) {
      const FakeModel model = uniform(8, 1024);
      Engine engine(slow_device(8), model.bytes(),
                    {.blocks_to_swap = k, .supports_backward = true});
      model.fill(engine);
      engine.prepare();
      const Graph first = forward_recording(engine, model);
      engine.prepare(); // a second forward before any backward
      const Graph second = forward_recording(engine, model);
      EXPECT_TRUE(backward_from(engine, model, second, last)) << "K=" << k << " last=" << last;
      EXPECT_TRUE(backward_from(engine, model, first, 7)) << "K=" << k << " last=" << last;
      EXPECT_TRUE(backward_from(engine, model, first, last)) << "K=" << k << " again";
      engine.set_forward_only(true); // a mode change before a backward
      engine.prepare();
      EXPECT_TRUE(backward_from(engine, model, second, 7)) << "K=" << k << " forward-only";
    }
  }
}

TEST(Engine, BackwardIntoAReleasedSlotIsAnError) {
  const FakeModel model = uniform(4, 256);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 2, .supports_backward = true});
  model.fill(engine);
  engine.prepare();
  const Buffer elsewhere;
  EXPECT_THROW(engine.acquire_for_backward(0, &elsewhere), Error);
}

// Note [slot lifetime]: a slot someone still views outlives the engine.
TEST(Engine, SharedSlotsOutliveTheEngine) {
  const FakeModel model = uniform(4, 256);
  std::shared_ptr<Buffer> slot;
  {
    Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 1});
    model.fill(engine);
    engine.prepare();
    engine.wait_for_block(0);
    slot = engine.device_buffer(0);
  }
  const auto* weights = reinterpret_cast<const float*>(slot->data());
  EXPECT_EQ(weights[5], FakeModel::value(0, 5)); // readable, not freed (the sanitizers check)
}

// Slots added while swapping was disabled go at the next prepare, except one still viewed (a
// pending backward's): it stays, empty, until nothing views it.
TEST(Engine, ASlotStillViewedIsKeptUntilNothingViewsIt) {
  const FakeModel model = uniform(6, 256);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 2, .supports_backward = true});
  model.fill(engine);
  engine.disable();
  engine.prepare();
  engine.wait_for_block(5);
  std::shared_ptr<Buffer> viewed = engine.device_buffer(5);
  const uint64_t all = engine.stats().device_bytes;
  engine.enable();
  engine.prepare();
  EXPECT_EQ(engine.stats().device_bytes, all - engine.slot_bytes());
  engine.acquire_for_backward(5, viewed.get());
  EXPECT_EQ(engine.device_buffer(5).get(), viewed.get());
  EXPECT_EQ(model.compute(engine, 5), 0u);
  viewed.reset();
  engine.prepare();
  engine.prepare();
  EXPECT_EQ(engine.stats().device_bytes, 4 * engine.slot_bytes());
  forward(engine, model);
}

// The recompute pass of checkpointing loads a block that is not on the device.
TEST(Engine, TheRecomputePassLoadsABlockThatIsNotResident) {
  const FakeModel model = uniform(6, 256);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 2, .supports_backward = true});
  model.fill(engine);
  engine.prepare();
  const Compute recompute{.differentiable = true, .reentrant_checkpointing = true};
  for (int64_t b = 0; b < 6; ++b) {
    EXPECT_FALSE(engine.enter(b, recompute).recompute); // the first forward
    engine.leave(b, recompute);
  }
  ASSERT_FALSE(engine.is_resident(0));
  for (int64_t b = 5; b >= 0; --b) {
    EXPECT_TRUE(engine.recomputing(b, recompute));
    EXPECT_TRUE(engine.enter(b, recompute).recompute) << b;
    EXPECT_EQ(model.compute(engine, b), 0u) << b;
    engine.leave(b, recompute); // moves nothing
  }
}

TEST(Engine, EveryShapeComputesWithTheRightWeights) {
  for (int64_t n : {1, 2, 3, 5, 8}) {
    for (bool training : {false, true}) {
      const Mode mode = training ? Mode::training : Mode::forward_only;
      for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, mode); ++k) {
        for (Algorithm algorithm : {Algorithm::blockswap, Algorithm::seed}) {
          if (k > Schedule::max_blocks_to_swap(n, mode, algorithm)) continue;
          // Unequal blocks: a slot fits the largest.
          FakeModel model;
          for (int64_t b = 0; b < n; ++b) model.floats.push_back(256 + 64 * std::size_t(b % 3));
          Engine engine(
              slow_device(8.0), model.bytes(),
              {.blocks_to_swap = k, .supports_backward = training, .algorithm = algorithm});
          model.fill(engine);
          const auto before = model.snapshot(engine);
          for (int pass = 0; pass < 2; ++pass) {
            engine.prepare();
            forward(engine, model);
            if (training) backward(engine, model);
            if (HasFatalFailure()) return;
          }
          engine.synchronize();
          EXPECT_EQ(model.snapshot(engine), before) << "host weights changed";
          if (algorithm == Algorithm::seed) {
            EXPECT_EQ(
                engine.stats().d2h_bytes, engine.stats().h2d_bytes - [&] {
                  std::size_t first = 0; // the first prepare's loads are not moves
                  for (int64_t b = 0; b < n - k; ++b) first += model.bytes()[b];
                  return first;
                }());
          }
        }
      }
    }
  }
}

TEST(Engine, SeedReplayMovesEveryBlockAndCopiesBack) {
  const FakeModel model = uniform(24, 1024);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 6, .algorithm = Algorithm::seed});
  model.fill(engine);
  engine.prepare();
  engine.reset_stats();
  forward(engine, model);
  EXPECT_EQ(engine.stats().moves, 24u);
  EXPECT_EQ(engine.stats().d2h_bytes, 24u * 1024 * sizeof(float));
}

TEST(Engine, WaitOrdersComputeAfterTheLoad) {
  // A slow link: block 3 is still in flight when we ask for it, and must arrive whole.
  const FakeModel model = uniform(4, 1 << 20); // 4 MiB blocks at 1 GB/s: ~4 ms each
  Engine engine(slow_device(1.0), model.bytes(), {.blocks_to_swap = 1, .rotating_slots = 1});
  model.fill(engine);
  engine.prepare();
  engine.wait_for_block(0);
  engine.after_forward(0); // rotation {0, 2}: block 2 loads into block 0's slot
  EXPECT_TRUE(engine.is_resident(2));
  EXPECT_FALSE(engine.is_ready(2));
  EXPECT_THROW(engine.device_data(2), Error); // still loading: using it is an error
  engine.wait_for_block(1);
  engine.wait_for_block(2);
  EXPECT_EQ(model.compute(engine, 2), 0u);
  EXPECT_GT(engine.stats().stall_seconds, 0.0);
}

TEST(Engine, UsingABlockThatIsNotResidentIsAnError) {
  // A broken schedule on purpose: block 5 is computed before the move that brings it.
  const FakeModel model = uniform(8);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 3, .rotating_slots = 5});
  model.fill(engine);
  engine.prepare();
  EXPECT_FALSE(engine.is_resident(5));
  try {
    engine.wait_for_block(5);
    FAIL() << "waiting for a block that is not on the device succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("block 5 is not on the device"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(engine.device_data(5), Error);
  EXPECT_THROW(engine.wait_for_block(8), Error);
  EXPECT_THROW(engine.after_forward(-1), Error);
}

TEST(Engine, AReleasedSlotIsPoisoned) {
  // Block 0 is larger than block 2, which replaces it: a stale pointer into block 0's slot
  // reads NaN past block 2's end instead of plausible weights.
  FakeModel model{{4096, 1024, 1024, 1024}};
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 1, .rotating_slots = 1});
  model.fill(engine);
  engine.prepare();
  engine.wait_for_block(0);
  const auto* stale = reinterpret_cast<const float*>(engine.device_data(0));
  engine.after_forward(0);
  engine.synchronize();
  EXPECT_FALSE(engine.is_resident(0));
  EXPECT_EQ(stale[0], FakeModel::value(2, 0)); // the slot now holds block 2
  EXPECT_TRUE(std::isnan(stale[2000]));
}

TEST(Engine, SlotsThatDoNotFitAreOutOfMemory) {
  const FakeModel model = uniform(8, 1024); // 4 KiB blocks; K=2 needs 6 slots = 24 KiB
  auto device = std::make_shared<EmulatedDevice>(EmulatedDeviceOptions{.capacity_bytes = 20480});
  EXPECT_THROW(Engine(device, model.bytes(), {.blocks_to_swap = 2}), OutOfMemory);
  EXPECT_EQ(device->memory().device_bytes, 0u); // nothing leaked
  EXPECT_NO_THROW(Engine(device, model.bytes(), {.blocks_to_swap = 3}));
}

// A fault injected into the copy of block 5 (the first move of a seed-like rotation, N=8,
// K=3) must reach whoever waits for block 5, leave every host byte as it was, and leave the
// engine usable from the next prepare().
void expect_fault_reaches_the_waiter(const std::function<void(EmulatedDevice&)>& inject,
                                     const std::string& message) {
  const FakeModel model = uniform(8);
  auto device = slow_device();
  Engine engine(device, model.bytes(), {.blocks_to_swap = 3, .rotating_slots = 5});
  model.fill(engine);
  const auto before = model.snapshot(engine);
  engine.prepare();
  engine.wait_for_block(0);
  inject(*device);
  engine.after_forward(0); // loads block 5: the fault strikes
  for (int64_t i = 1; i < 5; ++i) {
    engine.wait_for_block(i);
    engine.after_forward(i);
  }
  try {
    engine.wait_for_block(5);
    FAIL() << "the fault did not reach the waiter";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
  EXPECT_FALSE(engine.is_resident(5));
  engine.synchronize();
  EXPECT_EQ(model.snapshot(engine), before);
  // Still usable: the next pass starts from prepare() and computes with the right weights.
  for (int pass = 0; pass < 2; ++pass) {
    engine.prepare();
    forward(engine, model);
  }
}

TEST(Engine, FailedCopyReachesTheWaiterAndLosesNothing) {
  expect_fault_reaches_the_waiter([](EmulatedDevice& d) { d.fail_copy(0); }, "injected failure");
}

// The copy thread itself throwing: the thread survives and nothing hangs.
TEST(Engine, CopyThreadThrowingReachesTheWaiterWithoutHanging) {
  expect_fault_reaches_the_waiter([](EmulatedDevice& d) { d.throw_in_copy_thread(0); },
                                  "injected exception in the copy thread");
}

// One slot for two blocks (N=2, K=1, R=1): block 0 is evicted after its forward and loaded
// again at the end of the pass. Changes made to it on the device and marked dirty come back
// with it, and reach its host copy at synchronize(), whole.
struct ChangedBlock {
  const FakeModel model = uniform(2, 1024);
  std::shared_ptr<EmulatedDevice> device = slow_device();
  Engine engine{device, model.bytes(), {.blocks_to_swap = 1, .rotating_slots = 1}};
  std::vector<float> old_values, new_values;

  ChangedBlock() {
    model.fill(engine);
    const auto* host = reinterpret_cast<const float*>(engine.host_data(0));
    old_values.assign(host, host + 1024);
    for (float v : old_values) new_values.push_back(v + 0.5f);
    engine.prepare();
  }
  // Block 0's forward, which changes its weights on the device.
  void change_block_0() {
    engine.wait_for_block(0);
    std::memcpy(engine.device_data(0), new_values.data(), 1024 * sizeof(float));
    engine.mark_dirty(0);
    engine.after_forward(0); // written back, block 1 loaded into the slot
  }
  std::vector<float> host_values() const {
    const auto* host = reinterpret_cast<const float*>(engine.host_trainable(0).data());
    return {host, host + 1024};
  }
  std::vector<float> device_values() const {
    const auto* dev = reinterpret_cast<const float*>(engine.device_data(0));
    return {dev, dev + 1024};
  }
};

TEST(Engine, AChangedBlockIsWrittenBackAndComesBackWithItsChanges) {
  ChangedBlock t;
  t.engine.reset_stats();
  t.change_block_0();
  t.engine.wait_for_block(1);
  EXPECT_EQ(t.model.compute(t.engine, 1), 0u);
  t.engine.after_forward(1); // block 0 loaded again, from what was written back
  // The next pass, without a synchronize in between: block 0 has its new values.
  t.engine.prepare();
  t.engine.wait_for_block(0);
  EXPECT_EQ(t.device_values(), t.new_values);
  t.engine.after_forward(0); // not changed this time: nothing written back
  t.engine.wait_for_block(1);
  t.engine.after_forward(1);
  t.engine.synchronize();
  EXPECT_EQ(t.host_values(), t.new_values);
  const Stats stats = t.engine.stats();
  EXPECT_EQ(stats.d2h_bytes, 1024 * sizeof(float)); // block 0 once, block 1 never
  // And the host copy keeps them: a prepare after disabling reloads everything from it.
  t.engine.disable();
  t.engine.prepare();
  t.engine.wait_for_block(0);
  EXPECT_EQ(t.device_values(), t.new_values);
}

// Frozen bytes are never copied back: only a block's trainable bytes (the last ones) return,
// and only when it changed. A step of training with K = 2 of N = 4 where blocks 0 and 3 change
// moves 2K loads and the two write-backs of their trainable bytes.
TEST(Engine, OnlyTrainableBytesOfChangedBlocksAreWrittenBack) {
  const FakeModel model = uniform(4, 1024);
  constexpr std::size_t kTrainable = 256 * sizeof(float);
  auto device = slow_device();
  Engine engine(device, model.bytes(),
                {.blocks_to_swap = 2,
                 .supports_backward = true,
                 .trainable_bytes = std::vector<std::size_t>(4, kTrainable)});
  model.fill(engine);
  engine.prepare();
  engine.reset_stats();
  forward(engine, model);
  // Backward in the schedule's order; blocks 3 and 0 change every byte on the device (as a
  // buggy step would), but only their trainable bytes may go back.
  for (int64_t b = 3; b >= 0; --b) {
    engine.wait_for_block(b);
    if (b == 3 || b == 0) {
      auto* dev = reinterpret_cast<float*>(engine.device_data(b));
      for (std::size_t j = 0; j < 1024; ++j) dev[j] = -1.0f - float(j);
      engine.mark_dirty(b);
    }
    engine.after_backward(b);
  }
  engine.prepare(); // the next step: block 3 leaves, block 0 stays
  engine.synchronize();
  const Stats stats = engine.stats();
  EXPECT_EQ(stats.h2d_bytes, 4 * 1024 * sizeof(float)); // 2K loads
  EXPECT_EQ(stats.d2h_bytes, kTrainable);               // block 3's; block 0 has not left
  const auto* frozen3 = reinterpret_cast<const float*>(engine.host_data(3));
  const auto* trainable3 = reinterpret_cast<const float*>(engine.host_trainable(3).data());
  for (std::size_t j = 0; j < 1024; ++j) {
    const float host = j < 768 ? frozen3[j] : trainable3[j - 768];
    const float expected = j < 768 ? FakeModel::value(3, j) : -1.0f - float(j);
    ASSERT_EQ(host, expected) << "float " << j;
  }
  // The next forward: block 0 still holds its changes on the device, and block 3 comes back
  // with its frozen bytes from the host and its trainable ones as written back.
  for (int64_t b = 0; b < 4; ++b) {
    engine.wait_for_block(b);
    const auto* dev = reinterpret_cast<const float*>(engine.device_data(b));
    for (std::size_t j = 0; j < 1024; ++j) {
      const bool changed = b == 0 || (b == 3 && j >= 768);
      ASSERT_EQ(dev[j], changed ? -1.0f - float(j) : FakeModel::value(b, j))
          << "block " << b << " float " << j;
    }
    engine.after_forward(b);
  }
}

TEST(Engine, TrainableBytesAreChecked) {
  const FakeModel model = uniform(3, 64);
  auto device = slow_device();
  EXPECT_THROW(Engine(device, model.bytes(), {.trainable_bytes = {4, 4}}), Error);
  EXPECT_THROW(Engine(device, model.bytes(), {.trainable_bytes = {4, 4, 1000}}), Error);
  Engine engine(device, model.bytes(), {.trainable_bytes = {0, 64, 0}});
  engine.prepare();
  engine.wait_for_block(0);
  try {
    engine.mark_dirty(0);
    FAIL() << "a block with no trainable bytes was marked dirty";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no trainable bytes"), std::string::npos) << e.what();
  }
  engine.wait_for_block(1);
  engine.mark_dirty(1);
}

void expect_failed_write_back_keeps_the_old_values(
    const std::function<void(EmulatedDevice&)>& inject, const std::string& message) {
  ChangedBlock t;
  inject(*t.device); // the next copy: block 0's write-back
  try {
    // A block changed and evicted in a forward pass: its host copy is committed at the
    // eviction (Note [write-back before the forward]), where the failure is reported.
    t.change_block_0();
    t.engine.wait_for_block(1);
    t.engine.after_forward(1);
    t.engine.synchronize();
    FAIL() << "the failed write-back was not reported";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(message), std::string::npos) << what;
    EXPECT_NE(what.find("block(s) 0"), std::string::npos) << what;
  }
  t.engine.synchronize();                   // nothing left to fail
  EXPECT_EQ(t.host_values(), t.old_values); // all old, no byte of the new values
  // Still usable: the next pass computes with the host copy's values.
  for (int pass = 0; pass < 2; ++pass) {
    t.engine.prepare();
    forward(t.engine, t.model);
  }
}

TEST(Engine, AFailedWriteBackKeepsTheOldValuesAndNamesTheBlock) {
  expect_failed_write_back_keeps_the_old_values([](EmulatedDevice& d) { d.fail_copy(0); },
                                                "injected failure");
}

// The link drops half-way through the write-back: half the new bytes have arrived. The host
// copy still holds every old value, none of the new ones.
TEST(Engine, AWriteBackThatFailsHalfWayLeavesNoMix) {
  expect_failed_write_back_keeps_the_old_values(
      [](EmulatedDevice& d) { d.fail_copy(0, 512 * sizeof(float)); }, "injected failure");
}

TEST(Engine, AWriteBackWhoseCopyThreadThrowsKeepsTheOldValues) {
  expect_failed_write_back_keeps_the_old_values(
      [](EmulatedDevice& d) { d.throw_in_copy_thread(0); }, "injected exception");
}

TEST(Engine, DisableKeepsEveryBlockOnTheDevice) {
  const FakeModel model = uniform(6, 1024);
  const std::size_t slot = 1024 * sizeof(float);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 4, .supports_backward = true});
  model.fill(engine);
  engine.disable();
  engine.prepare();
  for (int64_t b = 0; b < 6; ++b) EXPECT_TRUE(engine.is_ready(b));
  engine.reset_stats();
  forward(engine, model);
  backward(engine, model);
  EXPECT_EQ(engine.stats().moves, 0u);
  EXPECT_EQ(engine.stats().device_bytes, 6 * slot);
  engine.enable();
  engine.prepare();
  EXPECT_EQ(engine.stats().device_bytes, 2 * slot);
  EXPECT_EQ(engine.stats().peak_device_bytes, 6 * slot);
  forward(engine, model);
  backward(engine, model);
  EXPECT_EQ(engine.stats().moves, 8u);
}

TEST(Engine, ForwardOnlyFlipDuringTraining) {
  const FakeModel model = uniform(8, 512);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 3, .supports_backward = true});
  model.fill(engine);
  for (int round = 0; round < 2; ++round) {
    engine.set_forward_only(false);
    engine.prepare();
    forward(engine, model);
    backward(engine, model);
    engine.set_forward_only(true); // e.g. sampling in the middle of training
    engine.prepare();
    forward(engine, model);
    forward(engine, model); // a second pass without prepare: the rotation carries on
  }
  Engine inference(slow_device(), model.bytes(), {.blocks_to_swap = 3});
  EXPECT_THROW(inference.set_forward_only(false), Error);
}

TEST(Engine, MovesWithoutPrepareAreAnError) {
  const FakeModel model = uniform(8, 512);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 3});
  model.fill(engine);
  EXPECT_THROW(engine.after_forward(0), Error); // nothing is on the device yet
}

TEST(Engine, DebugPrintsMovesAndWaits) {
  const FakeModel model = uniform(4, 512);
  std::vector<std::string> lines;
  Engine engine(slow_device(), model.bytes(),
                {.blocks_to_swap = 1,
                 .rotating_slots = 3,
                 .debug = true,
                 .log = [&](const std::string& l) { lines.push_back(l); }},
                "double_blocks");
  model.fill(engine);
  engine.prepare();
  forward(engine, model);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0], "[double_blocks] Move block 0 to host and block 3 to emulated");
  bool waited = false;
  for (const auto& line : lines)
    waited |= line.rfind("[double_blocks] Waited for block 3: ", 0) == 0;
  EXPECT_TRUE(waited);
}

// Note [write-back before the forward]: blocks changed in backward that stay on the device and
// that the next forward evicts are written back at the end of the backward; the forward binds
// them to their new host copy as it evicts them, with no write-back then and no synchronize.
TEST(Engine, ChangedBlocksTheForwardEvictsAreWrittenBackBeforeIt) {
  struct Recorder : ResidencyListener {
    std::vector<std::string> events;
    void on_ready(int64_t, const std::shared_ptr<Buffer>&) override {}
    void on_evicted(int64_t b) override { events.push_back("evicted " + std::to_string(b)); }
    void on_written_back(int64_t b, const HostRegion&) override {
      events.push_back("written back " + std::to_string(b));
    }
  } recorder;
  const FakeModel model = uniform(4, 1024);
  constexpr std::size_t kTrainable = 256 * sizeof(float);
  Engine engine(slow_device(), model.bytes(),
                {.blocks_to_swap = 2,
                 .supports_backward = true,
                 .trainable_bytes = std::vector<std::size_t>(4, kTrainable)});
  model.fill(engine);
  engine.set_listener(&recorder);
  engine.prepare();
  forward(engine, model);
  for (int64_t b = 3; b >= 0; --b) {
    engine.wait_for_block(b);
    if (b <= 1) { // blocks 0 and 1 stay on the device; the next forward evicts both
      auto* dev = reinterpret_cast<float*>(engine.device_data(b));
      for (std::size_t j = 768; j < 1024; ++j) dev[j] = -1.0f - float(j);
      engine.mark_dirty(b);
    }
    engine.after_backward(b);
  }
  engine.synchronize();
  engine.reset_stats();
  recorder.events.clear();
  engine.write_back_early();
  EXPECT_EQ(engine.stats().d2h_bytes, 2 * kTrainable);
  EXPECT_FALSE(engine.writing_back()); // both are on the device: their tensors read it
  engine.prepare();
  for (int64_t b = 0; b < 2; ++b) {
    engine.wait_for_block(b);
    engine.after_forward(b); // evicts block b
    const auto* trainable = reinterpret_cast<const float*>(engine.host_trainable(b).data());
    for (std::size_t j = 0; j < 256; ++j) {
      ASSERT_EQ(trainable[j], -1.0f - float(768 + j)) << "block " << b << " float " << j;
    }
  }
  const std::vector<std::string> expected{"written back 0", "evicted 0", "written back 1",
                                          "evicted 1"};
  EXPECT_EQ(recorder.events, expected);
  EXPECT_EQ(engine.stats().d2h_bytes, 2 * kTrainable); // nothing more at the evictions
}

TEST(Engine, ListenerSeesReadyAndEvicted) {
  struct Recorder : ResidencyListener {
    std::vector<std::string> events;
    void on_ready(int64_t b, const std::shared_ptr<Buffer>&) override {
      events.push_back("ready " + std::to_string(b));
    }
    void on_evicted(int64_t b) override { events.push_back("evicted " + std::to_string(b)); }
  } recorder;
  const FakeModel model = uniform(3, 256);
  Engine engine(slow_device(), model.bytes(), {.blocks_to_swap = 1, .rotating_slots = 2});
  engine.set_listener(&recorder);
  engine.prepare();
  engine.wait_for_block(0);
  engine.after_forward(0);
  engine.wait_for_block(2);
  const std::vector<std::string> expected{"ready 0", "ready 1", "evicted 0", "ready 2"};
  EXPECT_EQ(recorder.events, expected);
}

TEST(Engine, EmptyModelIsAnError) {
  EXPECT_THROW(Engine(slow_device(), {}, {}), Error);
}

} // namespace
} // namespace blockswap

namespace blockswap {
namespace {

TEST(Engine, TraceRecordsEveryCopy) {
  const FakeModel model = uniform(6, 1024);
  auto trace = std::make_shared<Trace>();
  Engine engine(slow_device(), model.bytes(),
                {.blocks_to_swap = 2, .rotating_slots = 1, .trace = trace});
  model.fill(engine);
  engine.prepare();       // 4 loads
  forward(engine, model); // 3 moves
  engine.synchronize();
  const std::string json = trace->to_chrome_json();
  EXPECT_GE(trace->size(), 7u);
  EXPECT_NE(json.find("load block 5"), std::string::npos);
}

} // namespace
} // namespace blockswap

namespace blockswap {
namespace {

// In the steady state prepare() copies nothing and does not wait: the load of block 0 that
// the last pass started (rotation {0, 2}) is still in flight, and wait_for_block orders it.
TEST(Engine, SteadyStatePrepareDoesNotWait) {
  const FakeModel model = uniform(4, 4 << 20); // 16 MiB blocks at 1 GB/s: 17 ms a load
  Engine engine(slow_device(1.0), model.bytes(), {.blocks_to_swap = 1, .rotating_slots = 1});
  model.fill(engine);
  engine.prepare();
  forward(engine, model); // ends by loading block 0 for the next pass
  const auto start = std::chrono::steady_clock::now();
  engine.prepare();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 0.005) << "prepare waited for the copy";
  EXPECT_TRUE(engine.is_resident(0));
  EXPECT_FALSE(engine.is_ready(0));
  forward(engine, model); // waits for block 0, computes with the right weights
}

} // namespace
} // namespace blockswap
