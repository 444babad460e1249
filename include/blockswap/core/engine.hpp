// The engine: executes a schedule on a backend, with the seed's verbs.
//
// It owns a fixed set of device slots, each big enough for the largest block (core/layout.hpp),
// allocated once, and decides which block is in which; every host address comes from its
// HostStore (core/host_store.hpp: each block's authoritative bytes and their tier, and the
// double-buffered write-back of those that change on the device), and every load goes through
// its LoadPipeline (core/load_pipeline.hpp: the source the store names, the staging ring). It knows
// nothing of tensors: a front end packs each block's weights into host_data(i) and, through a
// ResidencyListener, points its tensors at the block's slot while it is ready.
//
//   blockswap::Engine engine(backend, {bytes0, bytes1, ...}, {.blocks_to_swap = 2});
//   // ... fill engine.host_data(i) for every block ...
//   engine.prepare();
//   for (int64_t i = 0; i < n; ++i) {
//     const blockswap::Entered entered = engine.enter(i);  // compute waits for block i's load
//     compute(entered.slot->data());
//     engine.leave(i);                                     // enqueue this block's moves
//   }
//
// A block is *resident* when it owns a slot (its load may still be in flight) and *ready* once
// wait_for_block has ordered compute after its load. Using a block that is not resident is an
// error, never a silent read of the wrong weights. All methods may be called from any thread,
// one at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "blockswap/core/backend.hpp"
#include "blockswap/core/codec.hpp"
#include "blockswap/core/host_store.hpp"
#include "blockswap/core/load_pipeline.hpp"
#include "blockswap/core/schedule.hpp"
#include "blockswap/core/trace.hpp"

namespace blockswap {

// Whether blocks' frozen bytes are stored compressed (EngineOptions::compress).
enum class Compress { off, on, automatic };
// "off", "on", "auto"; and back (Error naming the accepted values).
const char* compress_name(Compress compress);
Compress parse_compress(const std::string& name);

struct EngineOptions {
  int64_t blocks_to_swap = 0;     // K
  bool supports_backward = false; // training possible; starts in training mode when true
  int64_t rotating_slots = 0;     // forward-only R (ScheduleOptions::rotating_slots)
  // Training R (ScheduleOptions::rotating_slots; 0: the seed's layout): a pipeline stage that
  // runs forwards (or backwards) in a row reloads R blocks at each such turn instead of K.
  int64_t training_rotating_slots = 0;
  Algorithm algorithm = Algorithm::blockswap;
  bool debug = false; // print each move and wait with its duration, as the seed does
  std::function<void(const std::string&)> log = {}; // debug lines go here; stderr when empty
  std::shared_ptr<Trace> trace = {}; // when set: every copy, and every wait that stalls
  // Per block, how many bytes at the end of its packed weights may change on the device
  // (trainable weights and their optimizer state): only those are copied back when the block
  // is marked dirty; the bytes before them are frozen and never copied back. Empty: all of
  // every block's bytes.
  std::vector<std::size_t> trainable_bytes = {};
  // Per block, host memory the caller holds for its packed weights instead of the backend's
  // (the node-shared copy of data-parallel ranks, core/node_memory.hpp): at least the block's
  // bytes, filled by the caller, who page-locks it if it should be (Backend::pin_host). The
  // engine never writes it, so its blocks may not change on the device (no trainable bytes).
  // Empty: the engine allocates every block's.
  std::vector<std::shared_ptr<Buffer>> host_memory = {};
  // With host_memory and compress on: per block, how many bytes at the start of its host memory
  // are its frozen bytes compressed already (codec::encode's block, which its filler made;
  // core/codec.hpp), to decode at each load; 0: they are raw there. Empty: every block's are
  // raw. The node-shared copy is compressed once, by the process that fills it (Note
  // [compressed node-shared copy] in torch/node_sharing.cpp).
  std::vector<std::size_t> host_memory_compressed = {};
  // When set, the blocks over the host budget stay in the model's file (FileTier,
  // core/load_pipeline.hpp); they may have no trainable bytes. Unset: every block is in host
  // memory.
  std::optional<FileTier> file = {};
  // false: the constructor allocates no slot; allocate_slots() (or the first prepare()) does.
  // The LibTorch front end packs a model that is on the GPU into host memory first, so that
  // its device copy and the slots are never on the device together.
  bool slots_at_construction = true;
  // Note [compressed host copies] in host_store.cpp. on: the frozen bytes of every block in
  // host memory of the engine's own (pinned, or pageable and staged; not the file tier's), and
  // those of host_memory_compressed, are stored losslessly compressed (core/codec.hpp)
  // from compress() (or the first prepare()) on, once the caller has filled them, and decoded on
  // the device at each load; a block that does not shrink stays raw. The backend must decode
  // (Backend::can_decode). automatic: off here; whoever builds the engine chooses on or off
  // (core/compression_choice.hpp; the LibTorch front end does for compress = auto).
  Compress compress = Compress::off;
  // With compress on: per block, where its frozen bytes hold floating-point values (offsets in
  // its packed bytes, inside its frozen bytes); bytes outside every range are stored raw.
  std::vector<std::vector<codec::Range>> frozen_ranges = {};
  // With compress on, where the backend holds no bytes (the timed device, which models time):
  // per block, its frozen bytes compressed, as codec::encode would give them (frozen_ranges are
  // not needed there). A block whose size is not below its frozen bytes stays raw.
  std::vector<std::size_t> modelled_compressed_bytes = {};
};

// What compression saved (Engine::compression): the frozen bytes of the blocks it stores
// compressed, raw and as stored.
struct CompressionStats {
  int64_t blocks = 0;                  // blocks stored compressed
  uint64_t raw_bytes = 0;              // their frozen bytes
  uint64_t compressed_bytes = 0;       // the same, compressed
  std::size_t decode_buffer_bytes = 0; // device memory the decode step holds
  // Blocks encoded again since construction: frozen weights the caller changed (Note [changed
  // compressed weights] in host_store.cpp), each time; the same values again are not.
  int64_t encoded_again = 0;
  bool on = false; // compression on: EngineOptions::compress, or what auto chose
  // Why it is on or off: as asked, or compress = auto's reason (core/compression_choice.hpp).
  std::string reason = {};
  // raw / compressed over the compressed blocks (1 with none).
  double ratio() const {
    return compressed_bytes == 0 ? 1.0 : double(raw_bytes) / double(compressed_bytes);
  }
};

struct Stats {
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  uint64_t moves = 0;      // blocks loaded into a slot by a move (prepare not counted)
  uint64_t disk_bytes = 0; // bytes of the loads read from the file tier
  // Bytes of the loads staged from pageable host memory (Note [pageable host memory] in
  // load_pipeline.cpp), as h2d_bytes counts them: as they are in the slot. A compressed block's
  // frozen bytes crossed the staging ring and the link compressed: they count in decoded_bytes
  // and compressed_bytes as well.
  uint64_t staged_bytes = 0;
  // Of h2d_bytes: frozen bytes that crossed the link compressed and were decoded on the device,
  // and what crossed the link for them (EngineOptions::compress).
  uint64_t decoded_bytes = 0;
  uint64_t compressed_bytes = 0;
  // Time computation waited for loads: measured on the device where the backend times its
  // events (CUDA, the timed device), else the time the host spent blocked.
  double stall_seconds = 0;
  // Device memory the engine holds now: its slots, and the decode buffer (EngineOptions::compress,
  // CompressionStats::decode_buffer_bytes).
  uint64_t device_bytes = 0;
  uint64_t peak_device_bytes = 0;
};

// Told when a block becomes ready on the device and when it leaves it. Called with the
// engine's lock held: it must not call back into the engine, but for replace_frozen. `slot` is the
// device memory the block's weights occupy; sharing it keeps that memory alive after the engine has
// let it go (Note [slot lifetime] in engine.cpp). on_evicted runs before the slot can be
// overwritten: it may read the slot (e.g. to save weights changed there); if it throws, the block
// stays.
class ResidencyListener {
public:
  virtual ~ResidencyListener() = default;
  virtual void on_ready(int64_t block, const std::shared_ptr<Buffer>& slot) = 0;
  virtual void on_evicted(int64_t block) = 0;
  // Block `block`'s changes written back reached host memory (Note [atomic write-back] in
  // host_store.cpp): its trainable bytes are now at `trainable`, and the region they were in before
  // will be overwritten by the next write-back.
  virtual void on_written_back(int64_t /*block*/, const HostRegion& /*trainable*/) {}
  // Block `block` is about to be loaded from its host copy (or its trainable bytes, by
  // reload_trainable): return once that copy holds what should go to the device.
  virtual void before_load(int64_t /*block*/) {}
  // A read from the file tier failed (EngineOptions::file): the file may have changed under the
  // run. Called before the load's error is thrown; must not throw.
  virtual void on_file_failed() noexcept {}
};

// What the caller knows of a block's computation.
struct Compute {
  bool differentiable = false; // its backward may run later (grad mode is on)
  // Reentrant activation checkpointing: a differentiable block computed again in a pass is the
  // recompute that precedes its backward. (Without it, a block computed again after a backward
  // has started is the recompute of non-reentrant checkpointing.)
  bool reentrant_checkpointing = false;
};

struct Entered {
  std::shared_ptr<Buffer> slot; // the memory block i computes in (Note [slot lifetime])
  bool recompute = false;       // the recompute pass: leave() moves nothing
};

class Engine {
public:
  // `block_bytes[i]` is the size of block i's packed weights; `label` (the seed's block_type)
  // names the engine in messages. Throws Error for an empty block list or an out-of-range K,
  // OutOfMemory when the slots do not fit on the device.
  Engine(std::shared_ptr<Backend> backend, std::vector<std::size_t> block_bytes,
         EngineOptions options, std::string label = "block");
  // Waits for copies in flight and frees the slots; never throws.
  ~Engine();

  // not copyable, not movable: listeners and in-flight copies refer to it
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int64_t blocks() const;
  const std::string& label() const;
  // The host copy of block i's weights: fill it before prepare(); null for a block in the file
  // (in_file). host_buffer shares it, so that the weights can outlive the engine (e.g. as
  // tensors over it). Once changes of the block
  // were written back, its trainable bytes (EngineOptions::trainable_bytes) are elsewhere:
  // host_trainable(i) says where, now.
  std::byte* host_data(int64_t block) const;
  std::shared_ptr<Buffer> host_buffer(int64_t block) const;
  HostRegion host_trainable(int64_t block) const;
  std::size_t block_bytes(int64_t block) const;
  std::size_t slot_bytes() const; // core/layout.hpp
  // Whether block i is read from the model's file for each load (EngineOptions::file).
  bool in_file(int64_t block) const;

  // Stores the host copies' frozen bytes compressed (EngineOptions::compress on), once: call it
  // after filling host_data, before anything reads them; prepare() calls it if nobody has.
  // Afterwards a compressed block's host_data holds its compressed frozen bytes (no raw copy of
  // them exists on the host) and its trainable bytes are at host_trainable(i). Throws Error when
  // the backend cannot decode; does nothing with compression off.
  void compress();
  // Whether block i's frozen bytes are stored compressed (compress()), and the bytes they take
  // at the start of its host copy (compressed or not).
  bool compressed(int64_t block) const;
  std::size_t host_frozen_bytes(int64_t block) const;
  // Note [changed compressed weights] in host_store.cpp: a compressed block's frozen bytes become
  // `raw` (all of them, decoded, with the caller's changes), stored compressed again, or raw
  // where they no longer shrink or no longer fit the decode buffer; returns whether they are
  // compressed. Waits for the copies that read or write the block's host copy. Its
  // host_buffer and host_trainable change; a ResidencyListener may call it.
  bool replace_frozen(int64_t block, std::span<const std::byte> raw);
  CompressionStats compression() const;
  // Host bytes the engine's copies of the blocks hold now (their buffers and spares).
  std::size_t host_bytes() const;

  // Places blocks as the current schedule starts (all of them when swapping is disabled).
  // When it moves blocks it waits until they are loaded, like the seed's; in the steady state
  // it moves none and returns at once, leaving loads started by the last pass to enter().
  void prepare();
  // Allocates the slots the current schedule starts with, where the constructor did not
  // (EngineOptions::slots_at_construction); does nothing once they are. Throws OutOfMemory
  // when they do not fit.
  void allocate_slots();

  // The per-block protocol, one call before and one after each block's computation.
  //
  // enter: orders compute after block i's load on the compute stream as it is now (also when
  // the block is ready already: the caller may have switched streams) and returns its slot.
  // Throws if block i is not resident, or if a differentiable block is computed a second time
  // in a training pass without reentrant checkpointing. In the recompute pass of reentrant
  // checkpointing (differentiable, computed before in this pass) it loads block i when it is
  // not resident, into an empty slot or the slot of a block whose backward is done.
  Entered enter(int64_t block, Compute compute = {});
  // leave: after block i's computation is enqueued, records the slot it ran in and performs
  // the current schedule's moves (none while disabled or in the recompute pass). Throws if the
  // block was computed before its load was waited for.
  void leave(int64_t block, Compute compute = {});
  // Whether enter(block, compute) now is the recompute pass (for a caller that must decide
  // something before leave()).
  bool recomputing(int64_t block, Compute compute) const;
  // The seed's verbs: enter and leave for a computation nothing differentiates.
  void wait_for_block(int64_t block) { enter(block); }
  void after_forward(int64_t block) { leave(block); }

  // Block i's backward is about to run and autograd's saved tensors point into `slot`, the
  // memory block i was computed in: makes `slot` hold block i again (evicting the slot's
  // occupant, loading block i) and orders compute after that load. The backwards that started
  // before it, of later blocks, are complete by then: their moves (the current schedule's
  // after_backward) run first, as prefetches. Throws Error when `slot` is no longer one of the
  // engine's slots. Note [exact backward] in engine_training.cpp.
  void acquire_for_backward(int64_t block, const Buffer* slot);
  // The current schedule's moves after block i's backward; a no-op while disabled. For
  // callers that see each backward end (tests, benchmarks); its moves fail when the blocks are
  // not where the schedule has them.
  void after_backward(int64_t block);

  void disable();
  void enable();
  bool enabled() const;
  void set_forward_only(bool forward_only);
  bool forward_only() const;
  void set_listener(ResidencyListener* listener);

  bool is_resident(int64_t block) const;
  bool is_ready(int64_t block) const;
  // Block i's weights on the device. Throws unless block i is ready.
  std::byte* device_data(int64_t block) const;
  // The slot that holds block i, shared (Note [slot lifetime]). Throws unless block i is ready.
  std::shared_ptr<Buffer> device_buffer(int64_t block) const;
  // Block i's weights were changed on the device: copy its trainable bytes
  // (EngineOptions::trainable_bytes) back when it is evicted. Throws when it has none. The host
  // copy (host_trainable) takes the new values at the next synchronize() (or prepare() that
  // waits, or destruction), all at once; a copy that fails before then leaves it with the old
  // values and the error names the block (Note [atomic write-back] in host_store.cpp).
  void mark_dirty(int64_t block);
  // Blocks the host until every copy enqueued so far has completed.
  void synchronize();
  // Whether a block off the device has a write-back that waits for synchronize() to reach its
  // host copy (its tensors read that host copy).
  bool writing_back() const;
  // At the end of a backward: starts the write-back of every changed block on the device that
  // the training forward evicts (Note [write-back before the forward] in engine_training.cpp).
  void write_back_early();

  // The optimizer step on the host (Note [host step] in engine_training.cpp). copy_out copies
  // `bytes` of device memory written by the computations enqueued so far (a gradient) into `host`,
  // on the copy stream, and returns an event recorded after it; the caller keeps both memories
  // alive until wait(event) returns. wait blocks the calling thread until the event, and may be
  // called from another thread while the engine is in use. reload_trainable(i) loads block i's
  // trainable bytes again from its host copy into its slot, after every computation that reads
  // the slot, when block i is on the device (nothing otherwise); the next enter(i) waits for it.
  std::shared_ptr<Event> copy_out(std::byte* host, const std::byte* device, std::size_t bytes,
                                  int64_t tag);
  void wait(const Event& event);
  void reload_trainable(int64_t block);

  const Schedule& schedule() const;
  Stats stats() const;
  void reset_stats();

  class Impl;

private:
  std::unique_ptr<Impl> impl_;
};

} // namespace blockswap
