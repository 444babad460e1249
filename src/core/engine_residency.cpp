// The engine's residency (engine.hpp): prepare, enter and leave, and what they do: the slots,
// the wait for a load, the schedule's moves, the evictions and loads they make (every load
// through the LoadPipeline), what a failed copy leaves. One translation unit, so that the
// per-block path inlines (engine_bench). Construction, modes, accessors and stats are
// engine.cpp's; the state is engine_impl.hpp's.
#include "engine_impl.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>

#include "blockswap/core/error.hpp"
#include "blockswap/core/log.hpp"

namespace blockswap {
namespace {

using Clock = Engine::Impl::Clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string format_seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2fs", seconds);
  return text;
}

} // namespace

// prepare() restores the set of blocks the schedule starts with. A block already on the device
// stays where it is, so nothing is copied in the steady state; a block it loads goes back into
// the slot it was last computed in when that slot is free: a forward after a forward (a
// pipeline stage's micro-batches) then puts every block where the first forward had it, which
// the backwards of both need (Note [exact backward]; Note [training rotation] in
// schedule.cpp). Otherwise which slot does not matter: all slots have the same size.
//
// When it has to place blocks itself (the first pass, after a mode change, disable or
// enable) it is synchronous, as the seed's is, and leaves every block ready. In the steady
// state it does not wait: the loads the last pass started for this one (forward-only
// rotation) stay in flight until wait_for_block orders compute after them, so the host never
// waits here for the previous pass's compute.
void Engine::prepare() {
  std::lock_guard lock(impl_->mutex_);
  impl_->compress_once(); // Note [compressed host copies]: the caller has filled the host copies
  const int64_t n = blocks();
  const std::vector<int64_t>& initial = impl_->current().initial_slots();
  // A forward after a forward (a pipeline stage's warm-up): the blocks put back are waited for
  // when they compute, like a pass's own loads, so that they overlap the last forward's tail.
  const bool turn = impl_->training() && impl_->enabled_ && impl_->backward_started_.empty() &&
                    std::any_of(impl_->blocks_.begin(), impl_->blocks_.end(),
                                [](const Impl::BlockState& b) { return b.forwarded; });
  const auto needed = impl_->enabled_ ? impl_->current().slots() : n;
  auto wanted = [&](int64_t b) { return !impl_->enabled_ || initial[b] >= 0; };
  impl_->ensure_slots(needed);
  bool placed = false;
  std::vector<int64_t> loads;
  for (int64_t b = 0; b < n; ++b) {
    if (impl_->blocks_[b].slot >= 0 && !wanted(b)) {
      impl_->evict(b, false);
      placed = true;
    }
    if (impl_->blocks_[b].slot < 0 && wanted(b)) loads.push_back(b);
  }
  impl_->loads_.start_pass(loads);
  std::vector<int64_t> slot_of(n, -1);
  for (int64_t b : loads) {
    const int64_t s = impl_->slot_index(impl_->blocks_[b].computed_in);
    if (s < 0 || s >= needed || impl_->slots_[s].block >= 0) continue;
    if (std::find(slot_of.begin(), slot_of.end(), s) == slot_of.end()) slot_of[b] = s;
  }
  int64_t free_slot = 0;
  for (int64_t b : loads) {
    if (slot_of[b] < 0) {
      while (impl_->slots_[free_slot].block >= 0 ||
             std::find(slot_of.begin(), slot_of.end(), free_slot) != slot_of.end()) {
        ++free_slot;
      }
      slot_of[b] = free_slot++;
    }
  }
  for (int64_t b : loads) { // in the order the load pipeline was told
    impl_->load(b, slot_of[b]);
    placed = true;
  }
  impl_->backward_started_.clear(); // a new pass starts
  impl_->switched_since_prepare_ = false;
  for (Impl::BlockState& state : impl_->blocks_) state.forwarded = false;
  if (!placed || (turn && static_cast<int64_t>(impl_->slots_.size()) <= needed)) return;
  impl_->synchronize_locked();
  for (int64_t b = 0; b < n; ++b) {
    if (impl_->blocks_[b].slot < 0 || impl_->blocks_[b].ready) continue;
    impl_->finish_load(b);
    impl_->mark_ready(b);
  }
  if (static_cast<int64_t>(impl_->slots_.size()) > needed) impl_->release_empty_slots();
}

void Engine::allocate_slots() {
  std::lock_guard lock(impl_->mutex_);
  impl_->ensure_slots(impl_->enabled_ ? impl_->current().slots() : blocks());
}

// The recompute pass of checkpointing: a differentiable block that already ran forward in this
// pass (a block that has not is computed normally: not every block need be checkpointed).
bool Engine::Impl::recompute_pass(int64_t block, Compute compute) const {
  // Non-reentrant checkpointing recomputes blocks during backward with grad mode on, as its
  // forward ran: a block computed again once a backward has started is its recompute.
  return compute.differentiable && blocks_[block].forwarded &&
         (compute.reentrant_checkpointing || !backward_started_.empty());
}

bool Engine::recomputing(int64_t block, Compute compute) const {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  return impl_->recompute_pass(block, compute);
}

Entered Engine::enter(int64_t block, Compute compute) {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  if (impl_->recompute_pass(block, compute)) {
    if (impl_->blocks_[block].slot < 0) impl_->place(block, impl_->victim_for(block));
    impl_->wait_locked(block);
    return Entered{impl_->slots_[impl_->blocks_[block].slot].memory, true};
  }
  // In training, a differentiable block computed twice between two prepares is either the
  // recompute of reentrant checkpointing without that option, or a second pass without
  // prepare: the moves would follow neither. Both are named.
  BLOCKSWAP_CHECK(!(impl_->training() && compute.differentiable && impl_->blocks_[block].forwarded),
                  "[", impl_->label_, "] block ", block,
                  " runs forward a second time in this pass. If this is the recompute of "
                  "reentrant activation checkpointing, set reentrant_activation_checkpointing = "
                  "true; otherwise call prepare_block_devices_before_forward() before each pass");
  BLOCKSWAP_CHECK(impl_->blocks_[block].slot >= 0, "[", impl_->label_, "] block ", block,
                  " is not on the device; this ", impl_->current().describe(),
                  " does not place it there now (call prepare_block_devices_before_forward() "
                  "before each pass, and wait for blocks in the order they are computed)");
  impl_->wait_locked(block);
  return Entered{impl_->slots_[impl_->blocks_[block].slot].memory, false};
}

void Engine::leave(int64_t block, Compute compute) {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  if (impl_->recompute_pass(block, compute)) return;
  Impl::BlockState& state = impl_->blocks_[block];
  // A block submitted before its load was waited for was skipped (musubi-tuner's skip-layer
  // guidance submits a block it neither waits for nor runs): its slot is done with once its
  // load is. (A block computed without the wait read its host copy: on a GPU torch refuses
  // that at once; on the emulated device it reads the true values.)
  if (state.slot >= 0 && !state.ready) impl_->wait_locked(block);
  if (state.slot >= 0) state.computed_in = impl_->slots_[state.slot].memory.get();
  state.forwarded = true;
  if (!impl_->enabled_) return;
  for (const Move& m : impl_->current().after_forward(block)) impl_->move(m, true);
}

// Note [slot lifetime]
// Slots are shared: the listener's views of a slot (the front end's tensors, and the views
// autograd saves of them) own it too. A slot the engine lets go, or outlives, is freed only
// once nothing views it, so a pending backward never reads freed memory.
void Engine::Impl::ensure_slots(int64_t count) {
  while (static_cast<int64_t>(slots_.size()) < count) {
    SlotState slot;
    slot.memory = std::make_shared<Buffer>(backend_->allocate_device(slot_bytes_));
    slot.released = backend_->make_event();
    slots_.push_back(std::move(slot));
    stats_.device_bytes += slot_bytes_;
  }
  stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, stats_.device_bytes);
}

// Frees the slots added while swapping was disabled. Called with no copy in flight. A slot that
// autograd still views (a backward is pending) stays until a later prepare: its block's
// backward will need it (Note [exact backward]).
void Engine::Impl::release_empty_slots() {
  std::vector<SlotState> kept;
  for (SlotState& slot : slots_) {
    if (slot.block < 0 && slot.memory.use_count() == 1) {
      stats_.device_bytes -= slot_bytes_;
      continue;
    }
    if (slot.block >= 0) blocks_[slot.block].slot = static_cast<int64_t>(kept.size());
    kept.push_back(std::move(slot));
  }
  slots_ = std::move(kept);
}

// A ready block's load is complete, but the stream that computes now may not be the one that
// waited for it (the caller can switch the current stream between passes): the wait is
// enqueued again, which costs a stream-wait on a completed event.
void Engine::Impl::wait_locked(int64_t block) {
  BlockState& state = blocks_[block];
  if (state.ready) {
    if (!current().host_waits()) backend_->wait(Stream::compute, *state.loaded);
    return;
  }
  const auto start = Clock::now();
  finish_load(block); // Note [the file tier]: its read done, or its failure raised
  const bool device_timed = !current().host_waits() && backend_->times_events();
  try {
    if (current().host_waits()) {
      backend_->synchronize(*state.loaded);
    } else if (device_timed) {
      StallTimer timer;
      if (spare_timers_.empty()) {
        timer = StallTimer{backend_->make_timed_event(), backend_->make_timed_event()};
      } else {
        timer = std::move(spare_timers_.back());
        spare_timers_.pop_back();
      }
      backend_->record(*timer.before, Stream::compute);
      backend_->wait(Stream::compute, *state.loaded);
      backend_->record(*timer.after, Stream::compute);
      stall_timers_.push_back(std::move(timer));
    } else {
      backend_->wait(Stream::compute, *state.loaded);
    }
  } catch (...) {
    copy_failed(std::current_exception());
  }
  const double stalled = seconds_since(start);
  if (!device_timed) stats_.stall_seconds += stalled;
  if (options_.trace && stalled > 0) {
    options_.trace->add(detail::concat("wait block ", block), Track::compute, start, Clock::now());
  }
  mark_ready(block);
  if (options_.debug && state.replaced >= 0) {
    log(detail::concat("[", label_, "] Moved blocks ", state.replaced, " and ", block, " in ",
                       format_seconds(seconds_since(state.submitted))));
    log(detail::concat("[", label_, "] Waited for block ", block, ": ", format_seconds(stalled)));
  }
}

int64_t Engine::Impl::slot_index(const Buffer* memory) const {
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s].memory.get() == memory) return static_cast<int64_t>(s);
  }
  return -1;
}

// Block `block` into slot `slot`, whatever either holds now. The load is enqueued, not waited.
void Engine::Impl::place(int64_t block, int64_t slot) {
  BlockState& state = blocks_[block];
  if (state.slot == slot) return;
  if (state.slot >= 0) evict(block, false);
  if (slots_[slot].block >= 0) evict(slots_[slot].block, true);
  load(block, slot);
}

void Engine::Impl::move(const Move& m, bool settle) {
  const BlockState& out = blocks_[m.out];
  // A mode switched after prepare() placed the blocks as the other mode's schedule starts.
  const char* const why = switched_since_prepare_
                              ? "; the mode changed since the last one: call it after switching"
                              : "";
  BLOCKSWAP_CHECK(out.slot >= 0, "[", label_, "] cannot move block ", m.out,
                  " off the device: it is not there. Call prepare_block_devices_before_forward() "
                  "before each pass (",
                  current().describe(), why, ")");
  BLOCKSWAP_CHECK(blocks_[m.in].slot < 0, "[", label_, "] cannot load block ", m.in,
                  ": it is already on the device. Call prepare_block_devices_before_forward() "
                  "before each pass (",
                  current().describe(), why, ")");
  if (options_.debug) {
    log(detail::concat("[", label_, "] Move block ", m.out, " to host and block ", m.in, " to ",
                       backend_->name()));
  }
  const int64_t slot = out.slot;
  wait_like_the_seed(slot);
  evict(m.out, true, settle);
  load(m.in, slot);
  blocks_[m.in].replaced = m.out;
  ++stats_.moves;
}

// The seed replay synchronises the whole device before each move, as the seed does.
void Engine::Impl::wait_like_the_seed(int64_t slot) {
  if (!current().host_waits()) return;
  SlotState& s = slots_[slot];
  backend_->record(*s.released, Stream::compute);
  try {
    backend_->synchronize(*s.released);
  } catch (...) {
    copy_failed(std::current_exception());
  }
}

// Note [slot reuse]
// A slot may be overwritten only after every computation that reads it has finished on the
// device. Eviction happens right after the caller has enqueued the block's last computation, so
// an event recorded on the compute stream now follows every reader, and the copy stream waits
// for it before the next copy into the slot. The host does not wait. A compressed block's load
// ends with its decode into the slot, on the decode stream (Note [a decode step] in
// load_pipeline.cpp): a block that computed waited for it, so the compute's event covers it;
// one evicted before it computed (a mode switch, a failed pass) did not, so the copy stream
// also waits for that block's load event before the slot is refilled or poisoned, and the next
// decode into the slot comes after the next copy on the copy stream: never two writers.
void Engine::Impl::evict(int64_t block, bool refilled, bool settle) {
  BlockState& state = blocks_[block];
  SlotState& slot = slots_[state.slot];
  // Written back before (Note [write-back before the forward]) and unchanged since: the host
  // copy the tensors are bound to next must hold those bytes.
  if (store_.pending(block) && !state.dirty) commit(block);
  if (listener_ != nullptr) { // it may read the slot, write the host bytes, throw
    loads_.hold_around(block, [&] { listener_->on_evicted(block); });
  }
  backend_->record(*slot.released, Stream::compute);
  backend_->wait(Stream::copy, *slot.released);
  if (!state.ready && loads_.decoded(block)) backend_->wait(Stream::copy, *state.loaded);
  if (state.dirty) {
    write_back(block);
  } else if (current().writes_back()) {
    // The seed replay copies back weights that did not change: the host's bytes stay the same
    // whatever part of the copy happens.
    backend_->copy_to_host(store_.buffer(block)->data(), slot.memory->data(), store_.bytes(block),
                           block);
    stats_.d2h_bytes += store_.bytes(block);
  }
  if (!refilled) backend_->poison(slot.memory->data(), slot_bytes_);
  slot.block = -1;
  state.slot = -1;
  state.ready = false;
  loads_.forget(block); // loaded and never computed: its read is no longer waited for
  if (settle && store_.pending(block)) commit(block);
}

void Engine::Impl::load(int64_t block, int64_t slot) {
  BlockState& state = blocks_[block];
  SlotState& s = slots_[slot];
  if (listener_ != nullptr) listener_->before_load(block); // the host copy must be final
  BLOCKSWAP_ASSERT(s.block < 0, "slot ", slot, " still holds block ", s.block);
  const std::size_t bytes = store_.bytes(block);
  backend_->poison(s.memory->data() + bytes, slot_bytes_ - bytes);
  // Note [pageable host memory]: a staged block's trainable bytes are read by the host, once
  // their write-back is done.
  if (loads_.staged(block) && store_.trainable_bytes(block) > 0 && store_.pending(block)) {
    try {
      backend_->synchronize(store_.written(block));
    } catch (...) {
      copy_failed(std::current_exception());
    }
  }
  loads_.copy_into(block, s.memory->data(), *state.loaded); // may throw: nothing has changed
  stats_.h2d_bytes += bytes;
  s.block = block;
  state.slot = slot;
  state.ready = false;
  state.replaced = -1;
  state.submitted = Clock::now();
}

void Engine::Impl::finish_load(int64_t block) {
  try {
    loads_.finish(block);
  } catch (...) {
    copy_failed(std::current_exception()); // the block's load, and those after it, are forgotten
  }
}

void Engine::Impl::mark_ready(int64_t block) {
  BlockState& state = blocks_[block];
  if (listener_ != nullptr) listener_->on_ready(block, slots_[state.slot].memory);
  state.ready = true;
}

// A copy failed: whatever was loading may hold garbage. Blocks not yet waited for leave the
// device; their host copies are untouched, so the next prepare() loads them again. A decode
// still writing into a slot so freed is waited for by the copy stream before the next copy
// (Note [slot reuse]).
void Engine::Impl::forget_unready_loads() {
  for (int64_t b = 0; b < blocks(); ++b) {
    BlockState& state = blocks_[b];
    if (state.slot >= 0 && !state.ready) {
      if (loads_.decoded(b)) backend_->wait(Stream::copy, *state.loaded);
      slots_[state.slot].block = -1;
      state.slot = -1;
      loads_.forget(b);
    }
  }
}

// Every copy and every decode done (Note [a decode step]): both streams are waited for, even
// when the first throws, so that nothing is left writing a slot.
void Engine::Impl::synchronize_locked() {
  const bool decodes = loads_.decode_buffer_bytes() > 0;
  backend_->record(*copies_done_, Stream::copy);
  if (decodes) backend_->record(*decodes_done_, Stream::decode);
  std::exception_ptr error;
  for (const Event* done : {copies_done_.get(), decodes ? decodes_done_.get() : nullptr}) {
    if (done == nullptr) continue;
    try {
      backend_->synchronize(*done);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) copy_failed(error);
  commit_write_backs();
}

// Adds the stalls whose events have completed to the stats.
void Engine::Impl::collect_stalls() const {
  std::size_t kept = 0;
  for (StallTimer& timer : stall_timers_) {
    const std::optional<double> stalled = backend_->elapsed_seconds(*timer.before, *timer.after);
    if (stalled.has_value()) {
      stats_.stall_seconds += std::max(0.0, *stalled);
      spare_timers_.push_back(std::move(timer));
    } else {
      stall_timers_[kept++] = std::move(timer);
    }
  }
  stall_timers_.resize(kept);
}

} // namespace blockswap
