// HostStore: each block's authoritative host bytes, and where they come from.
//
// A block's packed bytes are its frozen bytes, then its trainable bytes (the last ones, which
// may change on the device: trainable weights and their optimizer state). The store holds them
// in one host buffer per block: allocated from the backend (pinned where it can), or given by
// the caller (node-shared memory, core/node_memory.hpp). A block's trainable bytes have a second
// region, so that a write-back never overwrites the values it replaces before it is confirmed
// (Note [atomic write-back] in host_store.cpp).
//
// Each block has a tier (tier(): pinned or pageable host memory, or the model's file, which
// holds its bytes instead of a host buffer). The engine and its load pipeline ask the store for
// every host address: where a load reads (load_source), where a write-back goes
// (begin_write_back), which region is authoritative (trainable). The store keeps no lock: its
// owner (the engine) calls it under its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "blockswap/core/backend.hpp"
#include "blockswap/core/codec.hpp"

namespace blockswap {

// A part of a host buffer: where a block's trainable bytes are (HostStore::trainable).
struct HostRegion {
  std::shared_ptr<Buffer> buffer;
  std::size_t offset = 0;
  std::byte* data() const { return buffer->data() + offset; }
};

class HostStore {
public:
  // `block_bytes[i]`: block i's packed bytes. `trainable_bytes[i]`: how many of them, at the
  // end, may change on the device (empty: all of every block's, or none with `memory`).
  // `memory[i]`: host memory the caller holds for block i, at least its bytes, filled by the
  // caller and never written by the store, so its blocks have no trainable bytes (empty: the
  // store allocates every block's from `backend`). `in_file[i]`: block i's bytes stay in the
  // model's file (the file tier, which reads them for each load): the store holds no host
  // memory for it, and it may have no trainable bytes (empty: no block). `order`: the blocks
  // in the order their host memory is allocated (core/planner.hpp, host_priority: where pinned
  // memory runs out, the first get it); the blocks it leaves out follow in block order.
  // `memory_compressed[i]`: how many bytes at the start of memory[i] are block i's frozen bytes
  // as codec::encode compressed them (0: all of its bytes, raw; empty: every block's are raw).
  // Throws Error naming the block and `label` for sizes that do not agree, or compressed bytes
  // that are not a compressed block of its size.
  HostStore(std::shared_ptr<Backend> backend, const std::vector<std::size_t>& block_bytes,
            const std::vector<std::size_t>& trainable_bytes,
            std::vector<std::shared_ptr<Buffer>> memory, const std::string& label,
            const std::vector<bool>& in_file = {}, const std::vector<int64_t>& order = {},
            const std::vector<std::size_t>& memory_compressed = {});

  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }
  std::size_t bytes(int64_t block) const { return blocks_[block].bytes; }
  std::size_t trainable_bytes(int64_t block) const { return blocks_[block].trainable; }
  std::size_t frozen_bytes(int64_t block) const { return bytes(block) - trainable_bytes(block); }
  // Whether the caller gave the memory (the store never writes it).
  bool caller_memory() const { return caller_memory_; }
  // Where block i's bytes are (DESIGN.md section 11), which decides how a load reaches them
  // (core/load_pipeline.hpp): host memory the backend pinned, host memory it could not pin
  // (caller memory is either), or the model's file (buffer(i) is null).
  enum class Tier { pinned, pageable, file };
  Tier tier(int64_t block) const {
    const Block& b = blocks_[block];
    return b.in_file ? Tier::file : b.host->pageable() ? Tier::pageable : Tier::pinned;
  }

  // Frees block i's host buffer, runs `meanwhile`, then allocates it again from the backend:
  // before the block is filled, to give its page-locked memory to something that needs it more
  // (Note [pageable host memory] in load_pipeline.cpp). Not for caller memory or the file.
  void reallocate(int64_t block, const std::function<void()>& meanwhile);

  // Note [compressed host copies] in host_store.cpp. Stores block i's frozen bytes losslessly
  // compressed (core/codec.hpp; `ranges`: where its frozen bytes hold floating-point values)
  // when that makes them smaller: a new host buffer holds the compressed bytes, then its
  // trainable bytes (at trainable_at), and the raw one is freed. Returns whether it did; a block
  // that does not shrink, or whose new buffer the system would not pin, stays as it is, unless
  // `staged` (its loads go through the staging ring: its new buffer may be pageable). Only for
  // a block of the store's own memory, pinned unless `staged`, once, after it was filled and
  // before its first write-back.
  bool compress(int64_t block, std::span<const codec::Range> ranges, bool staged = false);
  // The same where the backend holds no bytes (Backend::holds_data: the timed device): block i's
  // frozen bytes take `compressed_bytes` (a model of what codec::encode gives), and parsed()
  // states only their decoded size. Returns whether it did (they are fewer than the raw ones).
  bool model_compressed(int64_t block, std::size_t compressed_bytes);
  // Note [changed compressed weights] in host_store.cpp: a compressed block's frozen bytes
  // replaced by `raw` (all of them), compressed again when they shrink to at most `most` bytes,
  // else stored raw (no longer compressed()); a new buffer, with the trainable bytes of the
  // packed region carried over. Returns whether they are compressed. The caller has waited for
  // every copy that reads or writes the old buffer (a pending write-back's included).
  bool replace_frozen(int64_t block, std::span<const std::byte> raw,
                      std::span<const codec::Range> ranges, std::size_t most);
  bool compressed(int64_t block) const { return blocks_[block].parsed != nullptr; }
  // The structure of block i's compressed frozen bytes (only when compressed()).
  const codec::Parsed& parsed(int64_t block) const { return *blocks_[block].parsed; }
  // Bytes of block i's frozen bytes as stored: compressed, or raw.
  std::size_t stored_frozen_bytes(int64_t block) const {
    const Block& b = blocks_[block];
    return b.parsed ? b.compressed : b.bytes - b.trainable;
  }
  // Host bytes block i's buffers hold now (its packed buffer and its spare; 0 in the file).
  std::size_t host_bytes(int64_t block) const;

  // Block i's host buffer: its packed bytes as first filled (compressed: the compressed frozen
  // bytes, then the trainable bytes at trainable_at). Its frozen bytes stay the
  // authoritative ones; its trainable bytes are authoritative until the first write-back.
  const std::shared_ptr<Buffer>& buffer(int64_t block) const { return blocks_[block].host; }
  // Where block i's authoritative trainable bytes are now.
  HostRegion trainable(int64_t block) const;

  // What a load of block i copies to the device: its frozen bytes from the buffer, and its
  // trainable bytes from where they are freshest (a pending write-back's target: the copy
  // stream runs in order, so that write-back is done before the load). One range when the
  // block's bytes are contiguous.
  // A compressed block's frozen bytes are `compressed_bytes` compressed ones, to decode.
  struct Source {
    const std::byte* frozen = nullptr;
    const std::byte* trainable = nullptr;
    bool contiguous() const {
      return compressed_bytes == 0 && (trainable_bytes == 0 || frozen + frozen_bytes == trainable);
    }
    std::size_t frozen_bytes = 0, trainable_bytes = 0;
    std::size_t compressed_bytes = 0; // > 0: compressed (core/codec.hpp)
  };
  Source load_source(int64_t block) const { // inline: every load asks (engine_bench)
    const Block& b = blocks_[block];
    const Region freshest = b.pending ? other(b.current) : b.current;
    const std::byte* trainable = freshest == Region::packed
                                     ? b.host->data() + b.trainable_at
                                     : b.spare->data(); // no HostRegion: no reference count
    return Source{b.host->data(), trainable, b.bytes - b.trainable, b.trainable, b.compressed};
  }

  // Note [atomic write-back]. begin_write_back: the region block i's changed trainable bytes go
  // to (the one that is not authoritative), and the event the caller records after that copy;
  // the write-back is pending. A second one before commit overwrites the first.
  // commit: the pending region becomes authoritative (after the caller has waited for the
  // event, or synchronized the copy stream); returns it. drop: the pending write-back is
  // forgotten; the authoritative region keeps the values from before.
  struct WriteBack {
    HostRegion target;
    Event& written;
  };
  WriteBack begin_write_back(int64_t block);
  bool pending(int64_t block) const { return blocks_[block].pending; }
  Event& written(int64_t block) const { return *blocks_[block].written; }
  HostRegion commit(int64_t block);
  void drop(int64_t block) { blocks_[block].pending = false; }

private:
  // The two homes of a block's trainable bytes: the end of its packed buffer, or a buffer of
  // their own, allocated at the first write-back.
  enum class Region { packed, spare };
  struct Block {
    std::shared_ptr<Buffer> host; // null for a block in the file
    bool in_file = false;
    std::size_t bytes = 0;
    std::size_t trainable = 0;
    std::size_t trainable_at = 0; // in `host`: bytes - trainable, unless compressed
    std::size_t compressed = 0;   // compressed frozen bytes at the start of `host` (0: raw)
    std::shared_ptr<const codec::Parsed> parsed; // their structure, when compressed
    std::shared_ptr<Buffer> spare;
    Region current = Region::packed; // the authoritative one
    bool pending = false;            // a write-back into the other one awaits its commit
    std::unique_ptr<Event> written;  // recorded on the copy stream after that write-back
  };
  void caller_compressed(std::size_t block, std::size_t compressed, const std::string& label);
  static Region other(Region r) { return r == Region::packed ? Region::spare : Region::packed; }
  HostRegion region(const Block& block, Region which) const {
    return which == Region::packed ? HostRegion{block.host, block.trainable_at}
                                   : HostRegion{block.spare, 0};
  }

  std::shared_ptr<Backend> backend_;
  std::vector<Block> blocks_;
  bool caller_memory_ = false;
};

} // namespace blockswap
