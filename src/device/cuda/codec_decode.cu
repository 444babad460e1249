// The codec's CUDA decoder (codec_decode.hpp). One thread decodes one chunk of kChunkValues
// values with the same steps as the CPU reference (src/core/codec_chunk.hpp); each thread
// block builds its segment's decode table in shared memory first. Raw segments are device
// copies. Then one thread a 64 KiB page hashes the decoded bytes and one thread hashes the
// hashes against the block's checksum (codec::checksum).
//
// Why so plain: this is the first decoder that runs where the weights go, held bitwise to the
// reference by tests/device/codec_cuda_test.cpp. Its writes are strided by a chunk a thread;
// decoding into shared memory and writing coalesced (DFloat11's way) is the next step once
// gpu-check has measured this one.
#include "codec_decode.hpp"

#include "../../core/codec_chunk.hpp"
#include "blockswap/core/error.hpp"
#include "cuda_check.hpp"

namespace blockswap::cuda_codec {
namespace {

constexpr int kThreads = 128;

uint64_t pages_of(const codec::Parsed& parsed) {
  return (parsed.decoded_bytes + codec::kChecksumPage - 1) / codec::kChecksumPage;
}

template <codec::DType D>
__global__ void decode_chunks(const uint8_t* block, codec::Segment s, uint8_t* out,
                              uint32_t* damage) {
  __shared__ uint16_t table[1 << codec::kMaxCodeBits];
  __shared__ uint16_t codes[256];
  __shared__ bool table_ok;
  const uint8_t* lengths = block + s.lengths_at;
  for (int i = threadIdx.x; i < (1 << codec::kMaxCodeBits); i += blockDim.x) table[i] = 0;
  if (threadIdx.x == 0) table_ok = codec::chunk::canonical_codes(lengths, codes);
  __syncthreads();
  if (!table_ok) {
    if (threadIdx.x == 0) atomicOr(damage, kDamageTable);
    return;
  }
  for (int sym = threadIdx.x; sym < 256; sym += blockDim.x) {
    codec::chunk::fill_table(sym, lengths[sym], codes[sym], table);
  }
  __syncthreads();

  const uint64_t c = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= s.chunks) return;
  constexpr int w = D == codec::DType::bf16 || D == codec::DType::fp16 ? 2
                    : D == codec::DType::fp32                          ? 4
                                                                       : 1;
  const uint64_t first = c * codec::kChunkValues;
  const uint64_t left = s.values - first;
  const uint64_t n = left < codec::kChunkValues ? left : codec::kChunkValues;
  const uint64_t begin = codec::chunk::load_le64(block + s.offsets_at + 8 * c);
  const uint64_t end = codec::chunk::load_le64(block + s.offsets_at + 8 * (c + 1));
  if (!(begin < end && end <= s.bits_bytes)) {
    atomicOr(damage, kDamageOffsets);
    return;
  }
  const uint8_t* bits = block + s.bits_at;
  if (!codec::chunk::decode<D>(bits + begin, bits + end, table, n,
                               block + s.rest_at + first * (w - 1),
                               out + s.out_offset + first * w)) {
    atomicOr(damage, kDamageCodes);
  }
}

__global__ void hash_pages(const uint8_t* out, uint64_t bytes, uint64_t pages, uint64_t* hashes) {
  const uint64_t page = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (page >= pages) return;
  const uint64_t at = page * codec::kChecksumPage;
  const uint64_t left = bytes - at;
  hashes[page] =
      codec::chunk::xxhash64(out + at, left < codec::kChecksumPage ? left : codec::kChecksumPage);
}

__global__ void check_hashes(const uint64_t* hashes, uint64_t pages, uint64_t expected,
                             uint32_t* damage) {
  // The GPU is little-endian: the hashes' bytes are the u64s little-endian, as on the CPU.
  if (codec::chunk::xxhash64(reinterpret_cast<const uint8_t*>(hashes), pages * 8) != expected) {
    atomicOr(damage, kDamageChecksum);
  }
}

__global__ void poison_if_damaged(const uint32_t* damage, uint8_t* out, uint64_t bytes) {
  if (*damage == 0) return;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += stride) {
    out[i] = 0xFF;
  }
}

unsigned grid_for(uint64_t items) {
  const uint64_t blocks = (items + kThreads - 1) / kThreads;
  BLOCKSWAP_CHECK(blocks <= 0x7FFFFFFFu, "cuda codec: ", items, " chunks or pages are too many");
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

} // namespace

size_t workspace_bytes(const codec::Parsed& parsed) {
  return 8 + 8 * pages_of(parsed);
}

void decode_async(const codec::Parsed& parsed, const std::byte* block, std::byte* out,
                  void* workspace, cudaStream_t stream) {
  auto* damage = static_cast<uint32_t*>(workspace);
  auto* hashes = reinterpret_cast<uint64_t*>(static_cast<char*>(workspace) + 8);
  const auto* in = reinterpret_cast<const uint8_t*>(block);
  auto* to = reinterpret_cast<uint8_t*>(out);
  BLOCKSWAP_CUDA_CHECK(cudaMemsetAsync(damage, 0, sizeof(uint32_t), stream));
  if (parsed.stored_raw && parsed.decoded_bytes > 0) {
    BLOCKSWAP_CUDA_CHECK(cudaMemcpyAsync(to, in + codec::kHeaderBytes, parsed.decoded_bytes,
                                         cudaMemcpyDeviceToDevice, stream));
  }
  for (const codec::Segment& s : parsed.segments) {
    switch (s.dtype) {
    case codec::DType::raw:
      BLOCKSWAP_CUDA_CHECK(cudaMemcpyAsync(to + s.out_offset, in + s.rest_at, s.out_bytes,
                                           cudaMemcpyDeviceToDevice, stream));
      continue;
    case codec::DType::bf16:
      decode_chunks<codec::DType::bf16>
          <<<grid_for(s.chunks), kThreads, 0, stream>>>(in, s, to, damage);
      break;
    case codec::DType::fp16:
      decode_chunks<codec::DType::fp16>
          <<<grid_for(s.chunks), kThreads, 0, stream>>>(in, s, to, damage);
      break;
    case codec::DType::fp32:
      decode_chunks<codec::DType::fp32>
          <<<grid_for(s.chunks), kThreads, 0, stream>>>(in, s, to, damage);
      break;
    case codec::DType::fp8:
      decode_chunks<codec::DType::fp8>
          <<<grid_for(s.chunks), kThreads, 0, stream>>>(in, s, to, damage);
      break;
    }
    BLOCKSWAP_CUDA_CHECK(cudaGetLastError());
  }
  const uint64_t pages = pages_of(parsed);
  if (pages > 0) {
    hash_pages<<<grid_for(pages), kThreads, 0, stream>>>(to, parsed.decoded_bytes, pages, hashes);
    BLOCKSWAP_CUDA_CHECK(cudaGetLastError());
  }
  check_hashes<<<1, 1, 0, stream>>>(hashes, pages, parsed.checksum, damage);
  BLOCKSWAP_CUDA_CHECK(cudaGetLastError());
}

void poison_if_damaged_async(const void* workspace, std::byte* out, uint64_t bytes,
                             cudaStream_t stream) {
  if (bytes == 0) return;
  const uint64_t blocks = (bytes + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 1024 ? blocks : 1024);
  poison_if_damaged<<<grid, kThreads, 0, stream>>>(static_cast<const uint32_t*>(workspace),
                                                   reinterpret_cast<uint8_t*>(out), bytes);
  BLOCKSWAP_CUDA_CHECK(cudaGetLastError());
}

void check_damage(uint32_t damage) {
  if (damage == 0) return;
  BLOCKSWAP_CHECK(false, "compressed block damaged, found by the CUDA decoder:",
                  damage & kDamageTable ? " a code table that is no prefix code" : "",
                  damage & kDamageOffsets ? " chunk offsets outside its bits" : "",
                  damage & kDamageCodes ? " bits that are no codes or end elsewhere" : "",
                  damage & kDamageChecksum ? " a checksum that does not match" : "");
}

void decode(const codec::Parsed& parsed, const std::byte* block, std::byte* out, void* workspace,
            cudaStream_t stream) {
  decode_async(parsed, block, out, workspace, stream);
  uint32_t damage = 0;
  BLOCKSWAP_CUDA_CHECK(
      cudaMemcpyAsync(&damage, workspace, sizeof damage, cudaMemcpyDeviceToHost, stream));
  BLOCKSWAP_CUDA_CHECK(cudaStreamSynchronize(stream));
  check_damage(damage);
}

} // namespace blockswap::cuda_codec
