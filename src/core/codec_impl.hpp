// The codec's encoding internals shared by its files (core/codec.hpp): the Huffman code and how
// a value splits into its symbol and its rest; decoding's are in codec_chunk.hpp.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <span>

#include "blockswap/core/codec.hpp"

namespace blockswap::codec {

// Huffman code lengths for the counts, none over kMaxCodeBits (0 for a count of 0; one symbol
// alone gets 1).
std::array<uint8_t, 256> code_lengths(std::array<uint64_t, 256> counts);

// The canonical codes of the lengths (Error for lengths over kMaxCodeBits or no prefix code).
std::array<uint16_t, 256> canonical_codes(std::span<const uint8_t, 256> lengths);

// Note [codec value split]: a value of `width` bytes (little-endian) is one symbol byte and
// width-1 rest bytes; (symbol_of, rest_of) and chunk::join (codec_chunk.hpp) are inverse bijections
// on every bit pattern, so any bytes of the right size round-trip, floating-point or not.
//   bf16: symbol = exponent (bits 14..7); rest = sign << 7 | mantissa (7 bits)
//   fp16: symbol = high byte; rest = low byte
//   fp32: symbol = exponent (bits 30..23); rest = 3 bytes of sign << 23 | mantissa (23 bits)
//   fp8:  symbol = the byte; no rest
constexpr int width_of(DType dtype) {
  return dtype == DType::bf16 || dtype == DType::fp16 ? 2 : dtype == DType::fp32 ? 4 : 1;
}

template <DType D> inline uint8_t symbol_of(const std::byte* value) {
  if constexpr (D == DType::bf16) {
    uint16_t u;
    std::memcpy(&u, value, 2);
    return static_cast<uint8_t>(u >> 7);
  } else if constexpr (D == DType::fp16) {
    return static_cast<uint8_t>(value[1]);
  } else if constexpr (D == DType::fp32) {
    uint32_t u;
    std::memcpy(&u, value, 4);
    return static_cast<uint8_t>(u >> 23);
  } else {
    return static_cast<uint8_t>(value[0]);
  }
}

template <DType D> inline void rest_of(const std::byte* value, std::byte* rest) {
  if constexpr (D == DType::bf16) {
    uint16_t u;
    std::memcpy(&u, value, 2);
    rest[0] = static_cast<std::byte>(((u >> 8) & 0x80) | (u & 0x7F));
  } else if constexpr (D == DType::fp16) {
    rest[0] = value[0];
  } else if constexpr (D == DType::fp32) {
    uint32_t u;
    std::memcpy(&u, value, 4);
    const uint32_t r = (u & 0x7FFFFFu) | ((u >> 31) << 23);
    rest[0] = static_cast<std::byte>(r);
    rest[1] = static_cast<std::byte>(r >> 8);
    rest[2] = static_cast<std::byte>(r >> 16);
  }
}

} // namespace blockswap::codec
