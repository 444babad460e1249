// Note [automatic compression]: each branch of compress = auto's decision, with its reason.
#include "blockswap/core/compression_choice.hpp"

#include <gtest/gtest.h>

namespace blockswap {
namespace {

CompressionFacts bfloat16_blocks() {
  CompressionFacts f;
  f.frozen_bytes = 10ull << 30;
  f.host_bytes = 10ull << 30;
  f.ratio = modelled_dtype_ratio("bfloat16");
  return f;
}

void expect_choice(const CompressionFacts& f, bool on, const std::string& part) {
  const CompressionChoice c = choose_compression(f);
  EXPECT_EQ(c.on, on) << c.reason;
  EXPECT_NE(c.reason.find(part), std::string::npos) << c.reason;
}

TEST(CompressionChoice, ModelledRatiosByDtype) {
  EXPECT_DOUBLE_EQ(modelled_dtype_ratio("BF16"), modelled_dtype_ratio("bfloat16"));
  EXPECT_DOUBLE_EQ(modelled_dtype_ratio("F32"), 1.17);
  EXPECT_DOUBLE_EQ(modelled_dtype_ratio("float8_e4m3fn"), 1.20);
  EXPECT_DOUBLE_EQ(modelled_dtype_ratio("I8"), 1.0);
  EXPECT_EQ(compression_verdict(1.0, 0.9), "pays");
  EXPECT_EQ(compression_verdict(1.0, 1.1), "costs");
  EXPECT_EQ(compression_verdict(1.0, 1.0), "changes nothing");
}

TEST(CompressionChoice, OffWhereItCannotOrDoesNotCompress) {
  CompressionFacts f = bfloat16_blocks();
  f.can_decode = false;
  expect_choice(f, false, "cannot decode");
  f = bfloat16_blocks();
  f.frozen_bytes = 0;
  expect_choice(f, false, "no frozen weights");
  f = bfloat16_blocks();
  f.ratio = modelled_dtype_ratio("I8");
  f.host_available = 1ull << 30; // short, but nothing to gain
  expect_choice(f, false, "not of a dtype that compresses");
}

TEST(CompressionChoice, OnWhereHostMemoryIsShort) {
  CompressionFacts f = bfloat16_blocks();
  f.host_available = 8ull << 30;
  expect_choice(f, true, "host memory is short: the host copies take 10 GiB raw, 8 GiB");
  f.host_available = 12ull << 30;
  expect_choice(f, false, "host memory suffices");
}

TEST(CompressionChoice, ThePlannersVerdictDecidesOtherwise) {
  CompressionFacts f = bfloat16_blocks();
  f.host_available = 64ull << 30;
  f.raw_step_seconds = 2.0;
  f.compressed_step_seconds = 1.5;
  expect_choice(f, true, "the link bounds the step");
  f.compressed_step_seconds = 2.5;
  expect_choice(f, false, "the decoder is slower than the link");
  f.compressed_step_seconds = 2.0;
  expect_choice(f, false, "compute-bound");
  f.raw_step_seconds = f.compressed_step_seconds = 0;
  expect_choice(f, false, "nothing says the link bounds the step");
}

} // namespace
} // namespace blockswap
