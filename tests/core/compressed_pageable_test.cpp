// Compressed weights in host memory the system would not pin (Note [compressed host copies] in
// core/host_store.cpp, Note [pageable host memory] in load_pipeline.cpp): on the emulated
// device with pinning capped, the pageable blocks are stored compressed too, read compressed
// into the staging ring, and decoded on the device into their slots bit for bit, in inference
// and training, in any order; a slow decode is waited for; a damaged block is an Error at its
// wait; changed frozen weights are encoded again and the reader follows them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "../core/codec_weights.hpp"
#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

constexpr int64_t kBlocks = 6;
constexpr std::size_t kValues = 32 * 1024; // bf16 values a block: 64 KiB
constexpr std::size_t kFrozen = kValues * 2;
constexpr std::size_t kTrainable = 2048;
constexpr std::size_t kBytes = kFrozen + kTrainable;

std::vector<std::byte> frozen(int64_t b, int version = 0) {
  return codec_testing::weights(codec::DType::bf16, kValues,
                                static_cast<uint32_t>(11 + b + 100 * version));
}

// Block b's packed bytes: its frozen weights at `version`, then its trainable bytes at `step`.
std::vector<std::byte> packed(int64_t b, int version = 0, int step = 0) {
  std::vector<std::byte> bytes = frozen(b, version);
  for (std::size_t i = 0; i < kTrainable; ++i)
    bytes.push_back(std::byte((b * 31 + i + step) % 241));
  return bytes;
}

struct Made {
  std::shared_ptr<EmulatedDevice> device;
  std::unique_ptr<Engine> engine;
  std::vector<bool> pageable; // per block, before compress()
  std::vector<std::vector<std::byte>> expected;
};

// K 3 of 6, pinning capped at `pinnable` blocks' worth (the staging ring's two buffers take two
// of them), the host copies filled and compressed.
Made make(std::size_t pinnable, bool training, Compress compress = Compress::on,
          double decode_gbps = 0) {
  Made m;
  m.device = std::make_shared<EmulatedDevice>(EmulatedDeviceOptions{
      .pinnable_bytes = pinnable * layout::align_up(kBytes), .decode_gbps = decode_gbps});
  EngineOptions o;
  o.blocks_to_swap = 3;
  o.supports_backward = training;
  o.compress = compress;
  o.trainable_bytes.assign(kBlocks, kTrainable);
  o.frozen_ranges.assign(kBlocks, {codec::Range{0, kFrozen, codec::DType::bf16}});
  m.engine = std::make_unique<Engine>(m.device, std::vector<std::size_t>(kBlocks, kBytes), o);
  for (int64_t b = 0; b < kBlocks; ++b) {
    m.pageable.push_back(m.engine->host_buffer(b)->pageable());
    m.expected.push_back(packed(b));
    std::memcpy(m.engine->host_data(b), m.expected[b].data(), kBytes);
  }
  m.engine->compress();
  return m;
}

bool slot_holds(Engine& engine, int64_t b, const std::vector<std::byte>& expected) {
  return std::memcmp(engine.device_data(b), expected.data(), expected.size()) == 0;
}

// A forward pass over `blocks`, each checked; returns how many were exact.
int64_t forward(Made& m, const std::vector<int64_t>& blocks) {
  int64_t exact = 0;
  for (int64_t b : blocks) {
    m.engine->enter(b);
    exact += slot_holds(*m.engine, b, m.expected[b]) ? 1 : 0;
    m.engine->leave(b);
  }
  return exact;
}

const std::vector<int64_t> kAll = {0, 1, 2, 3, 4, 5};

TEST(CompressedPageable, PageableBlocksAreStoredCompressedAndTheHostMemoryIsSaved) {
  for (std::size_t pinnable : {2, 3}) { // every block pageable; one pinned, the rest not
    SCOPED_TRACE(pinnable);
    Made raw = make(pinnable, false, Compress::off);
    Made m = make(pinnable, false);
    const int64_t pageable = std::count(m.pageable.begin(), m.pageable.end(), true);
    EXPECT_GE(pageable, kBlocks - 1);
    std::size_t largest = 0;
    for (int64_t b = 0; b < kBlocks; ++b) {
      // (The pinned block's new buffer finds no pinned memory left: it stays raw.)
      if (!m.pageable[b]) continue;
      EXPECT_TRUE(m.engine->compressed(b)) << "pageable block " << b;
      EXPECT_LT(m.engine->host_frozen_bytes(b), kFrozen * 9 / 10) << "pageable block " << b;
      largest = std::max(largest, m.engine->host_frozen_bytes(b));
    }
    EXPECT_GE(m.engine->compression().blocks, pageable);
    // The raw buffers were freed: the host holds the compressed bytes.
    EXPECT_LT(double(m.engine->host_bytes()), 0.85 * double(raw.engine->host_bytes()));
    // The decode buffers hold the largest compressed block, pageable ones included.
    EXPECT_EQ(m.engine->compression().decode_buffer_bytes, 2 * largest);
    m.engine->set_forward_only(true);
    for (int pass = 0; pass < 3; ++pass) {
      m.engine->prepare();
      EXPECT_EQ(forward(m, kAll), kBlocks) << "pass " << pass;
    }
    m.engine->synchronize();
    const Stats stats = m.engine->stats();
    EXPECT_GT(stats.staged_bytes, 0u);
    // Every staged load crossed compressed: what decoded covers what was staged.
    EXPECT_GE(stats.decoded_bytes, stats.staged_bytes / kBytes * kFrozen);
    EXPECT_LT(stats.compressed_bytes, stats.decoded_bytes * 9 / 10);
    EXPECT_EQ(m.device->pageable_copies(), 0u); // no load made the host wait
  }
}

// Full fine-tuning's trainable bytes (never compressed) ride behind the compressed frozen
// bytes in the staging buffer; each backward changes them on the device, and the next load of
// the block carries them. Orders the schedule did not foresee (another backward order, a pass
// stopped early, mode switches) stay exact.
TEST(CompressedPageable, TrainingIsBitForBitInEveryOrder) {
  Made m = make(2, true);
  for (int64_t b = 0; b < kBlocks; ++b) ASSERT_TRUE(m.pageable[b] && m.engine->compressed(b));
  Engine& engine = *m.engine;
  const std::vector<std::vector<int64_t>> backward_orders = {
      {5, 4, 3, 2, 1, 0}, {5, 3, 4, 2, 1, 0}, {5, 4, 3, 2, 1, 0}};
  for (int step = 1; step <= 3; ++step) {
    engine.prepare();
    EXPECT_EQ(forward(m, kAll), kBlocks) << "step " << step;
    for (int64_t b : backward_orders[step - 1]) {
      engine.wait_for_block(b);
      EXPECT_TRUE(slot_holds(engine, b, m.expected[b])) << "backward, step " << step << " " << b;
      m.expected[b] = packed(b, 0, step);
      std::memcpy(engine.device_data(b) + kFrozen, m.expected[b].data() + kFrozen, kTrainable);
      engine.mark_dirty(b);
      engine.after_backward(b);
    }
    engine.synchronize();
  }
  engine.prepare();
  EXPECT_EQ(forward(m, {0, 1, 2}), 3); // stopped early
  engine.set_forward_only(true);
  engine.prepare();
  EXPECT_EQ(forward(m, {0, 1, 2, 3}), 4); // stopped early
  engine.prepare();
  EXPECT_EQ(forward(m, kAll), kBlocks);
  engine.set_forward_only(false);
  engine.prepare();
  EXPECT_EQ(forward(m, kAll), kBlocks);
  engine.synchronize();
  EXPECT_GT(engine.stats().staged_bytes, 0u);
  EXPECT_GT(engine.stats().decoded_bytes, 0u);
}

// Decodes slowed (about 1 ms a block): a computation that did not wait for the decode out of
// the staging copy would read the slot's old bytes.
TEST(CompressedPageable, ASlowDecodeIsWaitedFor) {
  Made m = make(2, true, Compress::on, 0.065);
  Engine& engine = *m.engine;
  for (int64_t b = 0; b < kBlocks; ++b) ASSERT_TRUE(m.pageable[b] && engine.compressed(b));
  engine.set_forward_only(true);
  for (int pass = 0; pass < 3; ++pass) {
    engine.prepare();
    EXPECT_EQ(forward(m, kAll), kBlocks) << "pass " << pass;
  }
  // Blocks loaded and evicted before they compute (mode switches): the next loads into their
  // slots come after their decodes.
  engine.prepare();
  engine.set_forward_only(false);
  engine.prepare();
  engine.set_forward_only(false);
  engine.set_forward_only(true);
  engine.prepare();
  EXPECT_EQ(forward(m, kAll), kBlocks);
}

// Bytes of a pageable block's compressed copy flipped between passes: the next pass raises
// Error at that block's wait, the blocks before it exact.
TEST(CompressedPageable, DamagedCompressedBytesAreAnErrorAtTheBlocksWait) {
  for (std::size_t at : {std::size_t{5}, std::size_t{20'000}}) {
    Made m = make(2, false);
    Engine& engine = *m.engine;
    engine.set_forward_only(true);
    engine.prepare();
    ASSERT_EQ(forward(m, kAll), kBlocks);
    int64_t damaged = 0;
    while (engine.is_resident(damaged)) ++damaged; // loaded during the next pass
    ASSERT_TRUE(m.pageable[damaged] && engine.compressed(damaged));
    for (std::size_t i = at; i < at + 3 * 4099; i += 4099)
      engine.host_data(damaged)[i] ^= std::byte{0x20};
    engine.prepare();
    bool raised = false;
    for (int64_t b = 0; b < kBlocks && !raised; ++b) {
      try {
        engine.enter(b);
      } catch (const Error&) {
        EXPECT_EQ(b, damaged) << "byte " << at;
        raised = true;
        continue;
      }
      EXPECT_TRUE(slot_holds(engine, b, m.expected[b])) << "block " << b;
      engine.leave(b);
    }
    EXPECT_TRUE(raised) << "byte " << at;
  }
}

// Note [changed compressed weights]: new frozen bytes of a pageable block, between passes and
// in the middle of one (its read ahead held and made again), are encoded again or stored raw;
// the staging ring reads them where they are now.
TEST(CompressedPageable, ChangedFrozenWeightsAreReadFromTheirNewPlace) {
  Made m = make(2, false);
  Engine& engine = *m.engine;
  engine.set_forward_only(true);
  engine.prepare();
  ASSERT_EQ(forward(m, kAll), kBlocks);
  int64_t off = kBlocks - 1;
  while (engine.is_resident(off)) --off;
  m.expected[off] = packed(off, 1);
  EXPECT_TRUE(engine.replace_frozen(off, std::span(m.expected[off]).first(kFrozen)));
  EXPECT_TRUE(engine.compressed(off));
  for (int pass = 0; pass < 2; ++pass) {
    engine.prepare();
    EXPECT_EQ(forward(m, kAll), kBlocks) << "pass " << pass;
  }
  // Mid-pass: a block not loaded yet, maybe read ahead of its load while block 1 computes.
  engine.prepare();
  EXPECT_EQ(forward(m, {0, 1}), 2);
  int64_t later = kBlocks - 1;
  while (later > 1 && engine.is_resident(later)) --later;
  ASSERT_GT(later, 1);
  m.expected[later] = packed(later, 2);
  EXPECT_TRUE(engine.replace_frozen(later, std::span(m.expected[later]).first(kFrozen)));
  EXPECT_EQ(forward(m, {2, 3, 4, 5}), 4);
  // Noise does not shrink: stored raw, still exact, through the ring.
  std::mt19937 random(3);
  for (std::size_t i = 0; i < kFrozen; ++i) m.expected[off][i] = std::byte(random() & 0xff);
  EXPECT_FALSE(engine.replace_frozen(off, std::span(m.expected[off]).first(kFrozen)));
  EXPECT_FALSE(engine.compressed(off));
  for (int pass = 0; pass < 2; ++pass) {
    engine.prepare();
    EXPECT_EQ(forward(m, kAll), kBlocks) << "raw, pass " << pass;
  }
  EXPECT_EQ(m.device->pageable_copies(), 0u);
}

} // namespace
} // namespace blockswap
