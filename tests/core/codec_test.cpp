// The codec (core/codec.hpp): round trips over random and structured bytes of every dtype and
// odd sizes, blocks that do not shrink stored raw, and damaged blocks (random corruption,
// truncation) that throw Error or decode to the original, never to other bytes.
#include "blockswap/core/codec.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <string_view>

#include "blockswap/core/error.hpp"
#include "codec_weights.hpp"

using blockswap::codec::DType;
using blockswap::codec::Range;
namespace codec = blockswap::codec;
using blockswap::codec_testing::weights;

namespace {

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

std::vector<std::byte> round_trip(std::span<const std::byte> raw, std::span<const Range> ranges) {
  std::vector<std::byte> block = codec::encode(raw, ranges);
  std::vector<std::byte> back(codec::decoded_size(block));
  codec::decode(block, back);
  EXPECT_EQ(back.size(), raw.size());
  EXPECT_TRUE(std::equal(back.begin(), back.end(), raw.begin(), raw.end()));
  return block;
}

TEST(Codec, ChecksumIsXxHash64) {
  auto of = [](std::string_view s) {
    return codec::xxhash64(std::as_bytes(std::span(s.data(), s.size())));
  };
  EXPECT_EQ(of(""), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(of("abc"), 0x44BC2CF5AD770999ull);
  std::string long_input; // 777 bytes: every path (stripes, 8-, 4- and 1-byte tails)
  for (int i = 0; i < 3; ++i) {
    for (int b = 0; b < 256; ++b) long_input.push_back(static_cast<char>(b));
  }
  long_input += "blockswap";
  EXPECT_EQ(of(long_input), 0x71D0DFB47EE21B17ull); // python xxhash.xxh64(seed=0)
  // The checksum hashes the pages' hashes.
  std::vector<std::byte> big(codec::kChecksumPage * 2 + 5, std::byte{3});
  auto page_hash = [&](size_t at, size_t n) {
    return codec::xxhash64(std::span(big).subspan(at, n));
  };
  std::vector<std::byte> hashes;
  for (uint64_t h :
       {page_hash(0, codec::kChecksumPage), page_hash(codec::kChecksumPage, codec::kChecksumPage),
        page_hash(2 * codec::kChecksumPage, 5)}) {
    for (int b = 0; b < 8; ++b) hashes.push_back(static_cast<std::byte>(h >> (8 * b)));
  }
  EXPECT_EQ(codec::checksum(big), codec::xxhash64(hashes));
}

TEST(Codec, EveryDtypeRoundTripsAndShrinks) {
  for (DType dtype : {DType::bf16, DType::fp16, DType::fp32, DType::fp8}) {
    auto raw = weights(dtype, 100'003, 1);
    Range all{0, raw.size(), dtype};
    auto block = round_trip(raw, {&all, 1});
    EXPECT_LT(block.size(), raw.size()) << codec::name(dtype);
    EXPECT_FALSE(codec::parse(block).stored_raw) << codec::name(dtype);
  }
  // bf16 weights lose about a third (docs/performance.md: 1.4-1.57 on real ones).
  auto raw = weights(DType::bf16, 1 << 20, 2);
  Range all{0, raw.size(), DType::bf16};
  EXPECT_LT(codec::encode(raw, {&all, 1}).size(), raw.size() * 0.72);
}

TEST(Codec, RandomBytesAreStoredRaw) {
  for (size_t n : {0, 1, 7, 31, 32, 33, 4095, 100'001}) {
    auto raw = random_bytes(n, static_cast<uint32_t>(n));
    Range all{0, n / 2 * 2, DType::bf16};
    auto block = round_trip(raw, {&all, 1});
    EXPECT_TRUE(codec::parse(block).stored_raw) << n;
    EXPECT_EQ(block.size(), n + codec::kHeaderBytes);
  }
}

TEST(Codec, OddSizesAndStructuredData) {
  std::mt19937 rng(3);
  for (DType dtype : {DType::bf16, DType::fp16, DType::fp32, DType::fp8}) {
    for (size_t values : {1, 2, 3, 4095, 4096, 4097, 8191, 12'289}) {
      auto raw = weights(dtype, values, static_cast<uint32_t>(values));
      Range all{0, raw.size(), dtype};
      round_trip(raw, {&all, 1});
      std::vector<std::byte> zeros(raw.size()), ramp(raw.size());
      for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = static_cast<std::byte>(i * 7 / 3);
      round_trip(zeros, {&all, 1});
      round_trip(ramp, {&all, 1});
    }
  }
}

TEST(Codec, MixedRangesGapsAndRaw) {
  // A block as the packer lays it out: tensors of several dtypes at aligned offsets, padding
  // between them, a raw (int64) tensor, a tail outside every range.
  std::vector<std::byte> raw(1'000'000); // of which `at` are used
  std::vector<Range> ranges;
  size_t at = 0;
  uint32_t seed = 10;
  for (DType dtype : {DType::bf16, DType::bf16, DType::fp32, DType::raw, DType::fp16, DType::bf16,
                      DType::fp8, DType::fp32}) {
    size_t values = 5'000 + seed * 911 % 20'000;
    auto bytes = dtype == DType::raw ? random_bytes(values, seed) : weights(dtype, values, seed);
    std::copy(bytes.begin(), bytes.end(), raw.begin() + at);
    ranges.push_back({at, bytes.size(), dtype});
    at = (at + bytes.size() + 255) / 256 * 256 + (seed % 3 == 0 ? 4096 : 0);
    ++seed;
  }
  raw.resize(at + 1000); // a tail outside every range
  auto block = round_trip(raw, ranges);
  EXPECT_LT(block.size(), raw.size());
  // Two bf16 ranges 256-aligned apart share a segment.
  EXPECT_LT(codec::parse(block).segments.size(), ranges.size() * 2);
}

TEST(Codec, BadRangesAreErrors) {
  std::vector<std::byte> raw(100);
  std::vector<Range> outside{{90, 20, DType::bf16}};
  std::vector<Range> odd{{0, 3, DType::bf16}};
  std::vector<Range> overlapping{{0, 40, DType::bf16}, {20, 40, DType::bf16}};
  std::vector<Range> huge{{8, UINT64_MAX - 4, DType::fp8}};
  std::vector<Range> unknown{{0, 4, static_cast<DType>(9)}};
  for (const auto& r : {outside, odd, overlapping, huge, unknown}) {
    EXPECT_THROW(codec::encode(raw, r), blockswap::Error);
  }
  std::vector<std::byte> out(99);
  auto block = codec::encode(raw, {});
  EXPECT_THROW(codec::decode(block, out), blockswap::Error);
}

// Decoding damaged bytes throws Error or gives the original (a flipped padding bit); it never
// gives other bytes and never reads outside the block (checked under BLOCKSWAP_SANITIZE).
void expect_damage_caught(std::span<const std::byte> damaged, std::span<const std::byte> raw,
                          int& caught) {
  try {
    codec::Parsed p = codec::parse(damaged);
    std::vector<std::byte> back(p.decoded_bytes);
    codec::decode(damaged, back);
    EXPECT_TRUE(std::equal(back.begin(), back.end(), raw.begin(), raw.end()));
  } catch (const blockswap::Error&) {
    ++caught;
  }
}

TEST(Codec, DamagedBlocksAreErrors) {
  std::vector<std::byte> raw = weights(DType::bf16, 20'000, 5);
  auto tail = weights(DType::fp32, 3'000, 6);
  raw.insert(raw.end(), tail.begin(), tail.end());
  std::vector<Range> ranges{{0, 40'000, DType::bf16}, {40'000, 12'000, DType::fp32}};
  const auto block = codec::encode(raw, ranges);
  ASSERT_FALSE(codec::parse(block).stored_raw);
  std::mt19937 rng(7);
  int caught = 0, tries = 0;
  for (int i = 0; i < 3000; ++i, ++tries) {
    auto damaged = block;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      size_t at = rng() % damaged.size();
      // Half in the first 2 KiB: the header, the table, code lengths and chunk offsets.
      if (rng() % 2) at %= 2048;
      damaged[at] ^= static_cast<std::byte>(1 + rng() % 255);
    }
    expect_damage_caught(damaged, raw, caught);
  }
  for (size_t keep :
       {size_t{0}, size_t{5}, codec::kHeaderBytes, block.size() / 2, block.size() - 1}) {
    ++tries;
    expect_damage_caught(std::span(block).first(keep), raw, caught);
  }
  for (int i = 0; i < 300; ++i, ++tries) { // bytes spliced in or cut out
    auto damaged = block;
    size_t at = rng() % damaged.size();
    if (i % 2) {
      damaged.insert(damaged.begin() + at, static_cast<std::byte>(rng()));
    } else {
      damaged.erase(damaged.begin() + at);
    }
    expect_damage_caught(damaged, raw, caught);
  }
  EXPECT_GT(caught, tries * 9 / 10);
}

// The same, over 200,000 damaged copies of fresh blocks of bf16 and fp32 (label sweep: a few
// seconds, most of a minute under the sanitizers).
TEST(Codec, DamagedBlocksSweep) {
  std::mt19937 rng(42);
  std::vector<std::byte> raw, block;
  int caught = 0;
  const int tries = 200'000;
  for (int i = 0; i < tries; ++i) {
    if (i % 100 == 0) {
      const DType dtype = rng() % 4 == 0 ? DType::fp32 : DType::bf16;
      raw = weights(dtype, 1 + rng() % 10'000, static_cast<uint32_t>(i));
      raw.resize(raw.size() + rng() % 7); // a raw tail of 0-6 bytes
      block = codec::encode(raw, std::vector<Range>{{0, raw.size() / 4 * 4, dtype}});
    }
    auto damaged = block;
    switch (rng() % 3) {
    case 0:
      for (int f = 0, flips = 1 + static_cast<int>(rng() % 3); f < flips; ++f) {
        damaged[rng() % damaged.size()] ^= static_cast<std::byte>(1 + rng() % 255);
      }
      break;
    case 1:
      damaged.resize(rng() % damaged.size());
      break;
    default: // one bit, anywhere, and one byte of the first 600 (header, table, lengths)
      damaged[rng() % damaged.size()] ^= static_cast<std::byte>(1 << (rng() % 8));
      damaged[rng() % std::min<size_t>(600, damaged.size())] = static_cast<std::byte>(rng());
    }
    expect_damage_caught(damaged, raw, caught);
  }
  EXPECT_GT(caught, tries * 99 / 100);
  std::printf("%d of %d damaged copies were Errors, the rest the original bytes\n", caught, tries);
}

TEST(Codec, DecodeTableRefusesNoPrefixCode) {
  std::array<uint8_t, 256> lengths{};
  lengths[0] = lengths[1] = lengths[2] = 1;
  EXPECT_THROW(codec::decode_table(lengths), blockswap::Error);
  lengths = {};
  lengths[0] = 13;
  EXPECT_THROW(codec::decode_table(lengths), blockswap::Error);
  lengths = {};
  lengths[4] = 1;
  auto table = codec::decode_table(lengths);
  EXPECT_EQ(table[0], (4 << 4) | 1);
  EXPECT_EQ(table[(1 << codec::kMaxCodeBits) - 1], 0);
}

} // namespace
