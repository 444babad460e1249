// CudaDevice on a GPU (label gpu): the same contracts as the emulated device's tests.
#include "blockswap/device/cuda.hpp"

#include <gtest/gtest.h>

#include <optional>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "blockswap/core/error.hpp"
#include "cuda_handles.hpp"

namespace blockswap {
namespace {

class CudaDeviceTest : public ::testing::Test {
protected:
  void SetUp() override {
    if (!CudaDevice::available()) GTEST_SKIP() << "no CUDA device";
  }
};

// Handles are move-only values: the moved-from one is empty, the moved-to one works.
TEST_F(CudaDeviceTest, HandlesMoveAndStayUsable) {
  cuda::StreamHandle stream(0);
  cuda::EventHandle event(0);
  ASSERT_TRUE(stream && event);
  cuda::StreamHandle other = std::move(stream);
  cuda::EventHandle recorded = std::move(event);
  EXPECT_FALSE(stream);
  EXPECT_FALSE(event);
  ASSERT_EQ(cudaEventRecord(recorded.get(), other.get()), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(recorded.get()), cudaSuccess);
  other = cuda::StreamHandle(0); // the old stream is synchronised and destroyed
  EXPECT_TRUE(other);
  other.reset();
  other.reset(); // twice is fine
  EXPECT_FALSE(other);
}

TEST_F(CudaDeviceTest, HostMemoryIsPinned) {
  CudaDevice device;
  Buffer host = device.allocate_host(1 << 20);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, host.data()), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
  EXPECT_TRUE(device.memory().pinned_host);
}

TEST_F(CudaDeviceTest, CopiesRoundTripInOrder) {
  CudaDevice device;
  const std::size_t count = 1 << 22;
  std::vector<float> values(count);
  std::iota(values.begin(), values.end(), 0.0f);
  Buffer host = device.allocate_host(count * 4), back = device.allocate_host(count * 4);
  Buffer dev = device.allocate_device(count * 4);
  std::memcpy(host.data(), values.data(), count * 4);
  auto done = device.make_event();
  device.copy_to_device(dev.data(), host.data(), count * 4, 0);
  device.copy_to_host(back.data(), dev.data(), count * 4, 0);
  device.record(*done, Stream::copy);
  device.synchronize(*done);
  EXPECT_EQ(std::memcmp(back.data(), values.data(), count * 4), 0);
  EXPECT_EQ(device.memory().device_bytes, count * 4);
}

TEST_F(CudaDeviceTest, ComputeStreamWaitsForTheCopyWithoutBlockingTheHost) {
  CudaDevice device;
  const std::size_t bytes = 256u << 20;
  Buffer host = device.allocate_host(bytes), dev = device.allocate_device(bytes);
  Buffer back = device.allocate_host(bytes);
  std::memset(host.data(), 0x3C, bytes);
  auto loaded = device.make_event();
  const auto start = std::chrono::steady_clock::now();
  device.copy_to_device(dev.data(), host.data(), bytes, 0);
  device.record(*loaded, Stream::copy);
  device.wait(Stream::compute, *loaded); // returns at once
  const double enqueue =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Work on the compute stream (the legacy default stream here) runs after the copy.
  ASSERT_EQ(cudaMemcpyAsync(back.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(std::to_integer<int>(back.data()[bytes - 1]), 0x3C);
  EXPECT_LT(enqueue, 0.005) << "enqueueing 256 MiB took " << enqueue << " s: the host waited";
}

TEST_F(CudaDeviceTest, OutOfMemoryNamesTheSizes) {
  CudaDevice device;
  try {
    Buffer huge = device.allocate_device(std::size_t{1} << 50);
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
  Buffer fine = device.allocate_device(1 << 20); // the error was cleared
  EXPECT_TRUE(fine);
}

TEST_F(CudaDeviceTest, PoisonFillsWithNaN) {
  CudaDevice device;
  Buffer dev = device.allocate_device(64 * 4);
  Buffer back = device.allocate_host(64 * 4);
  auto done = device.make_event();
  device.poison(dev.data(), 64 * 4);
  device.copy_to_host(back.data(), dev.data(), 64 * 4, 0);
  device.record(*done, Stream::copy);
  device.synchronize(*done);
  const auto* floats = reinterpret_cast<const float*>(back.data());
  for (int i = 0; i < 64; ++i) EXPECT_TRUE(std::isnan(floats[i]));
}

TEST_F(CudaDeviceTest, MissingDeviceIsAnError) {
  EXPECT_THROW(CudaDevice({.device = 1000}), Error);
}

// Copies are timed on the device and reported to the observer (traces show them); two events on
// one stream time the work between them (the engine measures stalls with them).
TEST_F(CudaDeviceTest, CopiesAreObservedAndEventsAreTimed) {
  CudaDevice device;
  constexpr std::size_t kBytes = 64 << 20;
  Buffer host = device.allocate_host(kBytes), dev = device.allocate_device(kBytes);
  std::vector<CopyRecord> seen;
  device.set_copy_observer([&](const CopyRecord& c) { seen.push_back(c); });
  auto before = device.make_event(), after = device.make_event();
  device.record(*before, Stream::copy);
  device.copy_to_device(dev.data(), host.data(), kBytes, 3);
  device.copy_to_host(host.data(), dev.data(), kBytes, 4);
  device.record(*after, Stream::copy);
  device.synchronize(*after);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen[0].to_device);
  EXPECT_EQ(seen[0].tag, 3);
  EXPECT_FALSE(seen[1].to_device);
  EXPECT_GT(seen[0].end, seen[0].start);
  EXPECT_GE(seen[1].start, seen[0].end);
  EXPECT_TRUE(device.times_events());
  const std::optional<double> copies = device.elapsed_seconds(*before, *after);
  ASSERT_TRUE(copies.has_value());
  // Two 64 MiB copies over PCIe or faster: more than nothing, well under a second.
  EXPECT_GT(*copies, 0.0);
  EXPECT_LT(*copies, 1.0);
  device.set_copy_observer(nullptr);
}

} // namespace
} // namespace blockswap
