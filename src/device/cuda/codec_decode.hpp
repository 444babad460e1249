// The codec's CUDA decoder (core/codec.hpp): a compressed block already in device memory
// decoded into device memory on a stream, bit for bit what codec::decode gives on the CPU, and
// its checksum checked on the device. Compiled by nvcc where the CUDA toolkit is
// (blockswap::codec_cuda); tests/device/codec_cuda_test.cpp holds it to the CPU reference.
// Implementer-only.
//
//   codec::Parsed parsed = codec::parse(host_block);           // structure checked on the host
//   cuda_codec::decode_async(parsed, device_block, device_out, workspace, stream);
//   ... copy the workspace's first uint32 back after the stream, then check_damage(it)
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "blockswap/core/codec.hpp"

namespace blockswap::cuda_codec {

// Bits of the damage word the decoder leaves at the start of its workspace (0: none).
inline constexpr uint32_t kDamageTable = 1;    // a segment's code lengths are no prefix code
inline constexpr uint32_t kDamageOffsets = 2;  // a chunk's offsets lie outside its bits
inline constexpr uint32_t kDamageCodes = 4;    // a chunk's bits are no codes or end elsewhere
inline constexpr uint32_t kDamageChecksum = 8; // the decoded bytes' checksum is not the block's

// Device bytes decode_async needs as its workspace: the damage word and a hash a checksum page.
size_t workspace_bytes(const codec::Parsed& parsed);

// Enqueues on `stream`: the decode of the compressed block at `block` (device memory, the same
// bytes `parsed` came from on the host) into `out` (device memory, parsed.decoded_bytes), then
// its checksum, the damage found left in the workspace's first uint32 (device memory of
// workspace_bytes). Returns at once; `out` is garbage where the damage word is not 0.
void decode_async(const codec::Parsed& parsed, const std::byte* block, std::byte* out,
                  void* workspace, cudaStream_t stream);

// Enqueues on `stream`: where the damage word decode_async left in `workspace` is not 0, `bytes`
// of `out` filled with 0xFF (NaN in every float dtype), so that a computation that reads a
// damaged block before the host hears of it reads NaN, never a wrong weight. Returns at once.
void poison_if_damaged_async(const void* workspace, std::byte* out, uint64_t bytes,
                             cudaStream_t stream);

// Throws Error naming each kind of damage the word holds; nothing for 0.
void check_damage(uint32_t damage);

// decode_async, then waits for the stream and throws as check_damage does.
void decode(const codec::Parsed& parsed, const std::byte* block, std::byte* out, void* workspace,
            cudaStream_t stream);

} // namespace blockswap::cuda_codec
