// The load pipeline (core/load_pipeline.hpp): pinned blocks copied as they are; blocks whose
// bytes reach the device through a ring of pinned staging buffers, read from the model's file
// (the file tier, DESIGN.md "Tiers") or copied from host memory the system would not pin.
#include "blockswap/core/load_pipeline.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#include "blockswap/core/error.hpp"
#include "blockswap/core/log.hpp"

namespace blockswap {
namespace {

// Once per block list and what it says: an offloader built again over the same blocks says
// nothing new; another list of that name, or the same one under another cap, says its own.
void warn_once(const std::string& label, const std::string& text) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  {
    std::lock_guard lock(mutex);
    if (!warned.insert(label + '\n' + text).second) return;
  }
  warn(label, text);
}

// The ring for pageable blocks, without a file tier's own count.
constexpr int64_t kPageableStaging = 2;

} // namespace

// Note [the file tier]
// A block in the file has no host copy. A reader thread (core/staging_ring.hpp) reads its bytes
// into one of a ring of pinned staging buffers, and its load copies them from there to its slot
// on the copy stream; the buffer is read into again only after that copy (an event the reader
// waits for from its thread), so a copy in flight delays only the read that needs its buffer.
//
// Reads run ahead in the order the loads will come: the current schedule's pass (its moves, in
// order, cycling into the next pass), or prepare's placements. A load that is not the one read
// ahead (a call pattern the schedule did not foresee: a recompute, a skipped block, a mode
// switch) cancels the reads ahead and reads its own block first, then the prediction goes on from
// that block's place in the pass: slower once, never different bytes. Every load of a block in
// the file reads the file again; what the block had on the device is never kept, as it is frozen.
//
// Note [pageable host memory]
// Where the system will not page-lock the host copy (a low `ulimit -l`, WSL, Windows, a refused
// cudaHostRegister), Backend::allocate_host returns pageable memory. A copy from pageable memory
// cannot overlap: cudaMemcpyAsync makes the host wait for the copy stream, which itself waits for
// the computation that frees the slot, so every load would serialise the step. Such a block is
// staged instead, as a block in the file is: the reader thread copies its frozen bytes into a
// pinned staging buffer ahead of its load (in parts, on several threads), and the load copies
// the staging buffer on the copy stream, overlapped as a pinned block's is. Its trainable bytes,
// which change between loads, are copied into the staging buffer by the load itself, after its
// last write-back is done (a write-back into pageable memory is synchronous: the host waits for
// it, so the slower path is full fine-tuning's write-backs, not the loads). Frozen host bytes
// change when the caller writes them between passes, and when a block leaves the device (the
// listener saves what was written into its slot): copies ahead never cross those points
// (start_pass, hold_around below).
// With compression on (Note [compressed host copies] in host_store.cpp) such a block's frozen
// bytes are stored compressed too, in a new host buffer that may itself be pageable: compress()
// points the reader at them (StagingReader::repoint), the reader copies the compressed bytes
// into the staging buffer, the load adds the trainable bytes behind the raw frozen bytes' place
// and copies both out of it as a pinned compressed block's are (Note [a decode step]). Frozen
// bytes encoded again (replace_frozen) move the block's host copy: the reads ahead are held
// around it and the reader is pointed at the new one. So the ring holds, and the link carries,
// the compressed bytes; staged_bytes still counts the loads' bytes as they are in the slot.
LoadPipeline::LoadPipeline(std::shared_ptr<Backend> backend, HostStore& store,
                           const std::optional<FileTier>& file,
                           const std::vector<int64_t>& priority, std::size_t slot_bytes,
                           std::string label, std::function<void()> file_failed)
    : backend_(std::move(backend)), store_(store), slot_bytes_(slot_bytes),
      label_(std::move(label)), file_failed_(std::move(file_failed)),
      staged_(static_cast<std::size_t>(store.blocks()), false),
      reads_(static_cast<std::size_t>(store.blocks())) {
  start_staging(file, priority);
}

LoadPipeline::~LoadPipeline() = default;

void LoadPipeline::start_staging(const std::optional<FileTier>& file,
                                 const std::vector<int64_t>& priority) {
  const int64_t n = store_.blocks();
  if (file) {
    BLOCKSWAP_CHECK_ARGUMENT(file->blocks.size() == staged_.size(), "[", label_,
                             "] the file tier has ", file->blocks.size(), " blocks for ", n,
                             ": give every block's place in the file");
    BLOCKSWAP_CHECK_ARGUMENT(file->staging_buffers >= 1, "[", label_,
                             "] the file tier needs at least one staging buffer, not ",
                             file->staging_buffers);
    for (int64_t b = 0; b < n; ++b) {
      BLOCKSWAP_CHECK_ARGUMENT(
          store_.tier(b) != HostStore::Tier::file || file->blocks[b].bytes == store_.bytes(b), "[",
          label_, "] block ", b, " has ", store_.bytes(b),
          " packed bytes, but its place in the file fills ", file->blocks[b].bytes);
    }
  }
  auto count_staged = [&] {
    int64_t in_file = 0, pageable = 0;
    for (int64_t b = 0; b < n; ++b) {
      const HostStore::Tier tier = store_.tier(b);
      staged_[b] = tier != HostStore::Tier::pinned;
      in_file += tier == HostStore::Tier::file ? 1 : 0;
      pageable += tier == HostStore::Tier::pageable ? 1 : 0;
    }
    return std::pair{in_file, pageable};
  };
  const auto [in_file, pageable] = count_staged();
  if (in_file + pageable == 0) return; // every block is in pinned host memory
  const int64_t ring = file ? file->staging_buffers : kPageableStaging;
  // More buffers than staged blocks would never be read into. Pinning is capped (Note [pageable
  // host memory]): a staging buffer the system will not pin takes the pinned memory of the
  // blocks that have some and need it least (the last in host_priority: a block that never
  // moves is loaded once), which nothing has filled yet; those blocks are staged in turn.
  std::vector<std::shared_ptr<Buffer>> staging;
  auto give_up = store_.caller_memory() ? priority.rend() : priority.rbegin();
  for (int64_t i = 0; i < std::min(ring, in_file + pageable); ++i) {
    Buffer buffer = backend_->allocate_host(slot_bytes_);
    while (buffer.pageable()) {
      while (give_up != priority.rend() && staged_[*give_up]) ++give_up;
      if (give_up == priority.rend()) break;
      const int64_t block = *give_up;
      buffer.reset();
      store_.reallocate(block, [&] { buffer = backend_->allocate_host(slot_bytes_); });
      staged_[block] = true; // pinned or not, it is not used again for the ring
    }
    staging.push_back(std::make_shared<Buffer>(std::move(buffer)));
  }
  const int64_t pageable_blocks = count_staged().second;
  stages_memory_ = pageable_blocks > 0;
  bool staging_pageable = false;
  for (const auto& buffer : staging) staging_pageable = staging_pageable || buffer->pageable();
  std::vector<FileBlock> blocks(staged_.size()); // what the reader reads, per block
  for (int64_t b = 0; b < n; ++b) {
    if (store_.tier(b) == HostStore::Tier::file) {
      blocks[b] = file->blocks[b];
    } else if (staged_[b]) {
      blocks[b] = FileBlock{{}, store_.frozen_bytes(b), store_.buffer(b)->data()};
    } // else never read: loaded from pinned memory
  }
  // Loud, once per block list and process (an offloader built again says nothing new): the
  // user's system caps pinning, and it costs host work.
  if (pageable_blocks > 0) {
    warn_once(label_, detail::concat(
                          "WARNING: the host copies of ", pageable_blocks, " of ", n,
                          " blocks are pageable (the system would not pin them): their loads "
                          "go through ",
                          staging.size(),
                          staging.size() == 1 ? " pinned staging buffer of "
                                              : " pinned staging buffers of ",
                          slot_bytes_, " bytes, filled by a reader thread ahead of the copy stream",
                          staging_pageable ? "; the staging buffers could not be pinned "
                                             "either, so each load makes the host wait for "
                                             "the copy stream"
                                           : ""));
  } else if (staging_pageable) {
    warn_once(label_, "WARNING: the file tier's staging buffers could not be pinned (the system "
                      "caps pinning): each load from the file makes the host wait for the copy "
                      "stream");
  }
  depth_ = staging.size();
  reader_ = backend_->make_staging_reader(
      StagingSpec{file ? file->files : std::vector<std::string>(), std::move(blocks),
                  std::move(staging), label_, file ? file->bypass : CacheBypass::direct});
}

void LoadPipeline::plan(const Schedule& schedule) {
  if (!reader_) return;
  order_.clear();
  for (const Op& op : schedule.pass()) {
    if (op.kind == Op::Kind::move && staged_[op.move.in]) order_.push_back(op.move.in);
  }
  cursor_ = 0;
}

// Note [pageable host memory]: a block's host bytes change between passes (a weight written
// between steps) and at its eviction (the listener saves there what the caller wrote into its
// slot). Copies from host memory are not made ahead across a pass's end (read_ahead), and the
// ones still asked for (a pass stopped early) are dropped when the next pass starts; around an
// eviction the copies ahead that include the block wait (hold_around), and are made again after
// it. No copy reads host bytes while they change. The file's bytes never change under a run.
void LoadPipeline::start_pass(const std::vector<int64_t>& placements) {
  if (!reader_) return;
  if (stages_memory_) {
    reader_->cancel();
    ahead_.clear();
    cursor_ = 0;
  }
  if (placements.empty()) {
    read_ahead(); // the pass's first loads
    return;
  }
  reader_->cancel();
  ahead_.clear();
  for (int64_t b : placements) {
    if (!staged_[b]) continue;
    reader_->request(b);
    ahead_.push_back(b);
  }
  cursor_ = 0; // then the pass
}

void LoadPipeline::hold_around(int64_t evicted, const std::function<void()>& eviction) {
  held(stages_memory_ && std::find(ahead_.begin(), ahead_.end(), evicted) != ahead_.end(),
       eviction);
}

void LoadPipeline::hold_around_all(const std::function<void()>& change) {
  held(stages_memory_ && !ahead_.empty(), change);
}

void LoadPipeline::held(bool hold, const std::function<void()>& change) {
  hold = hold && reader_ && !holding_;
  if (hold) {
    reader_->cancel(); // waits for a copy in flight
    holding_ = true;
  }
  auto resume = [&] {
    if (!hold) return;
    holding_ = false;
    for (int64_t b : ahead_) reader_->request(b);
  };
  try {
    change();
  } catch (...) {
    resume();
    throw;
  }
  resume();
}

StagingReader::Staged LoadPipeline::take(int64_t block, bool wait) {
  if (ahead_.empty() || ahead_.front() != block) { // Note [the file tier]
    reader_->cancel();
    ahead_.clear();
    reader_->request(block);
    ahead_.push_back(block);
    const auto at = std::find(order_.begin(), order_.end(), block);
    if (at != order_.end()) cursor_ = static_cast<std::size_t>(at - order_.begin() + 1);
  }
  ahead_.pop_front();
  StagingReader::Staged staged = wait ? reader_->next() : reader_->take(); // next() rethrows
  read_ahead();
  return staged;
}

// Reads from the file cycle into the next pass; copies from host memory stop at the pass's
// end (Note [pageable host memory]): between passes the caller may write those bytes.
void LoadPipeline::read_ahead() {
  while (!order_.empty() && ahead_.size() < depth_) {
    if (cursor_ == order_.size()) {
      if (stages_memory_) return; // start_pass() starts the next pass's
      cursor_ = 0;
    }
    const int64_t b = order_[cursor_++];
    reader_->request(b);
    ahead_.push_back(b);
  }
}

// Note [a decode step]
// Bytes that are not the slot's as they are (losslessly compressed weights, Note [compressed
// host copies] in host_store.cpp) are decoded on the device between the source and the slot,
// on a stream of its own (Stream::decode), so that the decode of one load overlaps the copy of
// the next and a link-bound step gains the whole ratio (load_pipeline_decode.cpp):
//  - compress() allocates two device buffers of the largest compressed block, which the Device
//    accounts for (decode_buffer_bytes; the planners count both), used by the loads in turn;
//  - on the copy stream, a load waits until its buffer is free (an event the decode stream
//    recorded after the decode out of it before), copies the compressed frozen bytes into it,
//    copies the trainable bytes (never compressed) into the slot, and records `copied`;
//  - the decode stream waits for `copied`, decodes the buffer into the slot, records the
//    block's load event, then the buffer's `free`.
// So compute waits for the decode as it waited for the copy, and a damaged block fails as a
// failed copy does, at the block's wait (its load event is the first recorded after the decode
// on the decode stream). The slot: its next load's copies wait for the compute that read it
// (Note [slot reuse] in engine_residency.cpp), which waited for this decode; a block evicted
// before it computed makes the copy stream wait for its load event, and a block's trainable
// bytes loaded again wait for it (Engine::reload_trainable). Engine::synchronize waits for
// both streams. A backend without a decode stream runs it on the copy stream: in order, right,
// in series. The source and the read order stay as they are. The pinned host copies and the
// pageable ones (through the staging ring, whose buffer is then the copy's source: copy_staged)
// hold compressed bytes, and so does the node-shared copy (compressed by its filler); the file
// holds raw ones (the note in host_store.cpp says why).

// Note [the file tier]: a block from the file is copied behind a wait for its read on the copy
// stream, and the host goes on; it waits for the read only when the block is about to be
// computed (finish), where a failed read is raised. A block from pageable host memory is
// copied into its staging buffer before the host goes on: its bytes may change once the pass
// is over, and its trainable bytes are added by the host.
void LoadPipeline::copy_staged(int64_t block, std::byte* slot, Event& loaded) {
  const bool in_file = store_.tier(block) == HostStore::Tier::file;
  StagingReader::Staged staged;
  try {
    staged = take(block, !in_file);
  } catch (...) {
    if (in_file) file_failed_();
    throw;
  }
  // The staging buffer as the load's source: the frozen bytes as stored (compressed: Note
  // [compressed host copies]), the trainable bytes after the raw frozen bytes' place, as for a
  // raw block.
  HostStore::Source source;
  source.frozen = staged.buffer->data();
  source.frozen_bytes = store_.frozen_bytes(block);
  source.trainable = staged.buffer->data() + source.frozen_bytes;
  source.trainable_bytes = store_.trainable_bytes(block);
  source.compressed_bytes = store_.compressed(block) ? store_.stored_frozen_bytes(block) : 0;
  if (source.trainable_bytes > 0) { // never in the file
    // Note [pageable host memory]: the freshest trainable bytes, their write-back waited for.
    std::memcpy(staged.buffer->data() + source.frozen_bytes, store_.load_source(block).trainable,
                source.trainable_bytes);
  }
  // A fresh event, the reader's (StagingReader::release): the next copy out of this buffer may
  // be enqueued before the read into it that waits for this one.
  std::shared_ptr<Event> copied;
  const std::size_t bytes = store_.bytes(block);
  try {
    copied = backend_->make_event();
    if (in_file) reader_->copy_after(staged);
    if (source.compressed_bytes > 0) {
      copy_compressed(block, slot, source, loaded); // Note [a decode step]
    } else {
      backend_->copy_to_device(slot, staged.buffer->data(), bytes, block);
      backend_->record(loaded, Stream::copy);
    }
    backend_->record(*copied, Stream::copy); // after the copies out of the buffer
  } catch (...) {
    reader_->release(staged); // not copied from: free once its read is done
    throw;
  }
  reader_->release(staged, std::move(copied));
  if (in_file) reads_[block] = std::move(staged);
  (in_file ? counters_.disk_bytes : counters_.staged_bytes) += bytes;
}

void LoadPipeline::finish_read(int64_t block) {
  const StagingReader::Staged read = std::exchange(reads_[block], {});
  try {
    reader_->wait(read);
  } catch (...) {
    file_failed_();
    throw;
  }
}

void LoadPipeline::forget(int64_t block) {
  reads_[block] = {};
}

} // namespace blockswap
