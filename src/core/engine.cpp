#include "blockswap/engine.hpp"

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "blockswap/error.hpp"

namespace blockswap {
namespace {

using Clock = std::chrono::steady_clock;
// Slots are rounded up as the planner assumes (planner.hpp), and as cudaMalloc aligns.
constexpr std::size_t kSlotAlignment = 256;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string format_seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2fs", seconds);
  return text;
}

ScheduleOptions schedule_options(std::size_t blocks, const EngineOptions& options, Mode mode) {
  return ScheduleOptions{static_cast<int64_t>(blocks), options.blocks_to_swap, mode,
                         options.rotating_slots, options.algorithm};
}

} // namespace

Engine::Engine(std::shared_ptr<Backend> backend, std::vector<std::size_t> block_bytes,
               EngineOptions options)
    : backend_(std::move(backend)), options_(std::move(options)),
      forward_only_(schedule_options(block_bytes.size(), options_, Mode::forward_only)),
      is_forward_only_(!options_.supports_backward) {
  BLOCKSWAP_CHECK(backend_ != nullptr, "[", options_.label, "] the engine needs a backend");
  if (options_.supports_backward) {
    training_.emplace(schedule_options(block_bytes.size(), options_, Mode::training));
  }
  blocks_.resize(block_bytes.size());
  for (std::size_t i = 0; i < block_bytes.size(); ++i) {
    BlockState& block = blocks_[i];
    block.bytes = block_bytes[i];
    block.host = std::make_shared<Buffer>(backend_->allocate_host(block.bytes));
    block.loaded = backend_->make_event();
    slot_bytes_ = std::max(slot_bytes_, block.bytes);
  }
  slot_bytes_ = (slot_bytes_ + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  copies_done_ = backend_->make_event();
  ensure_slots(current().slots());
  if (options_.trace) {
    backend_->set_copy_observer([trace = options_.trace](const CopyRecord& copy) {
      trace->add(detail::concat(copy.to_device ? "load block " : "write back block ", copy.tag),
                 Track::copy, copy.start, copy.end);
    });
  }
}

Engine::~Engine() {
  try {
    std::lock_guard lock(mutex_);
    synchronize_locked();
    if (options_.trace) backend_->set_copy_observer(nullptr);
  } catch (const std::exception& e) {
    log(detail::concat("[", options_.label, "] a copy failed while shutting down: ", e.what()));
  }
}

const Schedule& Engine::current() const {
  return is_forward_only_ ? forward_only_ : *training_;
}

const Schedule& Engine::schedule() const {
  std::lock_guard lock(mutex_);
  return current();
}

void Engine::check_block(int64_t block) const {
  BLOCKSWAP_CHECK(block >= 0 && block < blocks(), "[", options_.label, "] block index ", block,
                  " is out of range for ", blocks(), " blocks");
}

std::byte* Engine::host_data(int64_t block) const {
  check_block(block);
  return blocks_[block].host->data();
}

std::shared_ptr<Buffer> Engine::host_buffer(int64_t block) const {
  check_block(block);
  return blocks_[block].host;
}

std::size_t Engine::block_bytes(int64_t block) const {
  check_block(block);
  return blocks_[block].bytes;
}

void Engine::ensure_slots(int64_t count) {
  while (static_cast<int64_t>(slots_.size()) < count) {
    SlotState slot;
    slot.memory = backend_->allocate_device(slot_bytes_);
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
void Engine::prepare() {
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
  if (!placed) return;
  synchronize_locked();
  for (int64_t b = 0; b < n; ++b) {
    if (blocks_[b].slot >= 0 && !blocks_[b].ready) mark_ready(b);
  }
  if (static_cast<int64_t>(slots_.size()) > needed) release_empty_slots();
}

// Frees the slots added while swapping was disabled. Called with no copy in flight.
void Engine::release_empty_slots() {
  std::vector<SlotState> kept;
  for (SlotState& slot : slots_) {
    if (slot.block < 0) {
      stats_.device_bytes -= slot_bytes_;
      continue;
    }
    blocks_[slot.block].slot = static_cast<int64_t>(kept.size());
    kept.push_back(std::move(slot));
  }
  slots_ = std::move(kept);
}

void Engine::wait_for_block(int64_t block) {
  std::lock_guard lock(mutex_);
  check_block(block);
  BlockState& state = blocks_[block];
  BLOCKSWAP_CHECK(state.slot >= 0, "[", options_.label, "] block ", block,
                  " is not on the device; this ", current().describe(),
                  " does not place it there now (call prepare_block_devices_before_forward() "
                  "before each pass, and wait for blocks in the order they are computed)");
  if (state.ready) return;
  const auto start = Clock::now();
  try {
    if (current().host_waits()) {
      backend_->synchronize(*state.loaded);
    } else {
      backend_->wait(Stream::compute, *state.loaded);
    }
  } catch (...) {
    forget_unready_loads();
    throw;
  }
  const double stalled = seconds_since(start);
  stats_.stall_seconds += stalled;
  if (options_.trace && stalled > 0) {
    options_.trace->add(detail::concat("wait block ", block), Track::compute, start, Clock::now());
  }
  mark_ready(block);
  if (options_.debug && state.replaced >= 0) {
    log(detail::concat("[", options_.label, "] Moved blocks ", state.replaced, " and ", block,
                       " in ", format_seconds(seconds_since(state.submitted))));
    log(detail::concat("[", options_.label, "] Waited for block ", block, ": ",
                       format_seconds(stalled)));
  }
}

void Engine::after_forward(int64_t block) {
  std::lock_guard lock(mutex_);
  check_block(block);
  if (!enabled_) return;
  for (const Move& m : current().after_forward(block)) move(m);
}

void Engine::after_backward(int64_t block) {
  std::lock_guard lock(mutex_);
  check_block(block);
  if (!enabled_) return;
  for (const Move& m : current().after_backward(block)) move(m);
}

void Engine::move(const Move& m) {
  const BlockState& out = blocks_[m.out];
  BLOCKSWAP_CHECK(out.slot >= 0, "[", options_.label, "] cannot move block ", m.out,
                  " off the device: it is not there. Call prepare_block_devices_before_forward() "
                  "before each pass (",
                  current().describe(), ")");
  BLOCKSWAP_CHECK(blocks_[m.in].slot < 0, "[", options_.label, "] cannot load block ", m.in,
                  ": it is already on the device. Call prepare_block_devices_before_forward() "
                  "before each pass (",
                  current().describe(), ")");
  if (options_.debug) {
    log(detail::concat("[", options_.label, "] Move block ", m.out, " to host and block ", m.in,
                       " to ", backend_->name()));
  }
  const int64_t slot = out.slot;
  if (current().host_waits()) {
    // The seed synchronises the whole device before each move.
    SlotState& s = slots_[slot];
    backend_->record(*s.released, Stream::compute);
    backend_->synchronize(*s.released);
  }
  evict(m.out, true);
  load(m.in, slot);
  blocks_[m.in].replaced = m.out;
  ++stats_.moves;
}

// Note [slot reuse]
// A slot may be overwritten only after every computation that reads it has finished on the
// device. Eviction happens right after the caller has enqueued the block's last computation, so
// an event recorded on the compute stream now follows every reader, and the copy stream waits
// for it before the next copy into the slot. The host does not wait.
void Engine::evict(int64_t block, bool refilled) {
  BlockState& state = blocks_[block];
  SlotState& slot = slots_[state.slot];
  backend_->record(*slot.released, Stream::compute);
  backend_->wait(Stream::copy, *slot.released);
  if (state.dirty || current().writes_back()) {
    backend_->copy_to_host(state.host->data(), slot.memory.data(), state.bytes, block);
    stats_.d2h_bytes += state.bytes;
    state.dirty = false;
  }
  if (!refilled) backend_->poison(slot.memory.data(), slot_bytes_);
  if (listener_ != nullptr) listener_->on_evicted(block);
  slot.block = -1;
  state.slot = -1;
  state.ready = false;
}

void Engine::load(int64_t block, int64_t slot) {
  BlockState& state = blocks_[block];
  SlotState& s = slots_[slot];
  BLOCKSWAP_ASSERT(s.block < 0, "slot ", slot, " still holds block ", s.block);
  backend_->poison(s.memory.data() + state.bytes, slot_bytes_ - state.bytes);
  backend_->copy_to_device(s.memory.data(), state.host->data(), state.bytes, block);
  backend_->record(*state.loaded, Stream::copy);
  stats_.h2d_bytes += state.bytes;
  s.block = block;
  state.slot = slot;
  state.ready = false;
  state.replaced = -1;
  state.submitted = Clock::now();
}

void Engine::mark_ready(int64_t block) {
  BlockState& state = blocks_[block];
  state.ready = true;
  if (listener_ != nullptr) listener_->on_ready(block, slots_[state.slot].memory.data());
}

// A copy failed: whatever was loading may hold garbage. Blocks not yet waited for leave the
// device; their host copies are untouched, so the next prepare() loads them again.
void Engine::forget_unready_loads() {
  for (auto& state : blocks_) {
    if (state.slot >= 0 && !state.ready) {
      slots_[state.slot].block = -1;
      state.slot = -1;
    }
  }
}

void Engine::synchronize_locked() {
  backend_->record(*copies_done_, Stream::copy);
  try {
    backend_->synchronize(*copies_done_);
  } catch (...) {
    forget_unready_loads();
    throw;
  }
}

void Engine::synchronize() {
  std::lock_guard lock(mutex_);
  synchronize_locked();
}

void Engine::disable() {
  std::lock_guard lock(mutex_);
  enabled_ = false;
}

void Engine::enable() {
  std::lock_guard lock(mutex_);
  enabled_ = true;
}

bool Engine::enabled() const {
  std::lock_guard lock(mutex_);
  return enabled_;
}

void Engine::set_forward_only(bool forward_only) {
  std::lock_guard lock(mutex_);
  BLOCKSWAP_CHECK(forward_only || training_.has_value(), "[", options_.label,
                  "] cannot leave forward-only mode: the engine was built without "
                  "supports_backward");
  is_forward_only_ = forward_only;
}

bool Engine::forward_only() const {
  std::lock_guard lock(mutex_);
  return is_forward_only_;
}

void Engine::set_listener(ResidencyListener* listener) {
  std::lock_guard lock(mutex_);
  listener_ = listener;
}

bool Engine::is_resident(int64_t block) const {
  std::lock_guard lock(mutex_);
  check_block(block);
  return blocks_[block].slot >= 0;
}

bool Engine::is_ready(int64_t block) const {
  std::lock_guard lock(mutex_);
  check_block(block);
  return blocks_[block].ready;
}

std::byte* Engine::device_data(int64_t block) const {
  std::lock_guard lock(mutex_);
  check_block(block);
  const BlockState& state = blocks_[block];
  BLOCKSWAP_CHECK(state.ready, "[", options_.label, "] block ", block,
                  state.slot >= 0 ? " is still loading: call wait_for_block() before using it"
                                  : " is not on the device");
  return slots_[state.slot].memory.data();
}

void Engine::mark_dirty(int64_t block) {
  std::lock_guard lock(mutex_);
  check_block(block);
  BLOCKSWAP_CHECK(blocks_[block].slot >= 0, "[", options_.label, "] block ", block,
                  " is not on the device, so it cannot have changed there");
  blocks_[block].dirty = true;
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void Engine::reset_stats() {
  std::lock_guard lock(mutex_);
  const uint64_t device_bytes = stats_.device_bytes;
  stats_ = EngineStats{};
  stats_.device_bytes = device_bytes;
  stats_.peak_device_bytes = device_bytes;
}

void Engine::log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::cerr << line << '\n';
  }
}

} // namespace blockswap
