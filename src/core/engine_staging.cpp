// The engine's staged loads: blocks whose bytes reach the device through a ring of pinned
// staging buffers, read from the model's file (the file tier, DESIGN.md "Tiers") or copied from
// host memory the system would not pin.
#include "engine_impl.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>

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

} // namespace

// Note [the file tier]
// A block in the file has no host copy. A reader thread (core/file_reader.hpp) reads its bytes
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
// (restart_reads, hold_reads below).
void Engine::Impl::start_staging() {
  if (options_.file) {
    const FileTier& file = *options_.file;
    BLOCKSWAP_CHECK_ARGUMENT(file.blocks.size() == blocks_.size(), "[", label_,
                             "] the file tier has ", file.blocks.size(), " blocks for ",
                             blocks_.size(), ": give every block's place in the file");
    BLOCKSWAP_CHECK_ARGUMENT(file.staging_buffers >= 1, "[", label_,
                             "] the file tier needs at least one staging buffer, not ",
                             file.staging_buffers);
    for (int64_t b = 0; b < blocks(); ++b) {
      BLOCKSWAP_CHECK_ARGUMENT(!store_.in_file(b) || file.blocks[b].bytes == store_.bytes(b), "[",
                               label_, "] block ", b, " has ", store_.bytes(b),
                               " packed bytes, but its place in the file fills ",
                               file.blocks[b].bytes);
    }
  }
  staged_.assign(blocks_.size(), false);
  auto count_staged = [&] {
    int64_t in_file = 0, pageable = 0;
    for (int64_t b = 0; b < blocks(); ++b) {
      const bool from_file = store_.in_file(b);
      const bool unpinned = !from_file && store_.buffer(b)->pageable();
      staged_[b] = from_file || unpinned;
      in_file += from_file ? 1 : 0;
      pageable += unpinned ? 1 : 0;
    }
    return std::pair{in_file, pageable};
  };
  const auto [in_file, pageable] = count_staged();
  if (in_file + pageable == 0) return; // every block is in pinned host memory
  const int64_t ring = options_.file ? options_.file->staging_buffers : kPageableStaging;
  // More buffers than staged blocks would never be read into. Pinning is capped (Note [pageable
  // host memory]): a staging buffer the system will not pin takes the pinned memory of the
  // blocks that have some and need it least (the last in host_priority: a block that never
  // moves is loaded once), which nothing has filled yet; those blocks are staged in turn.
  std::vector<std::shared_ptr<Buffer>> staging;
  auto give_up = store_.caller_memory() ? priority_.rend() : priority_.rbegin();
  for (int64_t i = 0; i < std::min(ring, in_file + pageable); ++i) {
    Buffer buffer = backend_->allocate_host(slot_bytes_);
    while (buffer.pageable()) {
      while (give_up != priority_.rend() && staged_[*give_up]) ++give_up;
      if (give_up == priority_.rend()) break;
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
  std::vector<FileBlock> blocks(blocks_.size()); // what the reader reads, per block
  for (int64_t b = 0; b < this->blocks(); ++b) {
    if (store_.in_file(b)) {
      blocks[b] = options_.file->blocks[b];
    } else if (staged_[b]) {
      blocks[b] = FileBlock{{}, store_.frozen_bytes(b), store_.buffer(b)->data()};
    } // else never read: loaded from pinned memory
  }
  // Loud, once per block list and process (an offloader built again says nothing new): the
  // user's system caps pinning, and it costs host work.
  if (pageable_blocks > 0) {
    warn_once(label_, detail::concat(
                          "WARNING: the host copies of ", pageable_blocks, " of ", this->blocks(),
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
  staging_depth_ = staging.size();
  reader_ = backend_->make_staging_reader(StagingSpec{
      options_.file ? options_.file->path : std::string(), std::move(blocks), std::move(staging),
      label_, options_.file ? options_.file->bypass : CacheBypass::direct});
  plan_reads();
}

void Engine::Impl::plan_reads() {
  if (!reader_) return;
  file_order_.clear();
  for (const Op& op : current().pass()) {
    if (op.kind == Op::Kind::move && staged_[op.move.in]) file_order_.push_back(op.move.in);
  }
  file_cursor_ = 0;
}

// Note [pageable host memory]: a block's host bytes change between passes (a weight written
// between steps) and at its eviction (the listener saves there what the caller wrote into its
// slot). Copies from host memory are not made ahead across a pass's end (read_ahead), and the
// ones still asked for (a pass stopped early) are dropped at prepare(); around an eviction the
// copies ahead that include the block wait (hold_reads), and are made again after it. No copy
// reads host bytes while they change. The file's bytes never change under a run.
void Engine::Impl::restart_reads() {
  if (!reader_ || !stages_memory_) return;
  reader_->cancel();
  file_ahead_.clear();
  file_cursor_ = 0;
}

bool Engine::Impl::hold_reads(int64_t evicted) {
  if (!reader_ || !stages_memory_ ||
      std::find(file_ahead_.begin(), file_ahead_.end(), evicted) == file_ahead_.end()) {
    return false;
  }
  reader_->cancel(); // waits for a copy in flight
  return true;
}

void Engine::Impl::resume_reads() {
  for (int64_t b : file_ahead_) reader_->request(b);
}

void Engine::Impl::expect_loads(const std::vector<int64_t>& blocks) {
  if (!reader_) return;
  reader_->cancel();
  file_ahead_.clear();
  for (int64_t b : blocks) {
    if (!staged_[b]) continue;
    reader_->request(b);
    file_ahead_.push_back(b);
  }
  file_cursor_ = 0; // then the pass
}

StagingReader::Staged Engine::Impl::take_from_file(int64_t block, bool wait) {
  if (file_ahead_.empty() || file_ahead_.front() != block) { // Note [the file tier]
    reader_->cancel();
    file_ahead_.clear();
    reader_->request(block);
    file_ahead_.push_back(block);
    const auto at = std::find(file_order_.begin(), file_order_.end(), block);
    if (at != file_order_.end()) {
      file_cursor_ = static_cast<std::size_t>(at - file_order_.begin() + 1);
    }
  }
  file_ahead_.pop_front();
  StagingReader::Staged staged = wait ? reader_->next() : reader_->take(); // next() rethrows
  read_ahead();
  return staged;
}

// Reads from the file cycle into the next pass; copies from host memory stop at the pass's
// end (Note [pageable host memory]): between passes the caller may write those bytes.
void Engine::Impl::read_ahead() {
  while (!file_order_.empty() && file_ahead_.size() < staging_depth_) {
    if (file_cursor_ == file_order_.size()) {
      if (stages_memory_) return; // prepare() starts the next pass's
      file_cursor_ = 0;
    }
    const int64_t b = file_order_[file_cursor_++];
    reader_->request(b);
    file_ahead_.push_back(b);
  }
}

// Note [the file tier]: a block from the file is copied behind a wait for its read on the copy
// stream, and the host goes on; it waits for the read only when the block is about to be
// computed (finish_read), where a failed read is raised. A block from pageable host memory is
// copied into its staging buffer before the host goes on: its bytes may change once the pass
// is over, and its trainable bytes are added by the host.
void Engine::Impl::load_staged(int64_t block, std::byte* slot) {
  const bool in_file = store_.in_file(block);
  StagingReader::Staged staged;
  try {
    staged = take_from_file(block, !in_file);
  } catch (...) {
    if (listener_ != nullptr && in_file) listener_->on_file_failed();
    throw;
  }
  const std::size_t bytes = store_.bytes(block);
  if (const std::size_t trainable = store_.trainable_bytes(block); trainable > 0) {
    // Note [pageable host memory]: the freshest trainable bytes, once written back.
    if (store_.pending(block)) {
      try {
        backend_->synchronize(store_.written(block));
      } catch (...) {
        reader_->release(staged);
        copy_failed(std::current_exception());
      }
    }
    std::memcpy(staged.buffer->data() + store_.frozen_bytes(block),
                store_.load_source(block).trainable, trainable);
  }
  // A fresh event, the reader's (StagingReader::release): the next copy out of this buffer may
  // be enqueued before the read into it that waits for this one.
  std::shared_ptr<Event> copied;
  try {
    copied = backend_->make_event();
    if (in_file) reader_->copy_after(staged);
    backend_->copy_to_device(slot, staged.buffer->data(), bytes, block);
    backend_->record(*copied, Stream::copy);
  } catch (...) {
    reader_->release(staged); // not copied from: free once its read is done
    throw;
  }
  reader_->release(staged, std::move(copied));
  if (in_file) blocks_[block].read = std::move(staged);
  (in_file ? stats_.disk_bytes : stats_.staged_bytes) += bytes;
}

void Engine::Impl::finish_read(int64_t block) {
  BlockState& state = blocks_[block];
  if (!state.read.read) return;
  const StagingReader::Staged read = std::exchange(state.read, {});
  try {
    reader_->wait(read);
  } catch (...) {
    if (listener_ != nullptr) listener_->on_file_failed();
    copy_failed(std::current_exception()); // the block's load, and those after it, are forgotten
  }
}

} // namespace blockswap
