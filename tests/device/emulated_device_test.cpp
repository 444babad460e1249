#include "blockswap/device/emulated.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

std::vector<float> iota_floats(std::size_t count, float start) {
  std::vector<float> values(count);
  std::iota(values.begin(), values.end(), start);
  return values;
}

TEST(EmulatedDevice, CapacityIsEnforced) {
  EmulatedDevice device({.capacity_bytes = 4096});
  Buffer a = device.allocate_device(2048);
  EXPECT_EQ(device.memory().device_bytes, 2048u);
  try {
    Buffer b = device.allocate_device(4096);
    FAIL() << "allocation over capacity succeeded";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("2048 of 4096"), std::string::npos) << e.what();
  }
  Buffer c = device.allocate_device(2048); // exactly full is fine
  a.reset();
  EXPECT_EQ(device.memory().device_bytes, 2048u);
  EXPECT_EQ(device.memory().peak_device_bytes, 4096u);
  Buffer d = device.allocate_device(1024);
}

TEST(EmulatedDevice, CopiesRunInOrderAndEventsWaitForThem) {
  EmulatedDevice device;
  const auto values = iota_floats(1 << 16, 1.0f);
  const std::size_t bytes = values.size() * sizeof(float);
  Buffer host = device.allocate_host(bytes);
  Buffer back = device.allocate_host(bytes);
  Buffer dev = device.allocate_device(bytes);
  std::memcpy(host.data(), values.data(), bytes);
  auto done = device.make_event();
  device.copy_to_device(dev.data(), host.data(), bytes, 0);
  device.copy_to_host(back.data(), dev.data(), bytes, 0); // after the first, on the same stream
  device.record(*done, Stream::copy);
  device.synchronize(*done);
  EXPECT_EQ(std::memcmp(back.data(), values.data(), bytes), 0);
}

TEST(EmulatedDevice, LinkBandwidthIsEnforced) {
  EmulatedDevice device({.link_gbps = 1.0});
  const std::size_t bytes = 20u << 20; // 20 MiB at 1 GB/s: at least 20.9 ms
  Buffer host = device.allocate_host(bytes);
  Buffer dev = device.allocate_device(bytes);
  auto done = device.make_event();
  const auto start = std::chrono::steady_clock::now();
  device.copy_to_device(dev.data(), host.data(), bytes, 0);
  device.record(*done, Stream::copy);
  device.synchronize(*done);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, bytes / 1e9);
  EXPECT_GE(device.copy_seconds(), bytes / 1e9);
}

// Past pinnable_bytes, host memory is pageable, and a copy from or to it returns only once it
// is done, as cudaMemcpyAsync does with pageable memory.
TEST(EmulatedDevice, PageableCopiesMakeTheHostWait) {
  EmulatedDevice device({.link_gbps = 1.0, .pinnable_bytes = 20u << 20});
  const std::size_t bytes = 20u << 20; // 20.9 ms at 1 GB/s
  Buffer pinned = device.allocate_host(bytes);
  Buffer pageable = device.allocate_host(bytes);
  EXPECT_FALSE(pinned.pageable());
  EXPECT_TRUE(pageable.pageable());
  Buffer dev = device.allocate_device(bytes);
  auto seconds = [&](const Buffer& host) {
    const auto start = std::chrono::steady_clock::now();
    device.copy_to_device(dev.data(), host.data(), bytes, 0);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    auto done = device.make_event();
    device.record(*done, Stream::copy);
    device.synchronize(*done);
    return s;
  };
  seconds(pinned);
  EXPECT_EQ(device.pageable_copies(), 0u);
  EXPECT_GE(seconds(pageable), bytes / 1e9); // the throttled copy, all of it
  EXPECT_EQ(device.pageable_copies(), 1u);
  pinned.reset(); // its pinned memory can be had again
  EXPECT_FALSE(device.allocate_host(bytes).pageable());
}

TEST(EmulatedDevice, CopyStreamWaitsForItsEvent) {
  // A copy enqueued behind a wait on a copy-stream event runs after that event's copies.
  EmulatedDevice device({.link_gbps = 2.0});
  const std::size_t bytes = 4u << 20;
  Buffer host = device.allocate_host(bytes);
  Buffer dev = device.allocate_device(bytes);
  Buffer back = device.allocate_host(bytes);
  std::memset(host.data(), 0x11, bytes);
  auto loaded = device.make_event();
  auto done = device.make_event();
  device.copy_to_device(dev.data(), host.data(), bytes, 0);
  device.record(*loaded, Stream::copy);
  device.wait(Stream::copy, *loaded);
  device.copy_to_host(back.data(), dev.data(), bytes, 0);
  device.record(*done, Stream::copy);
  device.wait(Stream::compute, *done); // the host is the compute stream: it blocks
  EXPECT_EQ(std::to_integer<int>(back.data()[bytes - 1]), 0x11);
}

TEST(EmulatedDevice, PoisonFillsWithNaN) {
  EmulatedDevice device;
  Buffer dev = device.allocate_device(64 * sizeof(float));
  auto* floats = reinterpret_cast<float*>(dev.data());
  std::fill(floats, floats + 64, 1.0f);
  auto done = device.make_event();
  device.poison(dev.data(), 64 * sizeof(float));
  device.record(*done, Stream::copy);
  device.synchronize(*done);
  for (int i = 0; i < 64; ++i) EXPECT_TRUE(std::isnan(floats[i])) << i;
}

TEST(EmulatedDevice, FailedCopyReachesTheWaiterAndTouchesNothing) {
  EmulatedDevice device;
  const std::size_t bytes = 4096;
  Buffer host = device.allocate_host(bytes);
  Buffer dev = device.allocate_device(bytes);
  std::memset(host.data(), 0x5A, bytes);
  std::memset(dev.data(), 0x00, bytes);
  auto loaded = device.make_event();
  device.fail_copy(0);
  device.copy_to_device(dev.data(), host.data(), bytes, 0);
  device.record(*loaded, Stream::copy);
  EXPECT_THROW(device.wait(Stream::compute, *loaded), Error);
  EXPECT_EQ(std::to_integer<int>(dev.data()[0]), 0x00);
  EXPECT_EQ(std::to_integer<int>(host.data()[0]), 0x5A);
  // The stream carries on: the next copy and its event succeed.
  device.copy_to_device(dev.data(), host.data(), bytes, 0);
  device.record(*loaded, Stream::copy);
  EXPECT_NO_THROW(device.synchronize(*loaded));
  EXPECT_EQ(std::memcmp(dev.data(), host.data(), bytes), 0);
}

TEST(EmulatedDevice, UnrecordedEventIsComplete) {
  EmulatedDevice device;
  auto event = device.make_event();
  EXPECT_NO_THROW(device.synchronize(*event));
  EXPECT_NO_THROW(device.wait(Stream::compute, *event));
}

TEST(EmulatedDevice, DeviceMemoryMayOutliveTheDevice) {
  Buffer dev;
  {
    EmulatedDevice device;
    dev = device.allocate_device(1024);
  }
  dev.reset(); // frees without touching the destroyed device
  SUCCEED();
}

TEST(EmulatedDevice, NegativeLinkIsAnError) {
  EXPECT_THROW(EmulatedDevice({.link_gbps = -1}), Error);
}

} // namespace
} // namespace blockswap
