// The load pipeline's decode step (load_pipeline_decode.cpp) under the engine: blocks whose
// frozen bytes the host store keeps compressed reach their slots bit for bit, in inference and
// training (trainable bytes raw, written back and loaded again), for less host memory; a damaged
// compressed block is an Error at its wait, never a wrong weight; a slow decode (on the emulated
// device's decode stream) is waited for; the two decode buffers are in the device's memory; the
// timed device spends the decode's time on the decode stream, beside the copies, and the link
// only the compressed bytes'.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "../core/codec_weights.hpp"
#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/device/emulated.hpp"
#include "blockswap/device/timed.hpp"

namespace blockswap {
namespace {

constexpr int64_t kBlocks = 6;
constexpr std::size_t kValues = 64 * 1024; // bf16 values a block: 128 KiB

// Block b: kValues bf16 weights (normal, scale 0.02), then `trainable` bytes of a pattern.
std::vector<std::byte> block_bytes(int64_t b, std::size_t trainable) {
  std::vector<std::byte> bytes =
      codec_testing::weights(codec::DType::bf16, kValues, static_cast<uint32_t>(7 + b));
  for (std::size_t i = 0; i < trainable; ++i) bytes.push_back(std::byte((b * 13 + i) % 251));
  return bytes;
}

EngineOptions options(Compress compress, std::size_t trainable, bool training) {
  EngineOptions o;
  o.blocks_to_swap = 3;
  o.supports_backward = training;
  o.compress = compress;
  o.trainable_bytes.assign(kBlocks, trainable);
  o.frozen_ranges.assign(kBlocks, {codec::Range{0, kValues * 2, codec::DType::bf16}});
  return o;
}

std::vector<std::size_t> sizes(std::size_t trainable) {
  return std::vector<std::size_t>(kBlocks, kValues * 2 + trainable);
}

void fill(Engine& engine, std::size_t trainable) {
  for (int64_t b = 0; b < kBlocks; ++b) {
    const std::vector<std::byte> bytes = block_bytes(b, trainable);
    std::memcpy(engine.host_data(b), bytes.data(), bytes.size());
  }
}

bool slot_holds(Engine& engine, int64_t b, const std::vector<std::byte>& expected) {
  return std::memcmp(engine.device_data(b), expected.data(), expected.size()) == 0;
}

// Every block computed in a forward pass sees its bytes exactly; returns how many did.
int64_t forward_pass_exact(Engine& engine, std::size_t trainable) {
  engine.prepare();
  int64_t exact = 0;
  for (int64_t b = 0; b < kBlocks; ++b) {
    engine.enter(b);
    exact += slot_holds(engine, b, block_bytes(b, trainable)) ? 1 : 0;
    engine.leave(b);
  }
  return exact;
}

TEST(Decode, InferenceLoadsTheCompressedBlocksBitForBit) {
  auto device = std::make_shared<EmulatedDevice>();
  Engine engine(device, sizes(0), options(Compress::on, 0, false));
  engine.set_forward_only(true);
  fill(engine, 0);
  for (int pass = 0; pass < 3; ++pass) EXPECT_EQ(forward_pass_exact(engine, 0), kBlocks);
  const CompressionStats compression = engine.compression();
  EXPECT_EQ(compression.blocks, kBlocks);
  EXPECT_GT(compression.ratio(), 1.2); // bf16 normal weights: about 1.5
  const Stats stats = engine.stats();
  EXPECT_GT(stats.decoded_bytes, 0u);
  EXPECT_LT(stats.compressed_bytes, stats.decoded_bytes);
  for (int64_t b = 0; b < kBlocks; ++b) EXPECT_TRUE(engine.compressed(b));
}

// The decodes slow (2 ms a block) on the emulated device's decode stream: the slot keeps its
// old bytes until each decode ends, so a computation that did not wait for the decode (its load
// event recorded after the copies only) would read them. Every block is still exact.
TEST(Decode, ASlowDecodeIsWaitedForBitForBit) {
  auto device = std::make_shared<EmulatedDevice>(EmulatedDeviceOptions{.decode_gbps = 0.065});
  Engine engine(device, sizes(0), options(Compress::on, 0, true));
  engine.set_forward_only(true);
  fill(engine, 0);
  for (int pass = 0; pass < 3; ++pass) EXPECT_EQ(forward_pass_exact(engine, 0), kBlocks);
  // Blocks loaded and evicted before they compute (a mode switch): the next loads into their
  // slots come after their decodes (Note [slot reuse]).
  engine.prepare();
  engine.set_forward_only(false);
  engine.prepare();
  engine.set_forward_only(false);
  engine.set_forward_only(true);
  EXPECT_EQ(forward_pass_exact(engine, 0), kBlocks);
}

// Compressed weights: two decode buffers of the largest compressed block, allocated by
// compress() through the backend, so the Device and its budget count them.
TEST(Decode, TheTwoDecodeBuffersAreInTheDevicesMemory) {
  auto device = std::make_shared<EmulatedDevice>();
  Engine engine(device, sizes(0), options(Compress::on, 0, false));
  fill(engine, 0);
  const std::size_t before = device->memory().device_bytes;
  engine.compress();
  const std::size_t buffers = engine.compression().decode_buffer_bytes;
  std::size_t largest = 0;
  for (int64_t b = 0; b < kBlocks; ++b) largest = std::max(largest, engine.host_frozen_bytes(b));
  EXPECT_EQ(buffers, 2 * largest);
  EXPECT_EQ(device->memory().device_bytes - before, 2 * layout::align_up(largest));
  Engine raw(device, sizes(0), options(Compress::off, 0, false));
  fill(raw, 0);
  raw.compress();
  EXPECT_EQ(raw.compression().decode_buffer_bytes, 0u);
}

TEST(Decode, HostMemoryShrinksByAboutTheRatio) {
  std::size_t held[2] = {};
  double ratio = 0;
  for (Compress compress : {Compress::off, Compress::on}) {
    auto device = Device::open("emulated");
    Engine engine(device->attach("blocks"), sizes(0), options(compress, 0, false));
    fill(engine, 0);
    engine.compress();
    held[compress == Compress::on] = device->host_memory().kept_bytes;
    if (compress == Compress::on) ratio = engine.compression().ratio();
    EXPECT_EQ(engine.host_bytes(), held[compress == Compress::on]);
  }
  EXPECT_LT(held[1], held[0]);
  // The host holds the compressed bytes (each aligned up) where it held the raw ones.
  EXPECT_NEAR(double(held[0]) / double(held[1]), ratio, 0.02 * ratio);
}

TEST(Decode, TrainingKeepsTrainableBytesRawAndWritesThemBack) {
  constexpr std::size_t kTrainable = 4096;
  auto device = std::make_shared<EmulatedDevice>();
  Engine engine(device, sizes(kTrainable), options(Compress::on, kTrainable, true));
  fill(engine, kTrainable);
  std::vector<std::vector<std::byte>> expected;
  for (int64_t b = 0; b < kBlocks; ++b) expected.push_back(block_bytes(b, kTrainable));
  std::vector<const Buffer*> computed_in(kBlocks); // autograd's saved views point there
  for (int step = 0; step < 3; ++step) {
    engine.prepare();
    for (int64_t b = 0; b < kBlocks; ++b) {
      computed_in[b] = engine.enter(b, {.differentiable = true}).slot.get();
      EXPECT_TRUE(slot_holds(engine, b, expected[b])) << "step " << step << " block " << b;
      engine.leave(b, {.differentiable = true});
    }
    for (int64_t b = kBlocks - 1; b >= 0; --b) {
      engine.acquire_for_backward(b, computed_in[b]);
      EXPECT_TRUE(slot_holds(engine, b, expected[b])) << "backward, step " << step;
      std::byte* trainable = engine.device_data(b) + kValues * 2;
      for (std::size_t i = 0; i < kTrainable; ++i) trainable[i] ^= std::byte(step + 1); // "a step"
      std::memcpy(expected[b].data() + kValues * 2, trainable, kTrainable);
      engine.mark_dirty(b);
      engine.after_backward(b);
    }
    engine.synchronize();
  }
  int64_t off_device = 0; // written back (a block on the device keeps its changes there)
  for (int64_t b = 0; b < kBlocks; ++b) {
    if (engine.is_resident(b)) continue;
    ++off_device;
    EXPECT_EQ(
        std::memcmp(engine.host_trainable(b).data(), expected[b].data() + kValues * 2, kTrainable),
        0)
        << "block " << b;
  }
  EXPECT_GT(off_device, 0);
}

// One byte of a compressed block flipped in its host copy: the pass raises Error at that block's
// wait (its load event follows its decode), or, where the byte is one the decoder never reads
// for the values (a chunk's last bits of padding), every block is exact. Never a wrong weight.
// Returns whether it raised.
bool damaged_pass_raises_or_is_exact(std::size_t at, std::byte flip) {
  auto device = std::make_shared<EmulatedDevice>();
  Engine engine(device, sizes(0), options(Compress::on, 0, false));
  engine.set_forward_only(true);
  fill(engine, 0);
  engine.prepare(); // compresses, and places the blocks the pass starts with
  int64_t damaged = 0;
  while (engine.is_resident(damaged)) ++damaged; // loaded during the pass
  EXPECT_TRUE(engine.compressed(damaged));
  at %= engine.host_frozen_bytes(damaged);
  engine.host_data(damaged)[at] ^= flip;
  for (int64_t b = 0; b < kBlocks; ++b) {
    try {
      engine.enter(b);
    } catch (const Error&) {
      EXPECT_EQ(b, damaged) << "byte " << at;
      return true;
    }
    EXPECT_TRUE(slot_holds(engine, b, block_bytes(b, 0))) << "block " << b << ", byte " << at;
    engine.leave(b);
  }
  return false;
}

TEST(Decode, DamagedCompressedBytesAreAnErrorAtTheBlocksWait) {
  int raised = 0, flips = 0;
  // The header and the segment table, then bytes spread over the codes and the rest bytes.
  for (std::size_t at = 0; at < 64; at += 3, ++flips) {
    raised += damaged_pass_raises_or_is_exact(at, std::byte{0x01}) ? 1 : 0;
  }
  for (std::size_t at = 64; at < 200'000; at += 2111, ++flips) {
    raised += damaged_pass_raises_or_is_exact(at, std::byte{0x20}) ? 1 : 0;
  }
  EXPECT_GE(raised, flips * 9 / 10) << raised << " of " << flips << " flips raised";
}

TEST(Decode, OptionNamesAreCheckedAndTheRangesNeeded) {
  EXPECT_EQ(parse_compress("auto"), Compress::automatic);
  EXPECT_EQ(parse_compress("on"), Compress::on);
  try {
    parse_compress("yes");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("off, on, auto"), std::string::npos);
  }
  EngineOptions o = options(Compress::on, 0, false);
  o.frozen_ranges.pop_back();
  EXPECT_THROW(Engine(std::make_shared<EmulatedDevice>(), sizes(0), o), Error);
  // automatic: off until the planner says when it pays.
  Engine automatic(std::make_shared<EmulatedDevice>(), sizes(0),
                   options(Compress::automatic, 0, false));
  fill(automatic, 0);
  automatic.compress();
  EXPECT_EQ(automatic.compression().blocks, 0);
}

// The timed device holds no bytes: it decodes in modelled time (decoded bytes over its decode
// rate, on the decode stream after the copy it waits for, beside the next copy; on the copy
// stream, in series, where LinkModel::decode_stream is false), and compresses only the sizes it
// is given (compressed_timing_test.cpp).
TEST(Decode, TimedDeviceDecodesBesideTheCopies) {
  for (bool decode_stream : {true, false}) {
    TimedDeviceOptions timed;
    timed.link.bytes_per_second = 1e9;
    timed.link.decode_bytes_per_second = 1e9;
    timed.link.decode_stream = decode_stream;
    auto device = std::make_shared<TimedDevice>(timed);
    Buffer slot = device->allocate_device(1 << 20);
    Buffer compressed = device->allocate_device(1 << 19);
    codec::Parsed parsed;
    parsed.decoded_bytes = 1 << 20;
    const double start = device->finish();
    device->copy_to_device(compressed.data(), nullptr, 1 << 19, 0);
    const auto copied = device->make_event();
    device->record(*copied, Stream::copy);
    device->wait(Stream::decode, *copied);
    device->decode(slot.data(), compressed.data(), 1 << 19, parsed, 0);
    const auto decoded = device->make_event();
    device->record(*decoded, Stream::decode);
    device->copy_to_device(compressed.data(), nullptr, 1 << 19, 1); // the next load's copy
    device->synchronize(*decoded);
    const double decode_end = device->now();
    const double end = device->finish();
    const double copy = (1 << 19) / 1e9, decode = (1 << 20) / 1e9;
    EXPECT_DOUBLE_EQ(device->decode_busy_seconds(), decode);
    EXPECT_DOUBLE_EQ(device->link_busy_seconds(), 2 * copy);   // the decode is not the link's
    EXPECT_GE(decode_end - start, copy + decode * (1 - 1e-9)); // after the copy it waited for
    if (decode_stream) { // the second copy ran during the decode (the host's calls take time)
      EXPECT_LT(end - start, copy + decode + copy / 2);
    } else {
      EXPECT_GE(end - start, 2 * copy + decode * (1 - 1e-9)); // in series
    }
  }
  auto device = std::make_shared<TimedDevice>();
  EXPECT_THROW(Engine(device, sizes(0), options(Compress::on, 0, false)).compress(), Error);
  TimedDeviceOptions negative;
  negative.link.decode_bytes_per_second = -1;
  EXPECT_THROW(TimedDevice{negative}, Error);
}

} // namespace
} // namespace blockswap
