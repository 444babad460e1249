// Bytes shaped as trained weights hold them, for the codec's tests on the CPU
// (codec_test.cpp) and on a GPU (device/codec_cuda_test.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "blockswap/core/codec.hpp"

namespace blockswap::codec_testing {

// Values as trained weights hold them: normal, scale 0.02, in the dtype's bytes.
inline std::vector<std::byte> weights(codec::DType dtype, size_t values, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::byte> out(values * codec::width(dtype));
  for (size_t i = 0; i < values; ++i) {
    float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    std::byte* v = out.data() + i * codec::width(dtype);
    if (dtype == codec::DType::fp32) {
      std::memcpy(v, &u, 4);
    } else if (dtype == codec::DType::bf16) {
      uint16_t h = static_cast<uint16_t>(u >> 16);
      std::memcpy(v, &h, 2);
    } else if (dtype == codec::DType::fp16) { // exponent rebased, mantissa truncated; no subnormals
      int e = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
      uint16_t h = static_cast<uint16_t>(((u >> 16) & 0x8000) | (e > 0 ? (e << 10) : 0) |
                                         ((u >> 13) & 0x3FF));
      std::memcpy(v, &h, 2);
    } else { // fp8 e4m3-like: sign, 4 exponent bits, 3 mantissa bits
      int e = std::clamp(static_cast<int>((u >> 23) & 0xFF) - 127 + 7, 0, 15);
      v[0] = static_cast<std::byte>(((u >> 24) & 0x80) | (e << 3) | ((u >> 20) & 7));
    }
  }
  return out;
}

} // namespace blockswap::codec_testing
