// The codec's pieces that are not the format: length-limited Huffman code lengths, canonical
// codes and their decode table, and xxHash64 (core/codec.hpp).
#include <algorithm>
#include <array>
#include <cstring>
#include <queue>

#include "blockswap/core/codec.hpp"
#include "blockswap/core/error.hpp"
#include "codec_impl.hpp"

namespace blockswap::codec {
namespace {

// Lengths of a Huffman code of the symbols with count > 0, unbounded.
std::array<uint8_t, 256> huffman_once(const std::array<uint64_t, 256>& counts) {
  struct Node {
    uint64_t weight;
    int id; // < 256: a symbol; else nodes[id - 256]
  };
  auto heavier = [](const Node& a, const Node& b) {
    return a.weight != b.weight ? a.weight > b.weight : a.id > b.id;
  };
  std::priority_queue<Node, std::vector<Node>, decltype(heavier)> heap(heavier);
  for (int s = 0; s < 256; ++s) {
    if (counts[s] > 0) heap.push({counts[s], s});
  }
  std::array<uint8_t, 256> lengths{};
  if (heap.size() == 1) {
    lengths[heap.top().id] = 1;
    return lengths;
  }
  std::vector<std::array<int, 2>> children;
  while (heap.size() > 1) {
    Node a = heap.top();
    heap.pop();
    Node b = heap.top();
    heap.pop();
    children.push_back({a.id, b.id});
    heap.push({a.weight + b.weight, 255 + static_cast<int>(children.size())});
  }
  // Depths from the root down (the root is the last node made).
  std::vector<int> depth(children.size(), 0);
  for (size_t i = children.size(); i-- > 0;) {
    for (int child : children[i]) {
      int d = depth[i] + 1;
      if (child < 256) {
        lengths[child] = static_cast<uint8_t>(std::min(d, 255));
      } else {
        depth[child - 256] = d;
      }
    }
  }
  return lengths;
}

} // namespace

std::array<uint8_t, 256> code_lengths(std::array<uint64_t, 256> counts) {
  // Halving the counts flattens the code until its longest length fits: a little worse than
  // package-merge where it matters (rare symbols), the same elsewhere, and short.
  for (;;) {
    std::array<uint8_t, 256> lengths = huffman_once(counts);
    if (*std::max_element(lengths.begin(), lengths.end()) <= kMaxCodeBits) return lengths;
    for (uint64_t& c : counts) c = c > 0 ? std::max<uint64_t>(1, c >> 1) : 0;
  }
}

std::array<uint16_t, 256> canonical_codes(std::span<const uint8_t, 256> lengths) {
  std::array<int, kMaxCodeBits + 1> per_length{};
  for (uint8_t len : lengths) {
    BLOCKSWAP_CHECK(len <= kMaxCodeBits, "compressed block: a code length of ", int(len),
                    " bits, over the codec's ", kMaxCodeBits);
    if (len > 0) ++per_length[len];
  }
  // Kraft: the codes must fit in 2^kMaxCodeBits leaves of the longest length.
  uint64_t leaves = 0;
  for (int len = 1; len <= kMaxCodeBits; ++len) {
    leaves += static_cast<uint64_t>(per_length[len]) << (kMaxCodeBits - len);
  }
  BLOCKSWAP_CHECK(leaves <= (1u << kMaxCodeBits),
                  "compressed block: its code lengths are no prefix code (Kraft sum ", leaves, "/",
                  1u << kMaxCodeBits, ")");
  std::array<uint32_t, kMaxCodeBits + 2> next{};
  for (int len = 1; len <= kMaxCodeBits; ++len) {
    next[len + 1] = (next[len] + per_length[len]) << 1;
  }
  std::array<uint16_t, 256> codes{};
  for (int s = 0; s < 256; ++s) {
    if (lengths[s] > 0) codes[s] = static_cast<uint16_t>(next[lengths[s]]++);
  }
  return codes;
}

std::vector<uint16_t> decode_table(std::span<const uint8_t, 256> lengths) {
  std::array<uint16_t, 256> codes = canonical_codes(lengths);
  std::vector<uint16_t> table(size_t{1} << kMaxCodeBits, 0);
  for (int s = 0; s < 256; ++s) {
    int len = lengths[s];
    if (len == 0) continue;
    uint32_t first = static_cast<uint32_t>(codes[s]) << (kMaxCodeBits - len);
    uint32_t span = 1u << (kMaxCodeBits - len);
    std::fill_n(table.begin() + first, span, static_cast<uint16_t>((s << 4) | len));
  }
  return table;
}

namespace {

constexpr uint64_t P1 = 11400714785074694791ULL;
constexpr uint64_t P2 = 14029467366897019727ULL;
constexpr uint64_t P3 = 1609587929392839161ULL;
constexpr uint64_t P4 = 9650029242287828579ULL;
constexpr uint64_t P5 = 2870177450012600261ULL;

inline uint64_t rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}
inline uint64_t read64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t read32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t round(uint64_t acc, uint64_t input) {
  return rotl(acc + input * P2, 31) * P1;
}
inline uint64_t merge(uint64_t acc, uint64_t v) {
  return (acc ^ round(0, v)) * P1 + P4;
}

} // namespace

uint64_t checksum(std::span<const std::byte> bytes) {
  const std::byte* p = bytes.data();
  const std::byte* end = p + bytes.size();
  uint64_t h;
  if (bytes.size() >= 32) {
    uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = 0 - P1;
    for (; p + 32 <= end; p += 32) {
      v1 = round(v1, read64(p));
      v2 = round(v2, read64(p + 8));
      v3 = round(v3, read64(p + 16));
      v4 = round(v4, read64(p + 24));
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(merge(merge(merge(h, v1), v2), v3), v4);
  } else {
    h = P5;
  }
  h += bytes.size();
  for (; p + 8 <= end; p += 8) h = rotl(h ^ round(0, read64(p)), 27) * P1 + P4;
  if (p + 4 <= end) {
    h = rotl(h ^ (static_cast<uint64_t>(read32(p)) * P1), 23) * P2 + P3;
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

} // namespace blockswap::codec
