// The host memory a Device locks, counted at the size asked in whole pages, and its pool of
// exact-size buffers (Note [exact host memory] in src/device/host_memory.cpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/device/device.hpp"

namespace blockswap {
namespace {

std::size_t page() {
  return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

std::size_t pages(std::size_t bytes) {
  return (bytes + page() - 1) / page() * page();
}

TEST(HostMemory, EveryHostBufferIsCountedAtItsSizeInWholePages) {
  auto device = Device::open("emulated");
  auto backend = device->attach("blocks");
  {
    Buffer a = backend->allocate_host(3 * page() + 1);
    Buffer b = backend->allocate_host(100);
    const HostMemoryStats s = device->host_memory();
    EXPECT_EQ(s.kept_bytes, 3 * page() + 101);
    EXPECT_EQ(s.pinned_bytes, 5 * page());
    EXPECT_EQ(s.pageable_bytes, 0u);
  }
  const HostMemoryStats s = device->host_memory();
  EXPECT_EQ(s.kept_bytes, 0u); // freed
  EXPECT_EQ(s.pinned_bytes, 0u);
  EXPECT_EQ(s.peak_kept_bytes, 3 * page() + 101); // the peaks stay
  EXPECT_EQ(s.peak_pinned_bytes, 5 * page());
  EXPECT_DOUBLE_EQ(s.pinned_per_kept(), double(5 * page()) / double(3 * page() + 101));
}

TEST(HostMemory, BlockSizedBuffersLockWithinOnePercentOfWhatTheyHold) {
  auto device = Device::open("emulated");
  auto backend = device->attach("blocks");
  std::vector<Buffer> blocks;
  for (int i = 0; i < 19; ++i) blocks.push_back(backend->allocate_host((1 << 20) + 4 * i + 12));
  EXPECT_LT(device->host_memory().pinned_per_kept(), 1.01);
  EXPECT_GE(device->host_memory().pinned_per_kept(), 1.0);
}

TEST(HostMemory, MemoryTheSystemRefusedToLockIsPageableNotKept) {
  auto device = Device::open("emulated", {.emulated_pinnable_bytes = 0});
  Buffer a = device->attach("blocks")->allocate_host(1000);
  ASSERT_TRUE(a.pageable());
  const HostMemoryStats s = device->host_memory();
  EXPECT_EQ(s.pageable_bytes, 1000u);
  EXPECT_EQ(s.pinned_bytes, 0u);
  EXPECT_EQ(s.kept_bytes, 0u);
  EXPECT_EQ(s.pinned_per_kept(), 0.0); // nothing kept in locked memory
  Buffer pooled = device->pooled_host(2000);
  EXPECT_TRUE(pooled.pageable()); // the pool says so too
}

TEST(HostMemory, BuffersOutliveTheirDevice) {
  Buffer held, pooled;
  {
    auto device = Device::open("emulated");
    held = device->attach("blocks")->allocate_host(64);
    pooled = device->pooled_host(64);
  }
  held.data()[63] = std::byte{1}; // still valid memory
  pooled.data()[63] = std::byte{1};
  held.reset();
  pooled.reset(); // gives it back to a pool that is gone: freed
}

TEST(HostMemory, ThePoolGivesBackTheSameBufferForTheSameSize) {
  auto device = Device::open("emulated");
  std::byte* first = nullptr;
  {
    Buffer a = device->pooled_host(5000);
    first = a.data();
    EXPECT_EQ(device->host_memory().kept_bytes, 5000u);
  }
  EXPECT_EQ(device->host_memory().kept_bytes, 0u); // idle in the pool: locked, holding nothing
  EXPECT_EQ(device->host_memory().pinned_bytes, pages(5000));
  Buffer again = device->pooled_host(5000);
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(again.size(), 5000u);
  EXPECT_EQ(device->host_memory().pinned_bytes, pages(5000)); // nothing new locked
  Buffer other = device->pooled_host(5001);                   // another size: its own buffer
  EXPECT_NE(other.data(), first);
}

TEST(HostMemory, ThePoolNeverLocksMoreThanTheMostItsBuffersHeldAtOnce) {
  auto device = Device::open("emulated");
  const std::size_t a = 64 * page(), b = 96 * page();
  { // a step of one resolution: four buffers of `a` at once
    std::vector<Buffer> step;
    for (int i = 0; i < 4; ++i) step.push_back(device->pooled_host(a));
  }
  EXPECT_EQ(device->host_memory().pinned_bytes, 4 * a);
  for (int round = 0; round < 3; ++round) {
    { // another resolution: three of `b` (more bytes than 4 a): the idle ones make room
      std::vector<Buffer> step;
      for (int i = 0; i < 3; ++i) step.push_back(device->pooled_host(b));
      const HostMemoryStats s = device->host_memory();
      EXPECT_LE(s.pinned_bytes, std::max(4 * a, 3 * b)) << "round " << round;
    }
    { // back to the first: room is made again, never more than the mark
      std::vector<Buffer> step;
      for (int i = 0; i < 4; ++i) step.push_back(device->pooled_host(a));
      EXPECT_LE(device->host_memory().pinned_bytes, 3 * b) << "round " << round;
    }
  }
  const HostMemoryStats s = device->host_memory();
  EXPECT_LE(s.peak_pinned_bytes, s.peak_kept_bytes);
  EXPECT_EQ(s.peak_kept_bytes, 3 * b);
  device->trim_host_pool();
  EXPECT_EQ(device->host_memory().pinned_bytes, 0u);
}

TEST(HostMemory, APoolBufferTakenTwiceOfTheSameSizeIsTwoBuffers) {
  auto device = Device::open("emulated");
  Buffer a = device->pooled_host(300);
  Buffer b = device->pooled_host(300);
  EXPECT_NE(a.data(), b.data());
  EXPECT_EQ(device->host_memory().kept_bytes, 600u);
}

TEST(HostMemory, AFailedPoolAllocationHoldsNothing) {
  auto device = Device::open("emulated");
  EXPECT_THROW(device->pooled_host(std::size_t{1} << 62), Error); // the host has no 4 EiB
  EXPECT_EQ(device->host_memory().kept_bytes, 0u);
  EXPECT_EQ(device->host_memory().pinned_bytes, 0u);
  Buffer after = device->pooled_host(100); // the pool still works, and counts only this
  EXPECT_EQ(device->host_memory().kept_bytes, 100u);
}

} // namespace
} // namespace blockswap
