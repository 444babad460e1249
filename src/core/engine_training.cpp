// What training adds to the engine: the backward's placement (Note [exact backward]), blocks
// changed on the device written back to the HostStore (Note [write-back before the forward];
// the protocol is Note [atomic write-back] in host_store.cpp), and the host step's copies
// (Note [host step]).
#include <exception>
#include <mutex>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "engine_impl.hpp"

namespace blockswap {

void Engine::after_backward(int64_t block) {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  if (!impl_->enabled_) return;
  for (const Move& m : impl_->current().after_backward(block)) impl_->move(m, false);
}

// A slot for `block`, loaded outside the schedule during backward (the recompute pass of
// checkpointing goes from the last block to the first): an empty slot, else the slot of a
// later block (its backward is done), preferring the slot `block` was last computed in, else
// the slot of the earliest block (its backward comes last).
int64_t Engine::Impl::victim_for(int64_t block) const {
  int64_t chosen = 0;
  auto score = [&](int64_t s) -> int64_t { // higher is better
    const int64_t occupant = slots_[s].block;
    if (occupant < 0) return 3 * blocks();
    if (occupant > block)
      return slots_[s].memory.get() == blocks_[block].computed_in ? 2 * blocks() + 1
                                                                  : blocks() + occupant;
    return blocks() - occupant;
  };
  for (int64_t s = 1; s < static_cast<int64_t>(slots_.size()); ++s) {
    if (score(s) > score(chosen)) chosen = s;
  }
  return chosen;
}

// Note [exact backward]
// Autograd saves views of a block's weights (Note [trap 1] in src/torch/block_autograd.cpp):
// a block's backward reads the slot its forward ran in, whatever that slot holds by then.
// So before the backward of block i runs, that very slot is made to hold block i again. In
// the schedule's own order this finds block i there already (the training moves hand every
// block its forward slot back; Schedule tests check it for every N and K) and costs one
// stream-wait; in any other order (a loss on an intermediate block, a subset of blocks in the
// graph, two forwards then one backward, backward twice, a mode change in between) it loads
// the block on demand, and the backward is still exact. The moves after a backward are
// prefetches only: a block's backward is known to be over when the next block's starts (the
// front end sees no other end of it), and its moves run then.
void Engine::acquire_for_backward(int64_t block, const Buffer* slot) {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  const bool starts = impl_->backward_started_.empty() || impl_->backward_started_.back() < block;
  if (starts && impl_->enabled_ && impl_->training()) impl_->prefetch_backward_start(block);
  while (!impl_->backward_started_.empty() && impl_->backward_started_.back() >= block) {
    const int64_t done = impl_->backward_started_.back();
    impl_->backward_started_.pop_back();
    if (impl_->enabled_) impl_->prefetch_after_backward(done);
  }
  const int64_t s = impl_->slot_index(slot);
  BLOCKSWAP_CHECK(s >= 0, "[", impl_->label_, "] block ", block,
                  "'s backward needs the device memory its forward ran in, which this offloader "
                  "no longer has");
  impl_->place(block, s);
  impl_->wait_locked(block);
  impl_->backward_started_.push_back(block);
}

// Note [a backward after a backward]
// A backward that starts where the last one ended (a pipeline stage's second backward in a
// row) finds the blocks its forward ended with gone: the last backward's moves put back the
// ones a pass starts with. They are loaded at once, each into the slot it was last computed in,
// rather than one at a time as each backward reaches them (the host waiting for each): only
// those at or below `block` (a backward from an intermediate block needs no more), and only
// into a slot that is free or holds a block whose backward comes after theirs.
void Engine::Impl::prefetch_backward_start(int64_t block) {
  const std::vector<int64_t> after_forward = current().slots_after_forward();
  for (int64_t b = block; b >= 0; --b) {
    if (after_forward[b] < 0 || blocks_[b].slot >= 0) continue;
    const int64_t s = slot_index(blocks_[b].computed_in);
    if (s < 0 || slots_[s].block > b) continue;
    const int64_t occupant = slots_[s].block;
    wait_like_the_seed(s);
    place(b, s);
    blocks_[b].replaced = occupant;
    ++stats_.moves;
  }
}

// Each move of the schedule after `block`'s backward brings its incoming block back into the
// slot that block was last computed in, unless it is on the device already.
void Engine::Impl::prefetch_after_backward(int64_t block) {
  for (const Move& m : current().after_backward(block)) {
    const int64_t s = slot_index(blocks_[m.in].computed_in);
    if (blocks_[m.in].slot >= 0 || s < 0) continue;
    const int64_t occupant = slots_[s].block;
    wait_like_the_seed(s);
    place(m.in, s);
    blocks_[m.in].replaced = occupant;
    ++stats_.moves;
  }
  const BlockState& done = blocks_[block];
  if (done.slot >= 0 && done.dirty && done.evicted_by_forward) write_back(block);
}

// Block `block`'s trainable bytes to the store's region that is not authoritative (Note
// [atomic write-back] in host_store.cpp), after every computation enqueued so far. A block
// written back twice before a commit overwrites its own pending write-back.
void Engine::Impl::write_back(int64_t block) {
  BlockState& state = blocks_[block];
  SlotState& slot = slots_[state.slot];
  backend_->record(*slot.released, Stream::compute);
  backend_->wait(Stream::copy, *slot.released);
  const HostStore::WriteBack to = store_.begin_write_back(block);
  const std::size_t trainable = store_.trainable_bytes(block);
  backend_->copy_to_host(to.target.data(), slot.memory->data() + store_.frozen_bytes(block),
                         trainable, block);
  backend_->record(to.written, Stream::copy);
  stats_.d2h_bytes += trainable;
  state.dirty = false;
}

// Waits for block `block`'s write-back and makes its region the authoritative one.
void Engine::Impl::commit(int64_t block) {
  try {
    backend_->synchronize(store_.written(block));
  } catch (...) {
    copy_failed(std::current_exception());
  }
  const HostRegion now = store_.commit(block);
  if (listener_ != nullptr) listener_->on_written_back(block, now);
}

// Note [write-back before the forward]
// A block stepped in backward that stays on the device, and that the next forward evicts, is
// written back as soon as its backward is over (the next block's backward starts, or the
// backward ends): the copy overlaps the rest of the backward, or the time until that forward
// evicts it. When the forward evicts it, its host copy is committed first, so its tensors are
// bound to the latest values at once: the caller may read them in the middle of that pass (a
// tied weight). A block that changed without it (a backward that failed part-way) is written
// back at that eviction and waited for. The bytes are the same: each changed block is written
// back once, when it must leave.
void Engine::write_back_early() {
  std::lock_guard lock(impl_->mutex_);
  for (int64_t b = 0; b < blocks(); ++b) {
    const Impl::BlockState& state = impl_->blocks_[b];
    if (state.slot >= 0 && state.dirty && state.evicted_by_forward) impl_->write_back(b);
  }
}

// After the copy stream has confirmed every copy: each pending write-back becomes the
// authoritative host copy (Note [atomic write-back] in host_store.cpp).
void Engine::Impl::commit_write_backs() {
  for (int64_t b = 0; b < blocks(); ++b) {
    if (!store_.pending(b)) continue;
    const HostRegion now = store_.commit(b);
    if (listener_ != nullptr) listener_->on_written_back(b, now);
  }
}

// A copy failed (`error`, which the backend threw): blocks not yet waited
// for may hold garbage and leave the device; pending write-backs are dropped and named.
void Engine::Impl::copy_failed(std::exception_ptr error) {
  forget_unready_loads();
  std::string dropped;
  for (int64_t b = 0; b < blocks(); ++b) {
    BlockState& state = blocks_[b];
    if (!store_.pending(b)) continue;
    store_.drop(b);
    if (state.slot >= 0) {
      state.dirty = true; // the changes are still in its slot: written back when it leaves
    } else {
      dropped += detail::concat(dropped.empty() ? "" : ", ", b);
    }
  }
  if (dropped.empty()) std::rethrow_exception(error);
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    throw Error(detail::concat("[", label_, "] a copy failed (", e.what(),
                               "); the changes written back from block(s) ", dropped,
                               " are dropped: their host copies keep the values from before "
                               "those changes"));
  }
}

void Engine::mark_dirty(int64_t block) {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  BLOCKSWAP_CHECK(impl_->blocks_[block].slot >= 0, "[", impl_->label_, "] block ", block,
                  " is not on the device, so it cannot have changed there");
  BLOCKSWAP_CHECK(impl_->store_.trainable_bytes(block) > 0, "[", impl_->label_, "] block ", block,
                  " has no trainable bytes (EngineOptions::trainable_bytes), so nothing of it "
                  "may change on the device");
  impl_->blocks_[block].dirty = true;
}

// Note [host step]
// With the optimizer step on the host, a parameter's gradient is copied out on the copy stream
// (after the computation that produced it), the CPU steps the block's host copy, and the
// block's trainable bytes are loaded again into its slot if it is still there. Loads of the
// block wait until its steps are done (ResidencyListener::before_load).
std::shared_ptr<Event> Engine::copy_out(std::byte* host, const std::byte* device, std::size_t bytes,
                                        int64_t tag) {
  std::lock_guard lock(impl_->mutex_);
  std::shared_ptr<Event> computed = impl_->backend_->make_event();
  impl_->backend_->record(*computed, Stream::compute);
  impl_->backend_->wait(Stream::copy, *computed);
  impl_->backend_->copy_to_host(host, device, bytes, tag);
  impl_->stats_.d2h_bytes += bytes;
  std::shared_ptr<Event> done = impl_->backend_->make_event();
  impl_->backend_->record(*done, Stream::copy);
  return done;
}

void Engine::reload_trainable(int64_t block) {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  Impl::BlockState& state = impl_->blocks_[block];
  const std::size_t trainable = impl_->store_.trainable_bytes(block);
  if (state.slot < 0 || trainable == 0) return;
  BLOCKSWAP_CHECK(!state.dirty && !impl_->store_.pending(block), "[", impl_->label_, "] block ",
                  block, " changed on the device and on the host at once");
  if (impl_->listener_ != nullptr) impl_->listener_->before_load(block);
  Impl::SlotState& slot = impl_->slots_[state.slot];
  impl_->backend_->record(*slot.released, Stream::compute); // after every reader of the old bytes
  impl_->backend_->wait(Stream::copy, *slot.released);
  // The block's load may end with a decode not waited for yet (Note [a decode step]), whose
  // error its load event holds: the host waits for it here (a rare path: a block loaded again
  // before its host step), so that the new load event, on the copy stream, follows it and a
  // damaged block raises.
  if (!state.ready && impl_->loads_.decoded(block)) {
    try {
      impl_->backend_->synchronize(*state.loaded);
    } catch (...) {
      impl_->copy_failed(std::current_exception());
    }
  }
  impl_->backend_->copy_to_device(slot.memory->data() + impl_->store_.frozen_bytes(block),
                                  impl_->store_.trainable(block).data(), trainable, block);
  impl_->backend_->record(*state.loaded, Stream::copy);
  impl_->stats_.h2d_bytes += trainable;
  state.ready = false; // the next enter waits for it
}

bool Engine::writing_back() const {
  std::lock_guard lock(impl_->mutex_);
  for (int64_t b = 0; b < blocks(); ++b) {
    if (impl_->store_.pending(b) && impl_->blocks_[b].slot < 0) return true;
  }
  return false;
}

} // namespace blockswap
