// The codec's CUDA decoder on a GPU (label gpu): bit for bit the CPU reference's output for
// every dtype, odd sizes, mixed and raw blocks; damage found exactly where the reference finds
// it; and its GB/s printed (not asserted) for gpu-check's log.
#include "codec_decode.hpp"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../core/codec_weights.hpp"
#include "blockswap/core/codec.hpp"
#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

using codec::DType;

#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

struct DeviceBytes { // move-only
  void* p = nullptr;
  explicit DeviceBytes(size_t n) {
    if (cudaMalloc(&p, std::max<size_t>(n, 1)) != cudaSuccess) p = nullptr;
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { cudaFree(p); }
};

class CodecCudaTest : public ::testing::Test {
protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      GTEST_SKIP() << "no CUDA device";
    }
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }

  // The GPU's decode of `block` (parsed on the host from the same bytes): its bytes and the
  // damage word.
  std::vector<std::byte> gpu_decode(const std::vector<std::byte>& block,
                                    const codec::Parsed& parsed, uint32_t& damage) {
    DeviceBytes in(block.size()), out(parsed.decoded_bytes),
        work(cuda_codec::workspace_bytes(parsed));
    std::vector<std::byte> back(parsed.decoded_bytes);
    EXPECT_TRUE(in.p && out.p && work.p);
    EXPECT_EQ(cudaMemcpy(in.p, block.data(), block.size(), cudaMemcpyHostToDevice), cudaSuccess);
    cuda_codec::decode_async(parsed, static_cast<const std::byte*>(in.p),
                             static_cast<std::byte*>(out.p), work.p, stream_);
    EXPECT_EQ(cudaMemcpyAsync(&damage, work.p, 4, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    if (!back.empty()) {
      EXPECT_EQ(cudaMemcpy(back.data(), out.p, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return back;
  }

  void expect_same_as_cpu(const std::vector<std::byte>& raw,
                          const std::vector<codec::Range>& ranges) {
    const auto block = codec::encode(raw, ranges);
    uint32_t damage = 99;
    auto back = gpu_decode(block, codec::parse(block), damage);
    EXPECT_EQ(damage, 0u);
    EXPECT_TRUE(back == raw) << raw.size() << " bytes";
  }

  cudaStream_t stream_ = nullptr;
};

using codec_testing::weights;

TEST_F(CodecCudaTest, EveryDtypeAndSizeMatchesTheReference) {
  for (DType dtype : {DType::bf16, DType::fp16, DType::fp32, DType::fp8}) {
    for (size_t values : {1, 4095, 4096, 4097, 100'003, 1'000'000}) {
      auto raw = weights(dtype, values, static_cast<uint32_t>(values));
      expect_same_as_cpu(raw, {{0, raw.size(), dtype}});
      std::vector<std::byte> zeros(raw.size());
      expect_same_as_cpu(zeros, {{0, zeros.size(), dtype}});
    }
  }
  std::mt19937 rng(1);
  std::vector<std::byte> noise(1 << 20);
  for (auto& b : noise) b = static_cast<std::byte>(rng());
  expect_same_as_cpu(noise, {{0, noise.size(), DType::bf16}}); // stored raw
  expect_same_as_cpu({}, {});
}

TEST_F(CodecCudaTest, MixedBlockMatchesTheReference) {
  std::vector<std::byte> raw;
  std::vector<codec::Range> ranges;
  uint32_t seed = 3;
  for (DType dtype : {DType::bf16, DType::raw, DType::fp32, DType::bf16, DType::fp8}) {
    auto bytes = weights(dtype == DType::raw ? DType::fp8 : dtype, 30'000 + seed * 777, seed);
    ranges.push_back({raw.size(), bytes.size(), dtype});
    raw.insert(raw.end(), bytes.begin(), bytes.end());
    raw.resize((raw.size() + 255) / 256 * 256);
    ++seed;
  }
  raw.resize(raw.size() + 100);
  expect_same_as_cpu(raw, ranges);
}

// Damaged bytes: the GPU reports damage exactly where the reference throws, and otherwise
// gives the original bytes.
TEST_F(CodecCudaTest, DamageFoundWhereTheReferenceFindsIt) {
  auto raw = weights(DType::bf16, 200'000, 9);
  const auto block = codec::encode(raw, std::vector<codec::Range>{{0, raw.size(), DType::bf16}});
  std::mt19937 rng(5);
  int found = 0;
  for (int i = 0; i < 300; ++i) {
    auto damaged = block;
    for (int f = 0; f < 1 + i % 3; ++f) {
      damaged[rng() % damaged.size()] ^= static_cast<std::byte>(1 + rng() % 255);
    }
    codec::Parsed parsed;
    try {
      parsed = codec::parse(damaged); // the host reads the bytes it copies
    } catch (const Error&) {
      continue;
    }
    bool cpu_throws = false;
    std::vector<std::byte> cpu(parsed.decoded_bytes);
    try {
      codec::decode(damaged, cpu);
    } catch (const Error&) {
      cpu_throws = true;
    }
    uint32_t damage = 0;
    auto gpu = gpu_decode(damaged, parsed, damage);
    EXPECT_EQ(damage != 0, cpu_throws) << "try " << i << ", damage " << damage;
    if (damage == 0) {
      EXPECT_TRUE(gpu == raw) << "try " << i;
    }
    found += damage != 0;
    if (damage != 0) {
      EXPECT_THROW(cuda_codec::check_damage(damage), Error) << i;
    }
  }
  EXPECT_GT(found, 200);
}

// GB/s of decoded bytes, FLUX-double-block-sized (printed for gpu-check's log, not asserted).
TEST_F(CodecCudaTest, Throughput) {
  auto raw = weights(DType::bf16, 170'000'000, 11); // 340 MB
  const auto block = codec::encode(raw, std::vector<codec::Range>{{0, raw.size(), DType::bf16}});
  const auto parsed = codec::parse(block);
  DeviceBytes in(block.size()), out(raw.size()), work(cuda_codec::workspace_bytes(parsed));
  ASSERT_TRUE(in.p && out.p && work.p);
  CHECK_CUDA(cudaMemcpy(in.p, block.data(), block.size(), cudaMemcpyHostToDevice));
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    cuda_codec::decode(parsed, static_cast<const std::byte*>(in.p), static_cast<std::byte*>(out.p),
                       work.p, stream_);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("codec cuda decode: %.1f MB -> %.1f MB (ratio %.4f) in %.3f ms: %.1f GB/s\n",
              block.size() / 1e6, raw.size() / 1e6, double(raw.size()) / block.size(), best * 1e3,
              raw.size() / best / 1e9);
  std::vector<std::byte> back(raw.size());
  CHECK_CUDA(cudaMemcpy(back.data(), out.p, back.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == raw);
}

} // namespace
} // namespace blockswap
