// The codec's decoding steps, one source for the CPU reference (src/core/codec.cpp) and the CUDA
// decoder (src/device/cuda/codec_decode.cu): canonical codes and their table, one chunk's
// codes, a value joined from its symbol and rest, and the checksum's hash. Nothing here throws
// or allocates; each step says whether its input was sound. Implementer-only.
#pragma once

#include <cstdint>

#include "blockswap/core/codec.hpp"

#if defined(__CUDACC__)
#define BLOCKSWAP_HD __host__ __device__ __forceinline__
#else
#define BLOCKSWAP_HD inline
#endif

namespace blockswap::codec::chunk {

BLOCKSWAP_HD uint64_t load_le64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
#endif
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

BLOCKSWAP_HD uint64_t load_be64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

// The canonical codes of 256 code lengths (0: no code); false for a length over kMaxCodeBits
// or lengths that are no prefix code (a Kraft sum over 1).
BLOCKSWAP_HD bool canonical_codes(const uint8_t* lengths, uint16_t* codes) {
  uint32_t per_length[kMaxCodeBits + 1] = {};
  for (int s = 0; s < 256; ++s) {
    if (lengths[s] > kMaxCodeBits) return false;
    ++per_length[lengths[s]];
  }
  uint32_t leaves = 0;
  uint32_t next[kMaxCodeBits + 2] = {};
  for (int len = 1; len <= kMaxCodeBits; ++len) {
    leaves += per_length[len] << (kMaxCodeBits - len);
    next[len + 1] = (next[len] + per_length[len]) << 1;
  }
  if (leaves > (1u << kMaxCodeBits)) return false;
  for (int s = 0; s < 256; ++s) {
    codes[s] = lengths[s] > 0 ? static_cast<uint16_t>(next[lengths[s]]++) : 0;
  }
  return true;
}

// Symbol s's entries of the decode table: (s << 4) | length wherever its code starts the
// table's kMaxCodeBits-bit index. Codes from canonical_codes stay inside the table.
BLOCKSWAP_HD void fill_table(int s, uint8_t length, uint16_t code, uint16_t* table) {
  if (length == 0) return;
  const uint32_t first = static_cast<uint32_t>(code) << (kMaxCodeBits - length);
  const uint32_t span = 1u << (kMaxCodeBits - length);
  for (uint32_t j = 0; j < span; ++j) table[first + j] = static_cast<uint16_t>((s << 4) | length);
}

// Note [codec value split]: the inverse of src/core/codec_impl.hpp's symbol_of and rest_of.
template <DType D> BLOCKSWAP_HD void join(uint8_t symbol, const uint8_t* rest, uint8_t* value) {
  if constexpr (D == DType::bf16) {
    value[0] = static_cast<uint8_t>(((symbol & 1) << 7) | (rest[0] & 0x7F));
    value[1] = static_cast<uint8_t>((rest[0] & 0x80) | (symbol >> 1));
  } else if constexpr (D == DType::fp16) {
    value[0] = rest[0];
    value[1] = symbol;
  } else if constexpr (D == DType::fp32) {
    value[0] = rest[0];
    value[1] = rest[1];
    value[2] = static_cast<uint8_t>(((symbol & 1) << 7) | (rest[2] & 0x7F));
    value[3] = static_cast<uint8_t>((rest[2] & 0x80) | (symbol >> 1));
  } else {
    value[0] = symbol;
  }
}

// Decodes n values from the codes in bits [p, e) with the table, joining each symbol with its
// rest (width-1 bytes a value) into value. True when every code is one of the table's and the
// codes end in the last byte (the rest is zero padding); false otherwise, with garbage in
// value. Reads nothing outside [p, e), rest and value.
template <DType D>
BLOCKSWAP_HD bool decode(const uint8_t* p, const uint8_t* e, const uint16_t* table, uint64_t n,
                         const uint8_t* rest, uint8_t* value) {
  constexpr int w = D == DType::bf16 || D == DType::fp16 ? 2 : D == DType::fp32 ? 4 : 1;
  const uint8_t* const start = p;
  uint64_t buf = 0; // the next bits, MSB first; `have` of them are the chunk's
  int have = 0;
  bool bad = false;
  uint64_t i = 0;
  // Four codes of at most kMaxCodeBits bits a refill of at least 56 bits.
  static_assert(4 * kMaxCodeBits <= 56);
  while (i + 4 <= n && e - p >= 8) {
    buf |= load_be64(p) >> have;
    p += (63 - have) >> 3;
    have |= 56;
    for (int k = 0; k < 4; ++k, ++i) {
      const uint16_t entry = table[buf >> (64 - kMaxCodeBits)];
      const int len = entry & 15;
      bad |= len == 0;
      buf <<= len;
      have -= len;
      join<D>(static_cast<uint8_t>(entry >> 4), rest + i * (w - 1), value + i * w);
    }
  }
  for (; i < n && !bad; ++i) {
    for (; have <= 56 && p < e; have += 8) buf |= static_cast<uint64_t>(*p++) << (56 - have);
    const uint16_t entry = table[buf >> (64 - kMaxCodeBits)];
    const int len = entry & 15;
    bad |= len == 0 || len > have;
    buf <<= len;
    have -= len;
    join<D>(static_cast<uint8_t>(entry >> 4), rest + i * (w - 1), value + i * w);
  }
  const uint64_t used = static_cast<uint64_t>(p - start) * 8 - static_cast<uint64_t>(have);
  return !bad && static_cast<uint64_t>(e - start) * 8 - used < 8;
}

namespace xxh {
inline constexpr uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL;
inline constexpr uint64_t P3 = 1609587929392839161ULL, P4 = 9650029242287828579ULL;
inline constexpr uint64_t P5 = 2870177450012600261ULL;
BLOCKSWAP_HD uint64_t rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}
BLOCKSWAP_HD uint64_t round(uint64_t acc, uint64_t input) {
  return rotl(acc + input * P2, 31) * P1;
}
BLOCKSWAP_HD uint64_t merge(uint64_t acc, uint64_t v) {
  return (acc ^ round(0, v)) * P1 + P4;
}
} // namespace xxh

// xxHash64 (seed 0) of n bytes.
BLOCKSWAP_HD uint64_t xxhash64(const uint8_t* p, uint64_t n) {
  using namespace xxh;
  const uint8_t* const end = p + n;
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = 0 - P1;
    for (; end - p >= 32; p += 32) {
      v1 = round(v1, load_le64(p));
      v2 = round(v2, load_le64(p + 8));
      v3 = round(v3, load_le64(p + 16));
      v4 = round(v4, load_le64(p + 24));
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(merge(merge(merge(h, v1), v2), v3), v4);
  } else {
    h = P5;
  }
  h += n;
  for (; end - p >= 8; p += 8) h = rotl(h ^ round(0, load_le64(p)), 27) * P1 + P4;
  if (end - p >= 4) {
    const uint64_t word = static_cast<uint64_t>(p[0]) | (static_cast<uint64_t>(p[1]) << 8) |
                          (static_cast<uint64_t>(p[2]) << 16) | (static_cast<uint64_t>(p[3]) << 24);
    h = rotl(h ^ (word * P1), 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ (static_cast<uint64_t>(*p) * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

} // namespace blockswap::codec::chunk
