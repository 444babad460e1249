// LoadPipeline: the one path by which a block's bytes reach its slot (DESIGN.md section 3).
//
// A block's source is the tier its HostStore names (HostStore::tier): pinned host memory is
// copied to the slot on the copy stream as it is; pageable host memory and the model's file go
// through the staging ring (core/staging_ring.hpp), which a reader fills ahead of the loads in
// the order they will come (the schedule's pass), and the copy out of a staging buffer waits on
// the copy stream for its read. A step that changes the bytes on their way (a decoder of
// compressed weights) goes between the copy and the slot, from pinned host memory and from a
// staging buffer alike (Note [a decode step] in load_pipeline.cpp).
//
// The engine keeps residency and calls the pipeline at four points: start_pass() with the loads
// a pass starts with, copy_into() a slot, finish() a load before its block computes, and
// hold_around() an eviction whose listener may write host bytes. Like HostStore it keeps no
// lock: its owner (the engine) calls it under its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "blockswap/core/backend.hpp"
#include "blockswap/core/codec.hpp"
#include "blockswap/core/file_source.hpp"
#include "blockswap/core/host_store.hpp"
#include "blockswap/core/schedule.hpp"

namespace blockswap {

// The file tier (DESIGN.md, "Tiers"; Note [the file tier] in load_pipeline.cpp): blocks whose
// bytes are read from the model's file for each load, through a ring of pinned staging buffers,
// instead of being held in host memory.
struct FileTier {
  std::vector<std::string>
      files; // the model's files (a sharded checkpoint's shards), FileRange::file's
  // Every block's packed bytes in the file (its ranges cover what it needs; padding between
  // tensors is left as the staging buffer had it).
  std::vector<FileBlock> blocks;
  // Host memory for the blocks a pass moves (training's first when supports_backward, then
  // inference's), in the order core/planner.hpp's host_priority gives, then for the others
  // (file_tier); the rest are read from the file, a block that never moves once, when placed.
  std::size_t host_budget_bytes = 0;
  int64_t staging_buffers = 2; // the ring the reader fills ahead of the loads, each a slot's size
  CacheBypass bypass = CacheBypass::direct;
  // The order in which host memory goes to blocks (every block once), in place of the engine's
  // own (core/planner.hpp: host_priority, which knows no costs; file_priority, which does).
  // Empty: the engine's.
  std::vector<int64_t> priority = {};
};

class LoadPipeline {
public:
  // Over `store`'s blocks (which must outlive it), each copied into a slot of `slot_bytes`.
  // `priority`: the blocks in the order scarce pinned memory goes to them (core/planner.hpp,
  // host_priority): where the system will not pin a staging buffer, the last of them give
  // theirs (HostStore::reallocate), so the store's buffers are filled only once the pipeline
  // exists: bytes written before may be gone (the engine's caller fills them after). `file_failed`:
  // called when a read from the file fails, before its error is thrown; must not throw. Throws
  // InvalidArgument for a file tier that does not match the store's blocks.
  LoadPipeline(std::shared_ptr<Backend> backend, HostStore& store,
               const std::optional<FileTier>& file, const std::vector<int64_t>& priority,
               std::size_t slot_bytes, std::string label, std::function<void()> file_failed);
  ~LoadPipeline();
  LoadPipeline(const LoadPipeline&) = delete;
  LoadPipeline& operator=(const LoadPipeline&) = delete;

  // Whether block i's loads go through the staging ring (its tier is not pinned memory).
  bool staged(int64_t block) const { return reader_ && staged_[block]; }

  // The order loads come in: every pass of `schedule` (its moves), cycling. Called when the
  // schedule changes (a mode switch).
  void plan(const Schedule& schedule);
  // A pass starts: `placements` are the blocks prepare() loads first, in its order (empty in
  // the steady state: the pass's own loads are read ahead).
  void start_pass(const std::vector<int64_t>& placements);

  // Enqueues the copy of block i's bytes from its source into `slot` on the copy stream (and
  // its decode on the decode stream, Note [a decode step]), records `loaded` where the load
  // ends (the copy stream, or the decode stream after a decode) and returns at once, except
  // that a block from pageable memory waits for its staging copy (compressed or not). Its trainable
  // bytes are read where the store says they are freshest; a pending write-back of a staged block
  // must have been waited for (the host reads them). Throws the read's error for a block from
  // pageable memory; on a throw nothing was enqueued.
  void copy_into(int64_t block, std::byte* slot, Event& loaded) { // inline: every load
    if (staged(block)) {
      copy_staged(block, slot, loaded);
    } else if (const HostStore::Source source = store_.load_source(block);
               source.compressed_bytes > 0) {
      copy_compressed(block, slot, source, loaded);
    } else {
      copy_raw(block, slot, source);
      backend_->record(loaded, Stream::copy);
    }
  }
  // Whether block i's loads end on the decode stream (its host copy is compressed).
  bool decoded(int64_t block) const { return store_.compressed(block); }
  // Note [compressed host copies] (host_store.cpp): stores the frozen bytes of every block that
  // may be (host memory of the store's own, pinned or staged; not the file) compressed with
  // `ranges[i]` (where its frozen bytes hold floating-point values), once the caller has filled
  // them, points the staging ring's reader at the staged ones' compressed bytes, and allocates
  // the device buffers their loads decode from (Note [a decode step]). Once; throws Error when the
  // backend cannot decode, or `ranges` has not one entry per block. Where the backend holds no
  // bytes (the timed device), `modelled[i]` are block i's compressed frozen bytes instead
  // (HostStore::model_compressed; Error when empty).
  void compress(const std::vector<std::vector<codec::Range>>& ranges,
                const std::vector<std::size_t>& modelled = {});
  // Device memory the decode step holds (0 without compressed blocks): kDecodeBuffers buffers
  // of the largest compressed block's bytes.
  std::size_t decode_buffer_bytes() const {
    return decode_buffers_[0].memory.size() * kDecodeBuffers;
  }
  static constexpr std::size_t kDecodeBuffers = 2;
  // The most compressed bytes a load may decode: one buffer's.
  std::size_t decode_capacity() const { return decode_buffers_[0].memory.size(); }
  // Note [changed compressed weights] (host_store.cpp): HostStore::replace_frozen of compressed
  // block i, at most decode_capacity() bytes compressed, with no copy ahead reading its host
  // copy meanwhile; a staged block's reader reads the new one. Returns whether it is compressed.
  // The caller has waited for its load and its pending write-back.
  bool replace_frozen(int64_t block, std::span<const std::byte> raw,
                      std::span<const codec::Range> ranges);

  // Block i is about to be computed: blocks the host until its read from the file (if any)
  // is done, and throws that read's error (after file_failed).
  void finish(int64_t block) {
    if (reads_[block].read) finish_read(block);
  }
  // Block i left the device before it was computed: its read is no longer waited for.
  void forget(int64_t block);
  // Runs `eviction` (which may write block `evicted`'s host bytes, or replace its host copy:
  // replace_frozen) with no copy ahead reading those bytes meanwhile (Note [pageable host
  // memory]); within another hold_around, just runs it (the outer one holds the reads ahead).
  void hold_around(int64_t evicted, const std::function<void()>& eviction);

  // Bytes copied into slots from the file, and from pageable memory through the ring (as they
  // are in the slot: a compressed block's crossed the ring and the link compressed, and counts in
  // the next two as well). Frozen bytes of the loads that crossed the link compressed: as
  // decoded, and as copied.
  struct Counters {
    uint64_t disk_bytes = 0, staged_bytes = 0;
    uint64_t decoded_bytes = 0, compressed_bytes = 0;
  };
  const Counters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

private:
  void start_staging(const std::optional<FileTier>& file, const std::vector<int64_t>& priority);
  void read_ahead();
  // Runs `change` with the reads ahead cancelled when `hold` (and not held already), then asks
  // for them again; hold_around_all holds them all.
  void held(bool hold, const std::function<void()>& change);
  void hold_around_all(const std::function<void()>& change);
  // `wait`: the host waits for the read; else the copy stream will (Note [the file tier]).
  StagingReader::Staged take(int64_t block, bool wait);
  // `source` as it is (uncompressed) into `slot`, on the copy stream.
  void copy_raw(int64_t block, std::byte* slot, const HostStore::Source& source) {
    if (source.contiguous()) {
      backend_->copy_to_device(slot, source.frozen, store_.bytes(block), block);
      return;
    }
    if (source.frozen_bytes > 0) {
      backend_->copy_to_device(slot, source.frozen, source.frozen_bytes, block);
    }
    backend_->copy_to_device(slot + source.frozen_bytes, source.trainable, source.trainable_bytes,
                             block);
  }
  void copy_staged(int64_t block, std::byte* slot, Event& loaded);
  // `source`: the compressed frozen bytes and the trainable bytes, in pinned memory (the host
  // copy, or the staging buffer a staged block was read into).
  void copy_compressed(int64_t block, std::byte* slot, const HostStore::Source& source,
                       Event& loaded);
  void finish_read(int64_t block);

  std::shared_ptr<Backend> backend_;
  HostStore& store_;
  const std::size_t slot_bytes_;
  const std::string label_;
  const std::function<void()> file_failed_;
  Counters counters_;
  std::vector<bool> staged_;                 // per block: loaded through the staging ring
  std::vector<StagingReader::Staged> reads_; // per block: its load's read, not yet waited for
  std::size_t depth_ = 0;                    // the staging buffers: read-ahead's depth
  bool stages_memory_ = false;               // some staged blocks come from pageable memory
  bool holding_ = false;                     // in hold_around, the reads ahead cancelled
  std::vector<int64_t> order_;               // the staged blocks a pass loads, in order
  std::size_t cursor_ = 0;                   // the next of them to request
  std::deque<int64_t> ahead_;                // requested from the reader, not yet taken
  std::unique_ptr<StagingReader> reader_;
  // Note [a decode step]: device memory for the compressed bytes of a load being decoded, and
  // its events: `copied` (on the copy stream, after the copy into it) and `free` (on the
  // decode stream, after the decode out of it).
  struct DecodeBuffer {
    Buffer memory;
    std::unique_ptr<Event> copied, free;
  };
  DecodeBuffer decode_buffers_[kDecodeBuffers];
  std::size_t next_decode_buffer_ = 0; // the one the next compressed load copies into
};

} // namespace blockswap
