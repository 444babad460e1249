#include "blockswap/core/host_store.hpp"

#include <cstring>
#include <utility>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"

namespace blockswap {

HostStore::HostStore(std::shared_ptr<Backend> backend, const std::vector<std::size_t>& block_bytes,
                     const std::vector<std::size_t>& trainable_bytes,
                     std::vector<std::shared_ptr<Buffer>> memory, const std::string& label,
                     const std::vector<bool>& in_file, const std::vector<int64_t>& order,
                     const std::vector<std::size_t>& memory_compressed)
    : backend_(std::move(backend)), caller_memory_(!memory.empty()) {
  const std::size_t n = block_bytes.size();
  BLOCKSWAP_CHECK(memory.empty() || memory.size() == n, "[", label, "] host_memory has ",
                  memory.size(), " entries for ", n, " blocks: give one per block, or none");
  BLOCKSWAP_CHECK(trainable_bytes.empty() || trainable_bytes.size() == n, "[", label,
                  "] trainable_bytes has ", trainable_bytes.size(), " entries for ", n,
                  " blocks: give one per block, or none");
  BLOCKSWAP_CHECK(memory_compressed.empty() || (caller_memory_ && memory_compressed.size() == n),
                  "[", label, "] host_memory_compressed has ", memory_compressed.size(),
                  " entries for ", n, " blocks", caller_memory_ ? "" : " and no host_memory",
                  ": give one per block of host_memory, or none");
  BLOCKSWAP_CHECK(in_file.empty() || in_file.size() == n, "[", label, "] the file tier has ",
                  in_file.size(), " entries for ", n, " blocks: give one per block, or none");
  blocks_.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    Block& block = blocks_[i];
    block.bytes = block_bytes[i];
    block.in_file = !in_file.empty() && in_file[i];
    block.trainable = !trainable_bytes.empty()          ? trainable_bytes[i]
                      : caller_memory_ || block.in_file ? 0
                                                        : block.bytes;
    BLOCKSWAP_CHECK(block.trainable <= block.bytes, "[", label, "] block ", i, " has ", block.bytes,
                    " bytes, fewer than its ", block.trainable, " trainable bytes");
    block.trainable_at = block.bytes - block.trainable;
    if (block.in_file) {
      BLOCKSWAP_CHECK(block.trainable == 0, "[", label, "] block ", i, " has ", block.trainable,
                      " trainable bytes, which cannot live in the model's file: the file tier "
                      "holds frozen blocks only (give the host budget room for this block)");
      continue;
    }
    if (!caller_memory_) continue; // allocated below
    block.host = std::move(memory[i]);
    BLOCKSWAP_CHECK(block.trainable == 0, "[", label, "] block ", i,
                    " has trainable bytes, which cannot live in host memory the engine does "
                    "not own (EngineOptions::host_memory)");
    if (!memory_compressed.empty() && memory_compressed[i] > 0) {
      caller_compressed(i, memory_compressed[i], label);
      continue;
    }
    BLOCKSWAP_CHECK(block.host != nullptr && block.host->size() >= block.bytes, "[", label,
                    "] EngineOptions::host_memory of block ", i, " holds fewer than its ",
                    block.bytes, " bytes");
  }
  if (caller_memory_) return;
  // In `order` (pinned memory may run out: the first blocks get it), then any left out.
  std::vector<std::size_t> sequence;
  for (int64_t b : order) sequence.push_back(static_cast<std::size_t>(b));
  for (std::size_t b = 0; b < n; ++b) sequence.push_back(b);
  for (std::size_t b : sequence) {
    BLOCKSWAP_CHECK(b < n, "[", label, "] the allocation order names block ", b, " of ", n);
    Block& block = blocks_[b];
    if (block.in_file || block.host) continue;
    block.host = std::make_shared<Buffer>(backend_->allocate_host(block.bytes));
  }
}

// Note [compressed host copies]: the caller's memory, compressed by whoever filled it (the
// node-shared copy, Note [compressed node-shared copy] in torch/node_sharing.cpp). Its
// structure is checked here, its bits at each decode (the checksum).
void HostStore::caller_compressed(std::size_t block, std::size_t compressed,
                                  const std::string& label) {
  Block& b = blocks_[block];
  BLOCKSWAP_CHECK(b.host != nullptr && b.host->size() >= compressed, "[", label,
                  "] EngineOptions::host_memory of block ", block, " holds fewer than its ",
                  compressed, " compressed bytes");
  auto parsed = std::make_shared<const codec::Parsed>(
      codec::parse(std::span<const std::byte>(b.host->data(), compressed)));
  BLOCKSWAP_CHECK(parsed->decoded_bytes == b.bytes, "[", label, "] block ", block,
                  "'s compressed bytes in EngineOptions::host_memory decode to ",
                  parsed->decoded_bytes, " bytes, not its ", b.bytes);
  b.parsed = std::move(parsed);
  b.compressed = compressed;
  b.trainable_at = layout::align_up(compressed);
}

void HostStore::reallocate(int64_t block, const std::function<void()>& meanwhile) {
  Block& b = blocks_[block];
  BLOCKSWAP_ASSERT(!caller_memory_ && !b.in_file && !b.spare, "block ", block,
                   " cannot be reallocated");
  b.host.reset();
  meanwhile();
  b.host = std::make_shared<Buffer>(backend_->allocate_host(b.bytes));
}

// Note [compressed host copies]
// A block's frozen bytes never change on the device (only its trainable bytes are written back),
// so they may be stored in a form the device decodes on the way in (DESIGN.md "Compressed
// weights"; Note [a decode step] in load_pipeline.cpp): codec::encode's lossless block, with a
// checksum of the raw bytes. The block's buffer is then [compressed frozen bytes | padding to
// layout::kAlignment | trainable bytes]: the trainable bytes keep their own region (the first of
// the two of Note [atomic write-back]), aligned so that views of them stay aligned. The raw
// buffer is freed: the host memory saved is real.
// A block the copy stream reads from where it is needs its new buffer pinned (a copy from
// pageable memory could not overlap): one the system would not pin stays raw. A staged block
// (in memory the system would not pin, Note [pageable host memory] in load_pipeline.cpp) is
// copied into a pinned staging buffer anyway, so its new buffer may be pageable: the staging
// ring then holds its compressed bytes, and its reader is pointed at them (LoadPipeline::
// compress). Pageable blocks are there when host memory is short, where the saving counts most.
// The caller's memory is never written by the store: its filler compresses it instead, once,
// for every process that maps it (EngineOptions::host_memory_compressed: the node-shared copy,
// Note [compressed node-shared copy] in torch/node_sharing.cpp). The blocks in the file are not
// compressed: the file tier reads the file as it is.
bool HostStore::compress(int64_t block, std::span<const codec::Range> ranges, bool staged) {
  Block& b = blocks_[block];
  BLOCKSWAP_ASSERT(!caller_memory_ && !b.in_file && b.host && !b.parsed && !b.spare &&
                       (staged || !b.host->pageable()),
                   "block ", block, " cannot be compressed");
  const std::size_t frozen = b.bytes - b.trainable;
  if (frozen == 0) return false;
  std::vector<std::byte> packed =
      codec::encode(std::span<const std::byte>(b.host->data(), frozen), ranges);
  const std::size_t at = layout::align_up(packed.size());
  if (at + b.trainable >= layout::align_up(frozen) + b.trainable) return false; // no smaller
  Buffer host = backend_->allocate_host(at + b.trainable);
  if (host.pageable() && !staged) return false;
  std::memcpy(host.data(), packed.data(), packed.size());
  std::memset(host.data() + packed.size(), 0, at - packed.size());
  if (b.trainable > 0) std::memcpy(host.data() + at, b.host->data() + frozen, b.trainable);
  b.parsed = std::make_shared<const codec::Parsed>(
      codec::parse(std::span<const std::byte>(host.data(), packed.size())));
  b.host = std::make_shared<Buffer>(std::move(host));
  b.compressed = packed.size();
  b.trainable_at = at;
  return true;
}

// Note [changed compressed weights]
// The caller may change frozen weights between passes (a checkpoint loaded, an adapter merged:
// Note [changed tensors] in torch/block_binder.cpp). A compressed block has no raw copy to write
// them into, so its frozen bytes are encoded again as a whole, into a new buffer, the old one
// freed once no copy reads it. The decode buffer was sized for the largest block compressed at
// first; new bytes that compress worse than fits it, or not at all, are stored raw: the block
// then loads as an uncompressed one, exactly, and costs its raw bytes of host memory. The packed
// region's trainable bytes move with the buffer (a pending write-back into it is done by then:
// the engine waits for it), the spare stays where it is. A staged block's new buffer may be
// pageable, as at compress(); the load pipeline holds the reads ahead around the change and
// points the staging ring's reader at the new buffer (LoadPipeline::replace_frozen).
bool HostStore::replace_frozen(int64_t block, std::span<const std::byte> raw,
                               std::span<const codec::Range> ranges, std::size_t most) {
  Block& b = blocks_[block];
  const std::size_t frozen = b.bytes - b.trainable;
  BLOCKSWAP_ASSERT(b.parsed && b.host && raw.size() == frozen, "block ", block,
                   "'s frozen bytes cannot be replaced");
  std::vector<std::byte> packed = codec::encode(raw, ranges);
  const bool shrinks =
      packed.size() <= most && layout::align_up(packed.size()) < layout::align_up(frozen);
  const std::size_t stored = shrinks ? packed.size() : frozen;
  const std::size_t at = shrinks ? layout::align_up(stored) : frozen;
  Buffer host = backend_->allocate_host(at + b.trainable);
  std::memcpy(host.data(), shrinks ? packed.data() : raw.data(), stored);
  std::memset(host.data() + stored, 0, at - stored);
  if (b.trainable > 0) std::memcpy(host.data() + at, b.host->data() + b.trainable_at, b.trainable);
  b.parsed = shrinks ? std::make_shared<const codec::Parsed>(
                           codec::parse(std::span<const std::byte>(host.data(), packed.size())))
                     : nullptr;
  b.host = std::make_shared<Buffer>(std::move(host));
  b.compressed = shrinks ? packed.size() : 0;
  b.trainable_at = at;
  return shrinks;
}

bool HostStore::model_compressed(int64_t block, std::size_t compressed_bytes) {
  Block& b = blocks_[block];
  BLOCKSWAP_ASSERT(!backend_->holds_data() && !caller_memory_ && !b.in_file && b.host && !b.parsed,
                   "block ", block, " cannot be modelled compressed");
  const std::size_t frozen = b.bytes - b.trainable;
  if (compressed_bytes == 0 || compressed_bytes >= frozen) return false;
  const std::size_t at = layout::align_up(compressed_bytes);
  b.host = std::make_shared<Buffer>(backend_->allocate_host(at + b.trainable));
  auto parsed = std::make_shared<codec::Parsed>();
  parsed->decoded_bytes = frozen;
  b.parsed = std::move(parsed);
  b.compressed = compressed_bytes;
  b.trainable_at = at;
  return true;
}

std::size_t HostStore::host_bytes(int64_t block) const {
  const Block& b = blocks_[block];
  return (b.host ? b.host->size() : 0) + (b.spare ? b.spare->size() : 0);
}

HostRegion HostStore::trainable(int64_t block) const {
  const Block& b = blocks_[block];
  return region(b, b.current);
}

// Note [atomic write-back]
// A block changed on the device is copied back when it is evicted, not over its host copy: a
// copy that fails part-way must not leave the host copy half old, half new. Its trainable bytes
// have two host regions; the write-back goes to the one that is not authoritative, and once the
// copy stream has confirmed everything up to it (the engine's synchronize) that region becomes
// authoritative, and the engine's listener is told where the bytes now are. Nothing is copied
// on the host. Until then a load of the block reads the pending region (the copy stream runs in
// order, so the write-back is done by then). When a copy fails first, pending write-backs are
// dropped: every such block's authoritative region keeps the values from before its changes,
// and the engine's error names it.
HostStore::WriteBack HostStore::begin_write_back(int64_t block) {
  Block& b = blocks_[block];
  BLOCKSWAP_ASSERT(b.trainable > 0 && !caller_memory_, "block ", block, " cannot be written back");
  if (!b.spare) b.spare = std::make_shared<Buffer>(backend_->allocate_host(b.trainable));
  if (!b.written) b.written = backend_->make_event();
  b.pending = true;
  return WriteBack{region(b, other(b.current)), *b.written};
}

HostRegion HostStore::commit(int64_t block) {
  Block& b = blocks_[block];
  BLOCKSWAP_ASSERT(b.pending, "block ", block, " has no write-back to commit");
  b.current = other(b.current);
  b.pending = false;
  return region(b, b.current);
}

} // namespace blockswap
