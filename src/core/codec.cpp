// The codec's format: encode, parse and the reference decoder (core/codec.hpp).
#include "blockswap/core/codec.hpp"

#include <algorithm>
#include <array>
#include <cstring>

#include "blockswap/core/error.hpp"
#include "codec_chunk.hpp"
#include "codec_impl.hpp"

namespace blockswap::codec {

int width(DType dtype) {
  switch (dtype) {
  case DType::bf16:
  case DType::fp16:
    return 2;
  case DType::fp32:
    return 4;
  default:
    return 1;
  }
}

const char* name(DType dtype) {
  switch (dtype) {
  case DType::raw:
    return "raw";
  case DType::bf16:
    return "bf16";
  case DType::fp16:
    return "fp16";
  case DType::fp32:
    return "fp32";
  case DType::fp8:
    return "fp8";
  }
  return "?";
}

namespace {

// A gap this small between two ranges of one dtype joins them into one segment: the gap's bytes
// are coded as values too (lossless, Note [codec value split]), and one table serves both.
constexpr uint64_t kJoinGap = 4096;

void put64(std::vector<std::byte>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>(v >> (8 * i)));
}

uint64_t get64(std::span<const std::byte> block, uint64_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(block[at + i]);
  return v;
}

struct Piece {
  DType dtype;
  uint64_t offset, bytes;
};

std::vector<Piece> pieces_of(uint64_t size, std::span<const Range> ranges) {
  std::vector<Piece> out;
  uint64_t end = 0; // of the previous range
  for (const Range& r : ranges) {
    BLOCKSWAP_CHECK(static_cast<uint8_t>(r.dtype) <= static_cast<uint8_t>(DType::fp8),
                    "codec::encode: a range of unknown dtype ", int(r.dtype));
    BLOCKSWAP_CHECK(r.offset >= end, "codec::encode: range at ", r.offset,
                    " overlaps the previous one or is out of order (it ended at ", end, ")");
    BLOCKSWAP_CHECK(r.bytes <= size && r.offset <= size - r.bytes, "codec::encode: range [",
                    r.offset, ", +", r.bytes, ") lies outside the block of ", size, " bytes");
    const uint64_t w = width(r.dtype);
    BLOCKSWAP_CHECK(r.bytes % w == 0, "codec::encode: range at ", r.offset, " of ", r.bytes,
                    " bytes is no whole number of ", name(r.dtype), " values");
    if (r.bytes == 0) continue;
    const uint64_t gap = r.offset - end;
    if (!out.empty() && out.back().dtype == r.dtype && r.dtype != DType::raw &&
        out.back().offset + out.back().bytes == end && gap % w == 0 && gap <= kJoinGap) {
      out.back().bytes = r.offset + r.bytes - out.back().offset;
    } else {
      if (gap > 0) out.push_back({DType::raw, end, gap});
      out.push_back({r.dtype, r.offset, r.bytes});
    }
    end = r.offset + r.bytes;
  }
  if (end < size) out.push_back({DType::raw, end, size - end});
  std::vector<Piece> merged;
  for (const Piece& p : out) {
    if (!merged.empty() && merged.back().dtype == DType::raw && p.dtype == DType::raw) {
      merged.back().bytes += p.bytes;
    } else {
      merged.push_back(p);
    }
  }
  return merged;
}

// The coded payload of bytes as values of D, or empty where it would not be smaller.
template <DType D> std::vector<std::byte> code_piece(std::span<const std::byte> bytes) {
  constexpr int w = width_of(D);
  const uint64_t values = bytes.size() / w;
  const uint64_t chunks = (values + kChunkValues - 1) / kChunkValues;
  std::vector<uint8_t> symbols(values);
  std::array<uint64_t, 256> counts{};
  for (uint64_t i = 0; i < values; ++i) {
    symbols[i] = symbol_of<D>(bytes.data() + i * w);
    ++counts[symbols[i]];
  }
  const std::array<uint8_t, 256> lengths = code_lengths(counts);
  uint64_t bits = 0;
  for (int s = 0; s < 256; ++s) bits += counts[s] * lengths[s];
  const uint64_t head = 256 + 8 * (chunks + 1);
  const uint64_t rest_bytes = values * (w - 1);
  if (head + bits / 8 + rest_bytes >= bytes.size()) return {};
  const std::array<uint16_t, 256> codes = canonical_codes(lengths);

  // Each chunk pads to a byte: at most one byte more per chunk than the bits.
  std::vector<std::byte> out(head + bits / 8 + chunks + rest_bytes);
  std::memcpy(out.data(), lengths.data(), 256);
  auto* const bits_at = reinterpret_cast<uint8_t*>(out.data() + head);
  uint8_t* at = bits_at;
  auto put_offset = [&](uint64_t c) {
    const uint64_t offset = static_cast<uint64_t>(at - bits_at);
    for (int i = 0; i < 8; ++i) out[256 + 8 * c + i] = static_cast<std::byte>(offset >> (8 * i));
  };
  put_offset(0);
  for (uint64_t c = 0; c < chunks; ++c) {
    uint64_t acc = 0;
    int pending = 0; // bits of acc not yet written, at its low end
    const uint64_t last = std::min(values, (c + 1) * kChunkValues);
    for (uint64_t i = c * kChunkValues; i < last; ++i) {
      acc = (acc << lengths[symbols[i]]) | codes[symbols[i]];
      pending += lengths[symbols[i]];
      if (pending >= 32) {
        pending -= 32;
        const auto word = static_cast<uint32_t>(acc >> pending);
        at[0] = static_cast<uint8_t>(word >> 24);
        at[1] = static_cast<uint8_t>(word >> 16);
        at[2] = static_cast<uint8_t>(word >> 8);
        at[3] = static_cast<uint8_t>(word);
        at += 4;
      }
    }
    for (; pending >= 8; pending -= 8) *at++ = static_cast<uint8_t>(acc >> (pending - 8));
    if (pending > 0) *at++ = static_cast<uint8_t>(acc << (8 - pending));
    put_offset(c + 1);
  }
  out.resize(head + static_cast<uint64_t>(at - bits_at) + rest_bytes);
  std::byte* rest = out.data() + head + (at - bits_at);
  for (uint64_t i = 0; i < values; ++i) rest_of<D>(bytes.data() + i * w, rest + i * (w - 1));
  if (out.size() >= bytes.size()) return {};
  return out;
}

std::vector<std::byte> code_piece(DType dtype, std::span<const std::byte> bytes) {
  switch (dtype) {
  case DType::bf16:
    return code_piece<DType::bf16>(bytes);
  case DType::fp16:
    return code_piece<DType::fp16>(bytes);
  case DType::fp32:
    return code_piece<DType::fp32>(bytes);
  default:
    return code_piece<DType::fp8>(bytes);
  }
}

// Decodes chunk c of segment s (Error when it is damaged: `out` then holds garbage in it).
template <DType D>
void decode_chunk(const Segment& s, uint64_t c, std::span<const std::byte> block,
                  const uint16_t* table, std::byte* out) {
  constexpr int w = width_of(D);
  const uint64_t first = c * kChunkValues;
  const uint64_t n = std::min(kChunkValues, s.values - first);
  const uint64_t begin = get64(block, s.offsets_at + 8 * c);
  const uint64_t end = get64(block, s.offsets_at + 8 * (c + 1));
  const auto* bits = reinterpret_cast<const uint8_t*>(block.data() + s.bits_at);
  const auto* rest = reinterpret_cast<const uint8_t*>(block.data() + s.rest_at) + first * (w - 1);
  auto* value = reinterpret_cast<uint8_t*>(out + s.out_offset) + first * w;
  BLOCKSWAP_CHECK(chunk::decode<D>(bits + begin, bits + end, table, n, rest, value),
                  "compressed block: segment at ", s.out_offset, ", chunk ", c,
                  ": its bits are no codes of its table or do not end with its ", n, " values");
}

void decode_segment(const Segment& s, std::span<const std::byte> block, const uint16_t* table,
                    std::byte* out) {
  for (uint64_t c = 0; c < s.chunks; ++c) {
    switch (s.dtype) {
    case DType::bf16:
      decode_chunk<DType::bf16>(s, c, block, table, out);
      break;
    case DType::fp16:
      decode_chunk<DType::fp16>(s, c, block, table, out);
      break;
    case DType::fp32:
      decode_chunk<DType::fp32>(s, c, block, table, out);
      break;
    default:
      decode_chunk<DType::fp8>(s, c, block, table, out);
    }
  }
}

} // namespace

std::vector<std::byte> encode(std::span<const std::byte> raw, std::span<const Range> ranges) {
  std::vector<Piece> pieces = pieces_of(raw.size(), ranges);
  std::vector<std::vector<std::byte>> payloads;
  for (Piece& p : pieces) {
    std::vector<std::byte> coded;
    if (p.dtype != DType::raw) coded = code_piece(p.dtype, raw.subspan(p.offset, p.bytes));
    if (coded.empty()) p.dtype = DType::raw;
    payloads.push_back(std::move(coded));
  }
  std::vector<std::byte> out;
  auto header = [&](uint16_t flags, uint32_t segments) {
    out.clear();
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::byte>(kMagic >> (8 * i)));
    out.push_back(static_cast<std::byte>(kVersion));
    out.push_back(static_cast<std::byte>(kVersion >> 8));
    out.push_back(static_cast<std::byte>(flags));
    out.push_back(std::byte{0});
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::byte>(segments >> (8 * i)));
    out.insert(out.end(), 4, std::byte{0});
    put64(out, raw.size());
    put64(out, checksum(raw));
  };
  header(0, static_cast<uint32_t>(pieces.size()));
  for (size_t i = 0; i < pieces.size(); ++i) {
    out.push_back(static_cast<std::byte>(pieces[i].dtype));
    out.insert(out.end(), 7, std::byte{0});
    put64(out, pieces[i].bytes);
    put64(out, pieces[i].dtype == DType::raw ? pieces[i].bytes : payloads[i].size());
  }
  for (size_t i = 0; i < pieces.size() && out.size() < raw.size() + kHeaderBytes; ++i) {
    if (pieces[i].dtype == DType::raw) {
      auto bytes = raw.subspan(pieces[i].offset, pieces[i].bytes);
      out.insert(out.end(), bytes.begin(), bytes.end());
    } else {
      out.insert(out.end(), payloads[i].begin(), payloads[i].end());
    }
  }
  if (out.size() >= raw.size() + kHeaderBytes || pieces.size() > UINT32_MAX) {
    header(1, 0); // stored raw: it does not shrink
    out.insert(out.end(), raw.begin(), raw.end());
  }
  return out;
}

uint64_t decoded_size(std::span<const std::byte> block) {
  BLOCKSWAP_CHECK(block.size() >= kHeaderBytes, "compressed block: ", block.size(),
                  " bytes, shorter than its ", kHeaderBytes, "-byte header");
  const uint64_t magic = get64(block, 0) & 0xFFFFFFFFu;
  BLOCKSWAP_CHECK(magic == kMagic, "compressed block: magic 0x", std::hex, magic,
                  " is not blockswap's 0x", kMagic);
  const uint64_t decoded = get64(block, 16);
  // No value codes in under 1 bit: a larger size is damage, not a block to allocate for.
  BLOCKSWAP_CHECK(decoded / 8 <= block.size(), "compressed block: ", decoded,
                  " decoded bytes stated for ", block.size(), " stored");
  return decoded;
}

Parsed parse(std::span<const std::byte> block) {
  Parsed p;
  p.decoded_bytes = decoded_size(block);
  const uint64_t word = get64(block, 0) >> 32; // version u16, flags u16
  const uint64_t segments = get64(block, 8) & 0xFFFFFFFFu;
  BLOCKSWAP_CHECK((word & 0xFFFF) == kVersion, "compressed block: version ", word & 0xFFFF,
                  ", this build reads ", kVersion);
  BLOCKSWAP_CHECK((word >> 16) <= 1 && (get64(block, 8) >> 32) == 0,
                  "compressed block: unknown flags 0x", std::hex, word >> 16);
  p.checksum = get64(block, 24);
  p.stored_raw = (word >> 16) == 1;
  const uint64_t size = block.size();
  if (p.stored_raw) {
    BLOCKSWAP_CHECK(segments == 0 && size - kHeaderBytes == p.decoded_bytes,
                    "compressed block: stored raw, ", size - kHeaderBytes, " bytes for ",
                    p.decoded_bytes, " decoded (", segments, " segments)");
    return p;
  }
  BLOCKSWAP_CHECK(segments >= 1 && segments <= (size - kHeaderBytes) / kEntryBytes,
                  "compressed block: ", segments, " segments do not fit its ", size, " bytes");
  uint64_t at = kHeaderBytes + segments * kEntryBytes;
  uint64_t out = 0;
  for (uint64_t i = 0; i < segments; ++i) {
    const uint64_t entry = kHeaderBytes + i * kEntryBytes;
    Segment s;
    const uint64_t kind = get64(block, entry);
    BLOCKSWAP_CHECK(kind <= static_cast<uint64_t>(DType::fp8), "compressed block: segment ", i,
                    " of unknown kind 0x", std::hex, kind);
    s.dtype = static_cast<DType>(kind);
    s.out_offset = out;
    s.out_bytes = get64(block, entry + 8);
    const uint64_t payload = get64(block, entry + 16);
    BLOCKSWAP_CHECK(s.out_bytes > 0 && s.out_bytes <= p.decoded_bytes - out && payload <= size - at,
                    "compressed block: segment ", i, " of ", s.out_bytes, " bytes (", payload,
                    " stored) does not fit: ", p.decoded_bytes - out, " decoded and ", size - at,
                    " stored bytes are left");
    const uint64_t w = width(s.dtype);
    s.values = s.out_bytes / w;
    if (s.dtype == DType::raw) {
      BLOCKSWAP_CHECK(payload == s.out_bytes, "compressed block: raw segment ", i, " stores ",
                      payload, " bytes for ", s.out_bytes);
      s.rest_at = at;
    } else {
      s.chunks = (s.values + kChunkValues - 1) / kChunkValues;
      const uint64_t rest = s.values * (w - 1);
      BLOCKSWAP_CHECK(s.out_bytes % w == 0 && payload >= 256 + rest &&
                          (payload - 256 - rest) / 8 > s.chunks,
                      "compressed block: ", name(s.dtype), " segment ", i, " of ", s.out_bytes,
                      " bytes has a payload of ", payload, ", too small for its parts");
      s.lengths_at = at;
      s.offsets_at = at + 256;
      s.bits_at = s.offsets_at + 8 * (s.chunks + 1);
      s.bits_bytes = payload - 256 - 8 * (s.chunks + 1) - rest;
      s.rest_at = s.bits_at + s.bits_bytes;
      std::array<uint8_t, 256> lengths;
      std::memcpy(lengths.data(), block.data() + s.lengths_at, 256);
      canonical_codes(lengths); // checks them
      uint64_t previous = get64(block, s.offsets_at);
      BLOCKSWAP_CHECK(previous == 0, "compressed block: segment ", i, "'s first chunk starts at ",
                      previous, ", not 0");
      for (uint64_t c = 1; c <= s.chunks; ++c) {
        const uint64_t next = get64(block, s.offsets_at + 8 * c);
        BLOCKSWAP_CHECK(next > previous && next <= s.bits_bytes, "compressed block: segment ", i,
                        ", chunk ", c - 1, " spans bits [", previous, ", ", next, ") of ",
                        s.bits_bytes);
        previous = next;
      }
      BLOCKSWAP_CHECK(previous == s.bits_bytes, "compressed block: segment ", i,
                      "'s chunks end at byte ", previous, " of its ", s.bits_bytes, " bits bytes");
    }
    at += payload;
    out += s.out_bytes;
    p.segments.push_back(s);
  }
  BLOCKSWAP_CHECK(out == p.decoded_bytes && at == size, "compressed block: its segments decode ",
                  out, " of ", p.decoded_bytes, " bytes and end at byte ", at, " of ", size);
  return p;
}

void decode(std::span<const std::byte> block, std::span<std::byte> out) {
  const Parsed p = parse(block);
  BLOCKSWAP_CHECK(out.size() == p.decoded_bytes, "codec::decode: ", out.size(),
                  " bytes given for a block of ", p.decoded_bytes);
  if (p.stored_raw && p.decoded_bytes > 0) {
    std::memcpy(out.data(), block.data() + kHeaderBytes, p.decoded_bytes);
  }
  for (const Segment& s : p.segments) {
    if (s.dtype == DType::raw) {
      std::memcpy(out.data() + s.out_offset, block.data() + s.rest_at, s.out_bytes);
      continue;
    }
    std::array<uint8_t, 256> lengths;
    std::memcpy(lengths.data(), block.data() + s.lengths_at, 256);
    const std::vector<uint16_t> table = decode_table(lengths);
    decode_segment(s, block, table.data(), out.data());
  }
  const uint64_t sum = checksum(out);
  BLOCKSWAP_CHECK(sum == p.checksum, "compressed block: the checksum of its ", p.decoded_bytes,
                  " decoded bytes is 0x", std::hex, sum, ", not the stored 0x", p.checksum);
}

} // namespace blockswap::codec
