// The codec's pieces that are not the format: length-limited Huffman code lengths, canonical
// codes and their decode table, and the checksum (core/codec.hpp).
#include <algorithm>
#include <array>
#include <queue>

#include "blockswap/core/codec.hpp"
#include "blockswap/core/error.hpp"
#include "codec_chunk.hpp"
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
  std::array<uint16_t, 256> codes{};
  if (!chunk::canonical_codes(lengths.data(), codes.data())) {
    const uint8_t longest = *std::max_element(lengths.begin(), lengths.end());
    BLOCKSWAP_CHECK(longest <= kMaxCodeBits, "compressed block: a code length of ", int(longest),
                    " bits, over the codec's ", kMaxCodeBits);
    BLOCKSWAP_CHECK(false, "compressed block: its code lengths are no prefix code");
  }
  return codes;
}

std::vector<uint16_t> decode_table(std::span<const uint8_t, 256> lengths) {
  const std::array<uint16_t, 256> codes = canonical_codes(lengths);
  std::vector<uint16_t> table(size_t{1} << kMaxCodeBits, 0);
  for (int s = 0; s < 256; ++s) chunk::fill_table(s, lengths[s], codes[s], table.data());
  return table;
}

uint64_t xxhash64(std::span<const std::byte> bytes) {
  return chunk::xxhash64(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

uint64_t checksum(std::span<const std::byte> bytes) {
  const uint64_t pages = (bytes.size() + kChecksumPage - 1) / kChecksumPage;
  std::vector<uint8_t> hashes(pages * 8);
  for (uint64_t i = 0; i < pages; ++i) {
    const uint64_t h =
        xxhash64(bytes.subspan(i * kChecksumPage)
                     .first(std::min<uint64_t>(kChecksumPage, bytes.size() - i * kChecksumPage)));
    for (int b = 0; b < 8; ++b) hashes[i * 8 + b] = static_cast<uint8_t>(h >> (8 * b));
  }
  return chunk::xxhash64(hashes.data(), hashes.size());
}

} // namespace blockswap::codec
