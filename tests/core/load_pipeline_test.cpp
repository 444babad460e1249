// LoadPipeline alone, as the engine drives it: each tier's bytes reach the slot exactly (pinned
// host memory copied as it is, pageable memory and the file through the staging ring), reads
// run ahead in the schedule's order, a failed read is raised where the block is finished and
// tells the owner, an eviction's host writes are never overtaken by a copy ahead.
#include "blockswap/core/load_pipeline.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t kBytes = 4096;

std::byte pattern(int64_t block, std::size_t i) {
  return std::byte((block * 31 + static_cast<int64_t>(i)) % 251);
}

void fill(HostStore& store) {
  for (int64_t b = 0; b < store.blocks(); ++b) {
    if (store.tier(b) == HostStore::Tier::file) continue;
    for (std::size_t i = 0; i < store.bytes(b); ++i) store.buffer(b)->data()[i] = pattern(b, i);
  }
}

// Block b's bytes as the file holds them: one range each, after 7 bytes of junk.
struct File {
  fs::path path;
  std::vector<FileBlock> blocks;
  explicit File(int64_t n) {
    const fs::path dir =
        fs::temp_directory_path() / ("blockswap-load-pipeline-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    path = dir / "model.bin";
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write("0123456", 7);
    for (int64_t b = 0; b < n; ++b) {
      blocks.push_back(
          FileBlock{{FileRange{static_cast<uint64_t>(out.tellp()), kBytes, 0}}, kBytes});
      for (std::size_t i = 0; i < kBytes; ++i) out.put(static_cast<char>(pattern(b, i)));
    }
  }
  ~File() { fs::remove_all(path.parent_path()); }
};

struct Fixture {
  std::shared_ptr<EmulatedDevice> device;
  HostStore store;
  std::vector<int64_t> priority;
  int failures = 0;
  LoadPipeline pipeline;
  Buffer slot;

  Fixture(int64_t n, EmulatedDeviceOptions options, const std::optional<FileTier>& file = {},
          std::vector<bool> in_file = {})
      : device(std::make_shared<EmulatedDevice>(options)),
        store(device, std::vector<std::size_t>(n, kBytes), std::vector<std::size_t>(n, 0), {},
              "blocks", in_file),
        priority(order(n)),
        pipeline(device, store, file, priority, kBytes, "blocks", [this] { ++failures; }),
        slot(device->allocate_device(kBytes)) {
    fill(store); // as the engine's caller does: after the ring may have moved pinned memory
  }
  static std::vector<int64_t> order(int64_t n) {
    std::vector<int64_t> out;
    for (int64_t b = 0; b < n; ++b) out.push_back(b);
    return out;
  }
  // Loads block b into the slot, waits for it, and counts the bytes that differ.
  std::size_t load(int64_t block) {
    const auto done = device->make_event();
    pipeline.copy_into(block, slot.data(), *done); // records `done` where the load ends
    device->synchronize(*done); // the slot outlives the copy, also when the read failed
    pipeline.finish(block);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < kBytes; ++i) wrong += slot.data()[i] != pattern(block, i);
    return wrong;
  }
};

TEST(LoadPipeline, PinnedBlocksAreCopiedAsTheyAreWithoutTheRing) {
  Fixture f(3, {});
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(f.store.tier(b), HostStore::Tier::pinned);
    EXPECT_FALSE(f.pipeline.staged(b));
  }
  f.pipeline.start_pass({0, 1});
  for (int64_t b : {2, 0, 1}) EXPECT_EQ(f.load(b), 0u) << b;
  EXPECT_EQ(f.pipeline.counters().staged_bytes + f.pipeline.counters().disk_bytes, 0u);
}

TEST(LoadPipeline, PageableBlocksGoThroughTheRingExactlyInAnyOrder) {
  Fixture f(4, EmulatedDeviceOptions{.pinnable_bytes = 2 * kBytes});
  int64_t pageable = 0;
  for (int64_t b = 0; b < 4; ++b) {
    pageable += f.store.tier(b) == HostStore::Tier::pageable ? 1 : 0;
    EXPECT_EQ(f.pipeline.staged(b), f.store.tier(b) != HostStore::Tier::pinned) << b;
  }
  EXPECT_GE(pageable, 2); // the ring took pinned memory too: its blocks are staged in turn
  f.pipeline.start_pass({3, 2, 1, 0});
  for (int64_t b : {3, 2, 1, 0, 0, 3}) EXPECT_EQ(f.load(b), 0u) << b; // the last two unforeseen
  EXPECT_GT(f.pipeline.counters().staged_bytes, 0u);
  EXPECT_EQ(f.pipeline.counters().disk_bytes, 0u);
  f.pipeline.reset_counters();
  EXPECT_EQ(f.pipeline.counters().staged_bytes, 0u);
}

TEST(LoadPipeline, FileBlocksAreReadInTheSchedulesOrderAndCountedAsDiskBytes) {
  const File file(4);
  const FileTier tier{{file.path.string()}, file.blocks, 0, 2, CacheBypass::drop};
  Fixture f(4, {}, tier, {false, true, true, true});
  EXPECT_EQ(f.store.tier(0), HostStore::Tier::pinned);
  EXPECT_EQ(f.store.buffer(1), nullptr);
  const Schedule schedule(ScheduleOptions{4, 2, Mode::forward_only, 0, Algorithm::blockswap});
  f.pipeline.plan(schedule);
  f.pipeline.start_pass({1});
  for (int64_t b : {1, 0, 2, 3, 1, 3}) EXPECT_EQ(f.load(b), 0u) << b;
  EXPECT_EQ(f.pipeline.counters().disk_bytes, 5 * kBytes);
  EXPECT_EQ(f.failures, 0);
}

TEST(LoadPipeline, AFailedReadIsRaisedWhereTheBlockFinishesAndTellsTheOwner) {
  const File file(2);
  const FileTier tier{{file.path.string()}, file.blocks, 0, 1, CacheBypass::drop};
  Fixture f(2, {}, tier, {true, true});
  f.pipeline.start_pass({0});
  EXPECT_EQ(f.load(0), 0u);
  fs::resize_file(file.path, 7 + kBytes + 10); // block 1 is cut short under the run
  try {
    f.load(1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.bin"), std::string::npos) << e.what();
  }
  EXPECT_EQ(f.failures, 1);
}

TEST(LoadPipeline, AnEvictionRunsWithNoCopyAheadOfItsBlockAndItsErrorPassesThrough) {
  Fixture f(3, EmulatedDeviceOptions{.pinnable_bytes = 0}); // every block pageable
  f.pipeline.start_pass({0, 1, 2});
  // The eviction writes block 1's host bytes, whose copy ahead was asked for: the copy made
  // after it holds the new bytes.
  f.pipeline.hold_around(1, [&] {
    for (std::size_t i = 0; i < kBytes; ++i) f.store.buffer(1)->data()[i] = pattern(7, i);
  });
  EXPECT_EQ(f.load(0), 0u);
  const auto done = f.device->make_event();
  f.pipeline.copy_into(1, f.slot.data(), *done);
  f.device->synchronize(*done);
  EXPECT_EQ(std::memcmp(f.slot.data(), f.store.buffer(1)->data(), kBytes), 0);
  EXPECT_THROW(f.pipeline.hold_around(2, [] { throw InvalidArgument("listener"); }),
               InvalidArgument);
  EXPECT_EQ(f.load(2), 0u); // the reads ahead resumed
}

TEST(LoadPipeline, AFileTierThatDoesNotMatchTheBlocksIsRefused) {
  const File file(2);
  auto device = std::make_shared<EmulatedDevice>();
  HostStore store(device, {kBytes, kBytes}, {0, 0}, {}, "blocks", {false, true});
  EXPECT_THROW(LoadPipeline(device, store, FileTier{{file.path.string()}, {file.blocks[0]}, 0, 2},
                            {0, 1}, kBytes, "blocks", [] {}),
               InvalidArgument);
  EXPECT_THROW(LoadPipeline(device, store, FileTier{{file.path.string()}, file.blocks, 0, 0},
                            {0, 1}, kBytes, "blocks", [] {}),
               InvalidArgument);
}

} // namespace
} // namespace blockswap
