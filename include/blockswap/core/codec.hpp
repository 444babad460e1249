// The lossless codec of frozen weights (DESIGN.md "Compressed weights", issue 45): a block's
// packed bytes, with the ranges that hold floating-point values, become one self-describing
// compressed block; decoding gives back the same bytes, bit for bit, or throws Error.
//
//   std::vector<codec::Range> ranges = {{0, bytes, codec::DType::bf16}};
//   std::vector<std::byte> packed = codec::encode(block_bytes, ranges);
//   std::vector<std::byte> back(codec::decoded_size(packed));
//   codec::decode(packed, back); // == block_bytes, or Error
//
// How (measured in docs/performance.md, "Lossless compression of frozen weights"): each value
// of a floating range is split into one symbol byte and the rest of its bytes. The symbol is the
// exponent for bf16 and fp32 (sign and mantissa are close to random: stored raw), the high byte
// for fp16 and the whole byte for fp8. Symbols are coded with a canonical Huffman code of at
// most kMaxCodeBits bits, one table per segment, in chunks of kChunkValues values that decode
// independently (a GPU thread or a CPU core each). Everything else is stored raw, and so is a
// segment, or the whole block, that does not shrink.
//
// The format (little-endian):
//   header   magic u32 "BSZ1", version u16, flags u16 (1: stored raw), segments u32, 0 u32,
//            decoded bytes u64, checksum u64 (checksum() of the decoded bytes)
//   stored raw: the decoded bytes follow
//   otherwise a table of `segments` entries {dtype u8, 0 u8[7], out bytes u64, payload u64},
//   then each segment's payload in order. The segments tile the decoded bytes in order. A raw
//   segment's payload is its bytes; a coded segment's is 256 code lengths (u8, 0: absent),
//   chunks+1 byte offsets u64 of each chunk's bits (0 first, the bits' size last), the bits
//   (each chunk's codes MSB first, zero-padded to a byte), then the values' rest bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace blockswap::codec {

// How the values of a range are split: the symbol byte and width-1 rest bytes per value.
enum class DType : uint8_t { raw = 0, bf16 = 1, fp16 = 2, fp32 = 3, fp8 = 4 };

inline constexpr uint32_t kMagic = 0x315a5342; // "BSZ1"
inline constexpr uint16_t kVersion = 1;
inline constexpr int kMaxCodeBits = 12;
inline constexpr uint64_t kChunkValues = 4096;
inline constexpr size_t kHeaderBytes = 32;
inline constexpr size_t kEntryBytes = 24;

// Bytes per value of a dtype (raw: 1).
int width(DType dtype);
const char* name(DType dtype);

// Bytes [offset, offset + bytes) of the block hold values of dtype. Ranges are sorted, do not
// overlap and lie inside the block; bytes is a multiple of the dtype's width. Bytes outside
// every range are stored raw.
struct Range {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  DType dtype = DType::raw;
};

// The compressed block of `raw` (Error for ranges that break the rules above).
std::vector<std::byte> encode(std::span<const std::byte> raw, std::span<const Range> ranges);

// One segment of a parsed block: where its bytes go and where its parts are in the block.
struct Segment {
  DType dtype = DType::raw; // raw: copy `out_bytes` from `rest_at`
  uint64_t out_offset = 0;  // in the decoded bytes
  uint64_t out_bytes = 0;
  uint64_t values = 0;     // out_bytes / width
  uint64_t chunks = 0;     // ceil(values / kChunkValues)
  uint64_t lengths_at = 0; // 256 code lengths
  uint64_t offsets_at = 0; // chunks + 1 offsets, relative to bits_at
  uint64_t bits_at = 0;
  uint64_t bits_bytes = 0;
  uint64_t rest_at = 0; // values * (width - 1) rest bytes; a raw segment's bytes
};

struct Parsed {
  uint64_t decoded_bytes = 0;
  uint64_t checksum = 0;
  bool stored_raw = false; // the decoded bytes follow the header
  std::vector<Segment> segments;
};

// The block's structure, every size and offset checked against the block's bytes, every code
// table checked to be a prefix code, chunk offsets in order (Error otherwise): what a decoder
// on any device reads, and where, stays inside the block. The bits themselves are checked by
// decoding them.
Parsed parse(std::span<const std::byte> block);

// The decoded size the header states (Error for a block too short or not this format).
uint64_t decoded_size(std::span<const std::byte> block);

// Decodes `block` into `out` (exactly decoded_size bytes) on the calling thread: the reference
// decoder, and the emulated device's. Error when the block is damaged: its structure, a code,
// a chunk that does not end where its offsets say, or the checksum of what was decoded.
void decode(std::span<const std::byte> block, std::span<std::byte> out);

// The block's checksum: xxHash64 (seed 0) of the xxHash64s (u64 little-endian) of each
// kChecksumPage bytes (the last page shorter), so that a GPU hashes pages in parallel.
inline constexpr uint64_t kChecksumPage = 64 * 1024;
uint64_t checksum(std::span<const std::byte> bytes);

// xxHash64 (seed 0) of bytes.
uint64_t xxhash64(std::span<const std::byte> bytes);

// The decode table of a segment's code lengths: 2^kMaxCodeBits entries, each
// (symbol << 4) | code length, 0 where no code starts (only for a code that is not complete).
// Error for lengths over kMaxCodeBits or lengths that are no prefix code.
std::vector<uint16_t> decode_table(std::span<const uint8_t, 256> lengths);

} // namespace blockswap::codec
