#include "blockswap/core/engine.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/log.hpp"

namespace blockswap {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string format_seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2fs", seconds);
  return text;
}

void check_backend(const std::shared_ptr<Backend>& backend, const std::string& label) {
  BLOCKSWAP_CHECK(backend != nullptr, "[", label, "] the engine needs a backend");
}

ScheduleOptions schedule_options(std::size_t blocks, const EngineOptions& options, Mode mode) {
  // K is checked against the mode the engine can reach with the tightest bound first, so that
  // a K too large for training is reported as a training error.
  if (options.supports_backward) {
    Schedule::check(static_cast<int64_t>(blocks), options.blocks_to_swap, Mode::training);
  }
  return ScheduleOptions{static_cast<int64_t>(blocks), options.blocks_to_swap, mode,
                         options.rotating_slots, options.algorithm};
}

} // namespace

class Engine::Impl {
public:
  Impl(std::shared_ptr<Backend> backend, std::vector<std::size_t> block_bytes,
       EngineOptions options, std::string label);
  ~Impl();

  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }
  const std::string& label() const { return label_; }
  std::size_t slot_bytes() const { return slot_bytes_; }
  std::byte* host_data(int64_t block) const;
  std::shared_ptr<Buffer> host_buffer(int64_t block) const;
  HostRegion host_trainable(int64_t block) const;
  std::size_t block_bytes(int64_t block) const;

  void prepare();
  Entered enter(int64_t block, Compute compute);
  void leave(int64_t block, Compute compute);
  bool recomputing(int64_t block, Compute compute) const;
  void acquire_for_backward(int64_t block, const Buffer* slot);
  void after_backward(int64_t block);

  void disable();
  void enable();
  bool enabled() const;
  void set_forward_only(bool forward_only);
  bool forward_only() const;
  void set_listener(ResidencyListener* listener);
  bool is_resident(int64_t block) const;
  bool is_ready(int64_t block) const;
  std::byte* device_data(int64_t block) const;
  std::shared_ptr<Buffer> device_buffer(int64_t block) const;
  void mark_dirty(int64_t block);
  void write_back_early();
  bool writing_back() const;
  std::shared_ptr<Event> copy_out(std::byte* host, const std::byte* device, std::size_t bytes,
                                  int64_t tag);
  void reload_trainable(int64_t block);
  // Without the engine's lock: a worker thread waits while the engine goes on.
  void wait_event(const Event& event) { backend_->synchronize(event); }
  void synchronize();
  const Schedule& schedule() const;
  Stats stats() const;
  void reset_stats();

private:
  // Where a block is on the device; its host bytes are the store's.
  struct BlockState {
    int64_t slot = -1;
    bool ready = false;
    bool dirty = false; // changed on the device since its last write-back
    bool evicted_by_forward = false; // the training schedule's forward evicts it
    bool forwarded = false;        // computed since prepare(), outside a recompute pass
    std::unique_ptr<Event> loaded; // recorded on the copy stream after its load
    int64_t replaced = -1;         // for debug lines: the block its load evicted
    Clock::time_point submitted;
    const Buffer* computed_in = nullptr; // the slot of its last forward: backward prefetches
  };
  struct SlotState {
    std::shared_ptr<Buffer> memory;
    int64_t block = -1;
    std::unique_ptr<Event> released; // recorded on the compute stream after its last reader
  };

  const Schedule& current() const;
  bool training() const { return options_.supports_backward && !is_forward_only_; }
  bool recompute_pass(int64_t block, Compute compute) const;
  void check_block(int64_t block) const;
  void wait_locked(int64_t block);
  int64_t slot_index(const Buffer* memory) const;
  void place(int64_t block, int64_t slot);
  int64_t victim_for(int64_t block) const;
  void prefetch_after_backward(int64_t block);
  void write_back(int64_t block);
  void commit(int64_t block);
  void wait_like_the_seed(int64_t slot);
  // `settle`: in a forward pass, where the caller may read the evicted block's tensors at once
  // (Note [write-back before the forward]).
  void move(const Move& move, bool settle);
  void evict(int64_t block, bool refilled, bool settle = false);
  void load(int64_t block, int64_t slot);
  void mark_ready(int64_t block);
  void forget_unready_loads();
  // Called in a catch block with the copy's error: rethrows it, or an Error naming the
  // write-backs it dropped.
  [[noreturn]] void copy_failed(std::exception_ptr error);
  void commit_write_backs();
  void ensure_slots(int64_t count);
  void release_empty_slots();
  void synchronize_locked();
  void collect_stalls() const;
  void log(const std::string& line) const;

  std::shared_ptr<Backend> backend_;
  EngineOptions options_;
  std::string label_;
  Schedule forward_only_;
  std::optional<Schedule> training_; // when supports_backward
  bool is_forward_only_;
  bool enabled_ = true;
  std::size_t slot_bytes_ = 0;
  HostStore store_; // every host address
  std::vector<BlockState> blocks_;
  std::vector<SlotState> slots_;
  std::unique_ptr<Event> copies_done_;
  std::vector<int64_t> backward_started_; // acquire_for_backward since prepare, moves not run
  ResidencyListener* listener_ = nullptr;
  // Where the backend times its events (a GPU, the timed device), a stall is measured on the
  // device: events on the compute stream before and after its wait for a load, read once
  // they have completed. The host does not wait there, so its own clock would see nothing.
  struct StallTimer {
    std::unique_ptr<Event> before, after;
  };
  mutable std::vector<StallTimer> stall_timers_; // recorded, not yet read
  mutable std::vector<StallTimer> spare_timers_;
  mutable Stats stats_;
  mutable std::mutex mutex_;
};

Engine::Impl::Impl(std::shared_ptr<Backend> backend, std::vector<std::size_t> block_bytes,
                   EngineOptions options, std::string label)
    : backend_(std::move(backend)), options_(std::move(options)), label_(std::move(label)),
      forward_only_(schedule_options(block_bytes.size(), options_, Mode::forward_only)),
      is_forward_only_(!options_.supports_backward),
      store_((check_backend(backend_, label_), backend_), block_bytes, options_.trainable_bytes,
             options_.host_memory, label_) {
  BLOCKSWAP_CHECK(!store_.caller_memory() || options_.algorithm != Algorithm::seed, "[", label_,
                  "] the seed's replay copies every block back to host memory, which "
                  "EngineOptions::host_memory does not allow");
  if (options_.supports_backward) {
    training_.emplace(schedule_options(block_bytes.size(), options_, Mode::training));
  }
  blocks_.resize(block_bytes.size());
  if (training_.has_value()) {
    const auto n = static_cast<int64_t>(block_bytes.size());
    for (int64_t b = 0; b < n; ++b) {
      if (training_->initial_slots()[b] < 0) blocks_[b].evicted_by_forward = true;
      for (const Move& m : training_->after_forward(b)) blocks_[m.out].evicted_by_forward = true;
    }
  }
  for (BlockState& block : blocks_) block.loaded = backend_->make_event();
  slot_bytes_ = layout::slot_bytes(block_bytes);
  copies_done_ = backend_->make_event();
  ensure_slots(current().slots());
  if (options_.trace) {
    backend_->set_copy_observer([trace = options_.trace](const CopyRecord& copy) {
      trace->add(detail::concat(copy.to_device ? "load block " : "write back block ", copy.tag),
                 Track::copy, copy.start, copy.end);
    });
  }
}

Engine::Impl::~Impl() {
  try {
    std::lock_guard lock(mutex_);
    synchronize_locked();
    if (options_.trace) backend_->set_copy_observer(nullptr);
  } catch (const std::exception& e) {
    log(detail::concat("[", label_, "] a copy failed while shutting down: ", e.what()));
  }
}

const Schedule& Engine::Impl::current() const {
  return is_forward_only_ ? forward_only_ : *training_;
}

const Schedule& Engine::Impl::schedule() const {
  std::lock_guard lock(mutex_);
  return current();
}

void Engine::Impl::check_block(int64_t block) const {
  detail::check_block_index(label_, block, blocks());
}

std::byte* Engine::Impl::host_data(int64_t block) const {
  check_block(block);
  return store_.buffer(block)->data();
}

std::shared_ptr<Buffer> Engine::Impl::host_buffer(int64_t block) const {
  check_block(block);
  return store_.buffer(block);
}

HostRegion Engine::Impl::host_trainable(int64_t block) const {
  std::lock_guard lock(mutex_);
  check_block(block);
  return store_.trainable(block);
}

std::size_t Engine::Impl::block_bytes(int64_t block) const {
  check_block(block);
  return store_.bytes(block);
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

// prepare() restores the set of blocks the schedule starts with. Which slot a block sits in
// does not matter (all slots have the same size), so a block already on the device stays
// where it is and nothing is copied in the steady state.
//
// When it has to place blocks itself (the first pass, after a mode change, disable or
// enable) it is synchronous, as the seed's is, and leaves every block ready. In the steady
// state it does not wait: the loads the last pass started for this one (forward-only
// rotation) stay in flight until wait_for_block orders compute after them, so the host never
// waits here for the previous pass's compute.
void Engine::Impl::prepare() {
  std::lock_guard lock(mutex_);
  const int64_t n = blocks();
  const std::vector<int64_t>& initial = current().initial_slots();
  const auto needed = enabled_ ? current().slots() : n;
  auto wanted = [&](int64_t b) { return !enabled_ || initial[b] >= 0; };
  ensure_slots(needed);
  bool placed = false;
  for (int64_t b = 0; b < n; ++b) {
    if (blocks_[b].slot >= 0 && !wanted(b)) {
      evict(b, false);
      placed = true;
    }
  }
  int64_t free_slot = 0;
  for (int64_t b = 0; b < n; ++b) {
    if (!wanted(b) || blocks_[b].slot >= 0) continue;
    while (slots_[free_slot].block >= 0) ++free_slot;
    load(b, free_slot);
    placed = true;
  }
  backward_started_.clear(); // a new pass starts
  for (BlockState& state : blocks_) state.forwarded = false;
  if (!placed) return;
  synchronize_locked();
  for (int64_t b = 0; b < n; ++b) {
    if (blocks_[b].slot >= 0 && !blocks_[b].ready) mark_ready(b);
  }
  if (static_cast<int64_t>(slots_.size()) > needed) release_empty_slots();
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
  const bool device_timed = !current().host_waits() && backend_->times_events();
  try {
    if (current().host_waits()) {
      backend_->synchronize(*state.loaded);
    } else if (device_timed) {
      StallTimer timer;
      if (spare_timers_.empty()) {
        timer = StallTimer{backend_->make_event(), backend_->make_event()};
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
    log(detail::concat("[", label_, "] Moved blocks ", state.replaced, " and ", block,
                       " in ", format_seconds(seconds_since(state.submitted))));
    log(detail::concat("[", label_, "] Waited for block ", block, ": ",
                       format_seconds(stalled)));
  }
}

// The recompute pass of checkpointing: a differentiable block that already ran forward in this
// pass (a block that has not is computed normally: not every block need be checkpointed).
bool Engine::Impl::recompute_pass(int64_t block, Compute compute) const {
  // Non-reentrant checkpointing recomputes blocks during backward with grad mode on, as its
  // forward ran: a block computed again once a backward has started is its recompute.
  return compute.differentiable && blocks_[block].forwarded &&
         (compute.reentrant_checkpointing || !backward_started_.empty());
}

bool Engine::Impl::recomputing(int64_t block, Compute compute) const {
  std::lock_guard lock(mutex_);
  check_block(block);
  return recompute_pass(block, compute);
}

Entered Engine::Impl::enter(int64_t block, Compute compute) {
  std::lock_guard lock(mutex_);
  check_block(block);
  if (recompute_pass(block, compute)) {
    if (blocks_[block].slot < 0) place(block, victim_for(block));
    wait_locked(block);
    return Entered{slots_[blocks_[block].slot].memory, true};
  }
  // In training, a differentiable block computed twice between two prepares is either the
  // recompute of reentrant checkpointing without that option, or a second pass without
  // prepare: the moves would follow neither. Both are named.
  BLOCKSWAP_CHECK(!(training() && compute.differentiable && blocks_[block].forwarded), "[",
                  label_, "] block ", block,
                  " runs forward a second time in this pass. If this is the recompute of "
                  "reentrant activation checkpointing, set reentrant_activation_checkpointing = "
                  "true; otherwise call prepare_block_devices_before_forward() before each pass");
  BLOCKSWAP_CHECK(blocks_[block].slot >= 0, "[", label_, "] block ", block,
                  " is not on the device; this ", current().describe(),
                  " does not place it there now (call prepare_block_devices_before_forward() "
                  "before each pass, and wait for blocks in the order they are computed)");
  wait_locked(block);
  return Entered{slots_[blocks_[block].slot].memory, false};
}

void Engine::Impl::leave(int64_t block, Compute compute) {
  std::lock_guard lock(mutex_);
  check_block(block);
  if (recompute_pass(block, compute)) return;
  BlockState& state = blocks_[block];
  BLOCKSWAP_CHECK(state.slot < 0 || state.ready, "[", label_, "] block ", block,
                  " was computed before its load was waited for: call wait_for_block(", block,
                  ") before the block's forward");
  if (state.slot >= 0) state.computed_in = slots_[state.slot].memory.get();
  state.forwarded = true;
  if (!enabled_) return;
  for (const Move& m : current().after_forward(block)) move(m, true);
}

void Engine::Impl::after_backward(int64_t block) {
  std::lock_guard lock(mutex_);
  check_block(block);
  if (!enabled_) return;
  for (const Move& m : current().after_backward(block)) move(m, false);
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

// A slot for `block`, loaded outside the schedule during backward (the recompute pass of
// checkpointing goes from the last block to the first): an empty slot, else the slot of a
// later block (its backward is done), preferring the slot `block` was last computed in, else
// the slot of the earliest block (its backward comes last).
int64_t Engine::Impl::victim_for(int64_t block) const {
  int64_t chosen = 0;
  auto score = [&](int64_t s) -> int64_t { // higher is better
    const int64_t occupant = slots_[s].block;
    if (occupant < 0) return 3 * blocks();
    if (occupant > block) return slots_[s].memory.get() == blocks_[block].computed_in
                                     ? 2 * blocks() + 1
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
void Engine::Impl::acquire_for_backward(int64_t block, const Buffer* slot) {
  std::lock_guard lock(mutex_);
  check_block(block);
  while (!backward_started_.empty() && backward_started_.back() >= block) {
    const int64_t done = backward_started_.back();
    backward_started_.pop_back();
    if (enabled_) prefetch_after_backward(done);
  }
  const int64_t s = slot_index(slot);
  BLOCKSWAP_CHECK(s >= 0, "[", label_, "] block ", block,
                  "'s backward needs the device memory its forward ran in, which this offloader "
                  "no longer has");
  place(block, s);
  wait_locked(block);
  backward_started_.push_back(block);
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

void Engine::Impl::move(const Move& m, bool settle) {
  const BlockState& out = blocks_[m.out];
  BLOCKSWAP_CHECK(out.slot >= 0, "[", label_, "] cannot move block ", m.out,
                  " off the device: it is not there. Call prepare_block_devices_before_forward() "
                  "before each pass (",
                  current().describe(), ")");
  BLOCKSWAP_CHECK(blocks_[m.in].slot < 0, "[", label_, "] cannot load block ", m.in,
                  ": it is already on the device. Call prepare_block_devices_before_forward() "
                  "before each pass (",
                  current().describe(), ")");
  if (options_.debug) {
    log(detail::concat("[", label_, "] Move block ", m.out, " to host and block ", m.in,
                       " to ", backend_->name()));
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
// for it before the next copy into the slot. The host does not wait.
void Engine::Impl::evict(int64_t block, bool refilled, bool settle) {
  BlockState& state = blocks_[block];
  SlotState& slot = slots_[state.slot];
  // Written back before (Note [write-back before the forward]) and unchanged since: the host
  // copy the tensors are bound to next must hold those bytes.
  if (store_.pending(block) && !state.dirty) commit(block);
  if (listener_ != nullptr) listener_->on_evicted(block); // may read the slot; may throw
  backend_->record(*slot.released, Stream::compute);
  backend_->wait(Stream::copy, *slot.released);
  if (state.dirty) {
    write_back(block);
  } else if (current().writes_back()) {
    // The seed replay copies back weights that did not change: the host's bytes stay the same
    // whatever part of the copy happens.
    backend_->copy_to_host(store_.buffer(block)->data(), slot.memory->data(),
                           store_.bytes(block), block);
    stats_.d2h_bytes += store_.bytes(block);
  }
  if (!refilled) backend_->poison(slot.memory->data(), slot_bytes_);
  slot.block = -1;
  state.slot = -1;
  state.ready = false;
  if (settle && store_.pending(block)) commit(block);
}

void Engine::Impl::load(int64_t block, int64_t slot) {
  BlockState& state = blocks_[block];
  SlotState& s = slots_[slot];
  if (listener_ != nullptr) listener_->before_load(block); // the host copy must be final
  BLOCKSWAP_ASSERT(s.block < 0, "slot ", slot, " still holds block ", s.block);
  const std::size_t bytes = store_.bytes(block);
  backend_->poison(s.memory->data() + bytes, slot_bytes_ - bytes);
  const HostStore::Source source = store_.load_source(block);
  if (source.contiguous()) {
    backend_->copy_to_device(s.memory->data(), source.frozen, bytes, block);
  } else {
    if (source.frozen_bytes > 0) {
      backend_->copy_to_device(s.memory->data(), source.frozen, source.frozen_bytes, block);
    }
    backend_->copy_to_device(s.memory->data() + source.frozen_bytes, source.trainable,
                             source.trainable_bytes, block);
  }
  backend_->record(*state.loaded, Stream::copy);
  stats_.h2d_bytes += bytes;
  s.block = block;
  state.slot = slot;
  state.ready = false;
  state.replaced = -1;
  state.submitted = Clock::now();
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
void Engine::Impl::write_back_early() {
  std::lock_guard lock(mutex_);
  for (int64_t b = 0; b < blocks(); ++b) {
    const BlockState& state = blocks_[b];
    if (state.slot >= 0 && state.dirty && state.evicted_by_forward) write_back(b);
  }
}

void Engine::Impl::mark_ready(int64_t block) {
  BlockState& state = blocks_[block];
  if (listener_ != nullptr) listener_->on_ready(block, slots_[state.slot].memory);
  state.ready = true;
}

// A copy failed: whatever was loading may hold garbage. Blocks not yet waited for leave the
// device; their host copies are untouched, so the next prepare() loads them again.
void Engine::Impl::forget_unready_loads() {
  for (auto& state : blocks_) {
    if (state.slot >= 0 && !state.ready) {
      slots_[state.slot].block = -1;
      state.slot = -1;
    }
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

void Engine::Impl::synchronize_locked() {
  backend_->record(*copies_done_, Stream::copy);
  try {
    backend_->synchronize(*copies_done_);
  } catch (...) {
    copy_failed(std::current_exception());
  }
  commit_write_backs();
}

void Engine::Impl::synchronize() {
  std::lock_guard lock(mutex_);
  synchronize_locked();
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

void Engine::Impl::disable() {
  std::lock_guard lock(mutex_);
  enabled_ = false;
}

void Engine::Impl::enable() {
  std::lock_guard lock(mutex_);
  enabled_ = true;
}

bool Engine::Impl::enabled() const {
  std::lock_guard lock(mutex_);
  return enabled_;
}

void Engine::Impl::set_forward_only(bool forward_only) {
  std::lock_guard lock(mutex_);
  BLOCKSWAP_CHECK(forward_only || training_.has_value(), "[", label_,
                  "] cannot leave forward-only mode: the engine was built without "
                  "supports_backward");
  is_forward_only_ = forward_only;
}

bool Engine::Impl::forward_only() const {
  std::lock_guard lock(mutex_);
  return is_forward_only_;
}

void Engine::Impl::set_listener(ResidencyListener* listener) {
  std::lock_guard lock(mutex_);
  listener_ = listener;
}

bool Engine::Impl::is_resident(int64_t block) const {
  std::lock_guard lock(mutex_);
  check_block(block);
  return blocks_[block].slot >= 0;
}

bool Engine::Impl::is_ready(int64_t block) const {
  std::lock_guard lock(mutex_);
  check_block(block);
  return blocks_[block].ready;
}

std::byte* Engine::Impl::device_data(int64_t block) const {
  return device_buffer(block)->data();
}

std::shared_ptr<Buffer> Engine::Impl::device_buffer(int64_t block) const {
  std::lock_guard lock(mutex_);
  check_block(block);
  const BlockState& state = blocks_[block];
  BLOCKSWAP_CHECK(state.ready, "[", label_, "] block ", block,
                  state.slot >= 0 ? " is still loading: call wait_for_block() before using it"
                                  : " is not on the device");
  return slots_[state.slot].memory;
}

void Engine::Impl::mark_dirty(int64_t block) {
  std::lock_guard lock(mutex_);
  check_block(block);
  BLOCKSWAP_CHECK(blocks_[block].slot >= 0, "[", label_, "] block ", block,
                  " is not on the device, so it cannot have changed there");
  BLOCKSWAP_CHECK(store_.trainable_bytes(block) > 0, "[", label_, "] block ", block,
                  " has no trainable bytes (EngineOptions::trainable_bytes), so nothing of it "
                  "may change on the device");
  blocks_[block].dirty = true;
}

// Note [host step]
// With the optimizer step on the host, a parameter's gradient is copied out on the copy stream
// (after the computation that produced it), the CPU steps the block's host copy, and the
// block's trainable bytes are loaded again into its slot if it is still there. Loads of the
// block wait until its steps are done (ResidencyListener::before_load).
std::shared_ptr<Event> Engine::Impl::copy_out(std::byte* host, const std::byte* device,
                                              std::size_t bytes, int64_t tag) {
  std::lock_guard lock(mutex_);
  std::shared_ptr<Event> computed = backend_->make_event();
  backend_->record(*computed, Stream::compute);
  backend_->wait(Stream::copy, *computed);
  backend_->copy_to_host(host, device, bytes, tag);
  stats_.d2h_bytes += bytes;
  std::shared_ptr<Event> done = backend_->make_event();
  backend_->record(*done, Stream::copy);
  return done;
}

void Engine::Impl::reload_trainable(int64_t block) {
  std::lock_guard lock(mutex_);
  check_block(block);
  BlockState& state = blocks_[block];
  const std::size_t trainable = store_.trainable_bytes(block);
  if (state.slot < 0 || trainable == 0) return;
  BLOCKSWAP_CHECK(!state.dirty && !store_.pending(block), "[", label_, "] block ", block,
                  " changed on the device and on the host at once");
  if (listener_ != nullptr) listener_->before_load(block);
  SlotState& slot = slots_[state.slot];
  backend_->record(*slot.released, Stream::compute); // after every reader of the old bytes
  backend_->wait(Stream::copy, *slot.released);
  backend_->copy_to_device(slot.memory->data() + store_.frozen_bytes(block),
                           store_.trainable(block).data(), trainable, block);
  backend_->record(*state.loaded, Stream::copy);
  stats_.h2d_bytes += trainable;
  state.ready = false; // the next enter waits for it
}

bool Engine::Impl::writing_back() const {
  std::lock_guard lock(mutex_);
  for (int64_t b = 0; b < blocks(); ++b) {
    if (store_.pending(b) && blocks_[b].slot < 0) return true;
  }
  return false;
}

Stats Engine::Impl::stats() const {
  std::lock_guard lock(mutex_);
  collect_stalls();
  return stats_;
}

void Engine::Impl::reset_stats() {
  std::lock_guard lock(mutex_);
  // Stalls still in flight belong to before the reset: their timers are reused unread.
  for (StallTimer& timer : stall_timers_) spare_timers_.push_back(std::move(timer));
  stall_timers_.clear();
  const uint64_t device_bytes = stats_.device_bytes;
  stats_ = Stats{};
  stats_.device_bytes = device_bytes;
  stats_.peak_device_bytes = device_bytes;
}

void Engine::Impl::log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    log_line(line);
  }
}

// Engine: the public face of Impl.

Engine::Engine(std::shared_ptr<Backend> backend, std::vector<std::size_t> block_bytes,
               EngineOptions options, std::string label)
    : impl_(std::make_unique<Impl>(std::move(backend), std::move(block_bytes), std::move(options),
                                   std::move(label))) {}
Engine::~Engine() = default;

int64_t Engine::blocks() const { return impl_->blocks(); }
const std::string& Engine::label() const { return impl_->label(); }
std::byte* Engine::host_data(int64_t block) const { return impl_->host_data(block); }
std::shared_ptr<Buffer> Engine::host_buffer(int64_t block) const { return impl_->host_buffer(block); }
HostRegion Engine::host_trainable(int64_t block) const { return impl_->host_trainable(block); }
std::size_t Engine::block_bytes(int64_t block) const { return impl_->block_bytes(block); }
std::size_t Engine::slot_bytes() const { return impl_->slot_bytes(); }
void Engine::prepare() { impl_->prepare(); }
Entered Engine::enter(int64_t block, Compute compute) { return impl_->enter(block, compute); }
void Engine::leave(int64_t block, Compute compute) { impl_->leave(block, compute); }
bool Engine::recomputing(int64_t block, Compute compute) const {
  return impl_->recomputing(block, compute);
}
void Engine::acquire_for_backward(int64_t block, const Buffer* slot) {
  impl_->acquire_for_backward(block, slot);
}
void Engine::after_backward(int64_t block) { impl_->after_backward(block); }
void Engine::write_back_early() { impl_->write_back_early(); }
void Engine::disable() { impl_->disable(); }
void Engine::enable() { impl_->enable(); }
bool Engine::enabled() const { return impl_->enabled(); }
void Engine::set_forward_only(bool forward_only) { impl_->set_forward_only(forward_only); }
bool Engine::forward_only() const { return impl_->forward_only(); }
void Engine::set_listener(ResidencyListener* listener) { impl_->set_listener(listener); }
bool Engine::is_resident(int64_t block) const { return impl_->is_resident(block); }
bool Engine::is_ready(int64_t block) const { return impl_->is_ready(block); }
std::byte* Engine::device_data(int64_t block) const { return impl_->device_data(block); }
std::shared_ptr<Buffer> Engine::device_buffer(int64_t block) const {
  return impl_->device_buffer(block);
}
void Engine::mark_dirty(int64_t block) { impl_->mark_dirty(block); }
bool Engine::writing_back() const { return impl_->writing_back(); }
std::shared_ptr<Event> Engine::copy_out(std::byte* host, const std::byte* device,
                                        std::size_t bytes, int64_t tag) {
  return impl_->copy_out(host, device, bytes, tag);
}
void Engine::wait(const Event& event) { impl_->wait_event(event); }
void Engine::reload_trainable(int64_t block) { impl_->reload_trainable(block); }
void Engine::synchronize() { impl_->synchronize(); }
const Schedule& Engine::schedule() const { return impl_->schedule(); }
Stats Engine::stats() const { return impl_->stats(); }
void Engine::reset_stats() { impl_->reset_stats(); }

} // namespace blockswap
