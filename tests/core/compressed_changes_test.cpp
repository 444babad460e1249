// Note [changed compressed weights] (core/host_store.cpp): a compressed block's frozen bytes
// replaced between passes are encoded again (or stored raw where they no longer shrink) and load
// bit for bit, its trainable bytes kept; the decode buffer counts in the engine's device bytes.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "../core/codec_weights.hpp"
#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

constexpr int64_t kBlocks = 6;
constexpr std::size_t kValues = 32 * 1024; // bf16 values a block
constexpr std::size_t kTrainable = 512;

std::vector<std::byte> frozen(uint32_t seed) {
  return codec_testing::weights(codec::DType::bf16, kValues, seed);
}

std::vector<std::byte> trainable(int64_t b) {
  std::vector<std::byte> bytes(kTrainable);
  for (std::size_t i = 0; i < kTrainable; ++i) bytes[i] = std::byte((b * 29 + i) % 253);
  return bytes;
}

std::unique_ptr<Engine> make(Compress compress) {
  EngineOptions o;
  o.blocks_to_swap = 3;
  o.supports_backward = false;
  o.compress = compress;
  o.trainable_bytes.assign(kBlocks, kTrainable);
  o.frozen_ranges.assign(kBlocks, {codec::Range{0, kValues * 2, codec::DType::bf16}});
  auto engine =
      std::make_unique<Engine>(std::make_shared<EmulatedDevice>(),
                               std::vector<std::size_t>(kBlocks, kValues * 2 + kTrainable), o);
  engine->set_forward_only(true);
  for (int64_t b = 0; b < kBlocks; ++b) {
    const std::vector<std::byte> f = frozen(static_cast<uint32_t>(b + 1));
    std::memcpy(engine->host_data(b), f.data(), f.size());
    const std::vector<std::byte> t = trainable(b);
    std::memcpy(engine->host_data(b) + f.size(), t.data(), t.size());
  }
  engine->compress();
  return engine;
}

// A pass; true when every block's slot held `expected[b]` then its trainable bytes.
bool pass_exact(Engine& engine, const std::vector<std::vector<std::byte>>& expected) {
  engine.prepare();
  bool exact = true;
  for (int64_t b = 0; b < kBlocks; ++b) {
    engine.enter(b);
    const std::byte* slot = engine.device_data(b);
    exact = exact && std::memcmp(slot, expected[b].data(), expected[b].size()) == 0 &&
            std::memcmp(slot + expected[b].size(), trainable(b).data(), kTrainable) == 0;
    engine.leave(b);
  }
  return exact;
}

TEST(CompressedChanges, NewFrozenBytesAreEncodedAgainOrStoredRawAndLoadExactly) {
  const std::unique_ptr<Engine> made = make(Compress::on);
  Engine& engine = *made;
  std::vector<std::vector<std::byte>> expected;
  for (int64_t b = 0; b < kBlocks; ++b) expected.push_back(frozen(static_cast<uint32_t>(b + 1)));
  ASSERT_TRUE(pass_exact(engine, expected));
  int64_t off = kBlocks - 1; // swapped: off the device between passes
  while (off > 0 && engine.is_resident(off)) --off;
  ASSERT_FALSE(engine.is_resident(off));
  ASSERT_TRUE(engine.compressed(off));
  const std::size_t decode_buffer = engine.compression().decode_buffer_bytes;
  // Other weights, as compressible: compressed again.
  expected[off] = frozen(99);
  EXPECT_TRUE(engine.replace_frozen(off, expected[off]));
  EXPECT_TRUE(engine.compressed(off));
  EXPECT_TRUE(pass_exact(engine, expected));
  EXPECT_TRUE(pass_exact(engine, expected));
  // Noise does not shrink: stored raw, still exact.
  std::mt19937 random(5);
  for (std::byte& x : expected[off]) x = std::byte(random() & 0xff);
  EXPECT_FALSE(engine.replace_frozen(off, expected[off]));
  EXPECT_FALSE(engine.compressed(off));
  EXPECT_TRUE(pass_exact(engine, expected));
  EXPECT_EQ(engine.compression().blocks, kBlocks - 1);
  EXPECT_EQ(engine.compression().decode_buffer_bytes, decode_buffer);
  // A block stored raw is not compressed: nothing to replace.
  EXPECT_THROW(engine.replace_frozen(off, expected[off]), Error);
  EXPECT_THROW(engine.replace_frozen(0, std::span<const std::byte>(expected[0]).first(8)), Error);
}

TEST(CompressedChanges, DeviceBytesCountTheDecodeBuffer) {
  const std::unique_ptr<Engine> made_off = make(Compress::off), made_on = make(Compress::on);
  Engine &off = *made_off, &on = *made_on;
  std::vector<std::vector<std::byte>> expected;
  for (int64_t b = 0; b < kBlocks; ++b) expected.push_back(frozen(static_cast<uint32_t>(b + 1)));
  ASSERT_TRUE(pass_exact(off, expected));
  ASSERT_TRUE(pass_exact(on, expected));
  const std::size_t decode = on.compression().decode_buffer_bytes;
  ASSERT_GT(decode, 0u);
  EXPECT_EQ(on.stats().device_bytes, off.stats().device_bytes + decode);
  EXPECT_EQ(on.stats().peak_device_bytes, off.stats().peak_device_bytes + decode);
}

} // namespace
} // namespace blockswap
