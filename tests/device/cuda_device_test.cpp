// CudaDevice on a GPU (label gpu): the same contracts as the emulated device's tests.
#include "blockswap/device/cuda.hpp"

#include <gtest/gtest.h>

#include <optional>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
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

// Note [slots beside torch's allocator]: out of memory, the owner of the other cache is asked
// once to give it back, the allocation is tried again, and the error says what that owner holds.
TEST_F(CudaDeviceTest, OutOfMemoryReleasesTheOtherCacheOnceAndTriesAgain) {
  int released = 0;
  CudaDevice device({.release_cached_memory = [&] {
    ++released;
    return std::string("the other allocator holds 7 bytes");
  }});
  try {
    Buffer huge = device.allocate_device(std::size_t{1} << 50);
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const OutOfMemory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("held by blockswap"), std::string::npos) << what;
    EXPECT_NE(what.find("the other allocator holds 7 bytes"), std::string::npos) << what;
  }
  EXPECT_EQ(released, 1);
  Buffer fine = device.allocate_device(1 << 20); // no release where it fits
  EXPECT_TRUE(fine);
  EXPECT_EQ(released, 1);
}

// A device that does not exist names the devices present, before any CUDA call on it.
TEST_F(CudaDeviceTest, MissingDeviceIsAnError) {
  EXPECT_THROW(CudaDevice({.device = 1000}), Error);
  EXPECT_THROW(CudaDevice({.device = -1}), Error);
  try {
    CudaDevice device({.device = 1000});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:1000 does not exist"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA device(s) present"), std::string::npos) << e.what();
  }
}

// Every verb of the backend on `device`, with whatever device the thread has current: the data
// arrive, the events order and time, and the thread's current device is the same afterwards.
void use_every_verb(CudaDevice& device, int current) {
  constexpr std::size_t kFloats = 1 << 20, kBytes = kFloats * 4;
  Buffer host = device.allocate_host(kBytes), back = device.allocate_host(kBytes);
  Buffer dev = device.allocate_device(kBytes);
  std::vector<float> values(kFloats);
  std::iota(values.begin(), values.end(), 1.0f);
  std::memcpy(host.data(), values.data(), kBytes);
  std::vector<CopyRecord> seen;
  device.set_copy_observer([&](const CopyRecord& c) { seen.push_back(c); });
  const auto start = device.make_timed_event(), end = device.make_timed_event();
  const auto copied = device.make_event();
  device.record(*start, Stream::compute);
  device.poison(dev.data(), kBytes);
  device.copy_to_device(dev.data(), host.data(), kBytes, 1);
  device.record(*copied, Stream::copy);
  device.wait(Stream::compute, *copied);
  bool called = false;
  device.wait_host(Stream::compute, [&] { called = true; });
  device.record(*end, Stream::compute);
  device.wait(Stream::copy, *end);
  device.copy_to_host(back.data(), dev.data(), kBytes, 2);
  const auto done = device.make_event();
  device.record(*done, Stream::copy);
  device.synchronize(*done);
  device.synchronize(*end);
  EXPECT_TRUE(called);
  EXPECT_EQ(std::memcmp(back.data(), values.data(), kBytes), 0);
  EXPECT_TRUE(device.elapsed_seconds(*start, *end).has_value());
  device.set_copy_observer(nullptr);
  EXPECT_EQ(seen.size(), 2u);
  (void)device.memory();
  int now = -1;
  ASSERT_EQ(cudaGetDevice(&now), cudaSuccess);
  EXPECT_EQ(now, current) << "a call left another device current";
}

// Note [device scope]: one GPU suffices for half of it: the device was made current by someone
// else (torch, the caller), and blockswap neither needs nor changes more.
TEST_F(CudaDeviceTest, EveryVerbWorksWithItsDeviceCurrentAlready) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  CudaDevice device({.device = 0});
  use_every_verb(device, 0);
}

// Note [device scope], the other half: a device on cuda:0 used from a thread that has cuda:1
// current (torch.cuda.set_device(1)), and the reverse.
TEST_F(CudaDeviceTest, EveryVerbWorksWithAnotherDeviceCurrent) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) {
    GTEST_SKIP() << "needs 2 GPUs (this machine has " << count
                 << "): a device used while another is current";
  }
  for (const auto& [mine, current] : {std::pair{0, 1}, std::pair{1, 0}}) {
    SCOPED_TRACE(::testing::Message() << "cuda:" << mine << " with cuda:" << current << " current");
    ASSERT_EQ(cudaSetDevice(current), cudaSuccess);
    CudaDevice device({.device = mine});
    use_every_verb(device, current);
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// Note [untimed events]: make_event's events are made without timing; the observer's copies are
// timed from a pool of event pairs, so many copies report in order, each once.
TEST_F(CudaDeviceTest, UntimedEventsAreRefusedAndObservedCopiesReuseTheirEvents) {
  CudaDevice device;
  const auto a = device.make_event(), b = device.make_event();
  device.record(*a, Stream::copy);
  device.record(*b, Stream::copy);
  device.synchronize(*b);
  EXPECT_THROW((void)device.elapsed_seconds(*a, *b), Error);
  Buffer host = device.allocate_host(4096), dev = device.allocate_device(4096);
  std::vector<int64_t> tags;
  device.set_copy_observer([&](const CopyRecord& c) { tags.push_back(c.tag); });
  const auto done = device.make_event();
  for (int64_t round = 0; round < 10; ++round) {
    for (int64_t i = 0; i < 100; ++i) {
      device.copy_to_device(dev.data(), host.data(), 4096, round * 100 + i);
    }
    device.record(*done, Stream::copy);
    device.synchronize(*done);
  }
  device.set_copy_observer(nullptr);
  ASSERT_EQ(tags.size(), 1000u);
  for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(tags[i], i);
}

// Node-shared weights that cannot be pinned say so in memory().pinned_host (here: memory that is
// registered already, which cudaHostRegister refuses).
TEST_F(CudaDeviceTest, PinningThatFailsLeavesTheHostPageable) {
  CudaDevice device;
  constexpr std::size_t kBytes = 1 << 20;
  void* raw = std::aligned_alloc(4096, kBytes);
  ASSERT_NE(raw, nullptr);
  auto* data = static_cast<std::byte*>(raw);
  {
    Buffer first = device.pin_host(data, kBytes);
    int read_only = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, 0),
              cudaSuccess);
    EXPECT_EQ(static_cast<bool>(first), read_only != 0);
    EXPECT_EQ(device.memory().pinned_host, read_only != 0);
    Buffer second = device.pin_host(data, kBytes); // registered already: refused
    EXPECT_FALSE(second);
    EXPECT_FALSE(device.memory().pinned_host);
  }
  std::free(raw);
}

// Copies are timed on the device and reported to the observer (traces show them); two events on
// one stream time the work between them (the engine measures stalls with them).
TEST_F(CudaDeviceTest, CopiesAreObservedAndEventsAreTimed) {
  CudaDevice device;
  constexpr std::size_t kBytes = 64 << 20;
  Buffer host = device.allocate_host(kBytes), dev = device.allocate_device(kBytes);
  std::vector<CopyRecord> seen;
  device.set_copy_observer([&](const CopyRecord& c) { seen.push_back(c); });
  auto before = device.make_timed_event(), after = device.make_timed_event();
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
