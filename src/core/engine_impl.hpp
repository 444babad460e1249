// Engine::Impl: the engine's state and the steps its verbs share, for engine.cpp,
// engine_residency.cpp and engine_training.cpp. Private to src/core.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/host_store.hpp"
#include "blockswap/core/load_pipeline.hpp"

namespace blockswap {

// The engine's state and the steps its verbs share; the verbs are Engine's own (below), each
// taking the lock once.
struct Engine::Impl {
  using Clock = std::chrono::steady_clock;

  Impl(std::shared_ptr<Backend> backend, std::vector<std::size_t> block_bytes,
       EngineOptions options, std::string label);
  ~Impl();

  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }

  // Where a block is on the device; its host bytes are the store's.
  struct BlockState {
    int64_t slot = -1;
    bool ready = false;
    bool dirty = false;              // changed on the device since its last write-back
    bool evicted_by_forward = false; // the training schedule's forward evicts it
    bool forwarded = false;          // computed since prepare(), outside a recompute pass
    std::unique_ptr<Event> loaded;   // recorded where its load ends (LoadPipeline::copy_into)
    int64_t replaced = -1;           // for debug lines: the block its load evicted
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
  void prefetch_backward_start(int64_t block); // Note [a backward after a backward]
  void write_back(int64_t block);
  void commit(int64_t block);
  void wait_like_the_seed(int64_t slot);
  // `settle`: in a forward pass, where the caller may read the evicted block's tensors at once
  // (Note [write-back before the forward]).
  void move(const Move& move, bool settle);
  void evict(int64_t block, bool refilled, bool settle = false);
  void load(int64_t block, int64_t slot);
  // Before the block is ready: its read from the file done, or the failure raised.
  void finish_load(int64_t block);
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
  void compress_once(); // Engine::compress

  std::shared_ptr<Backend> backend_;
  EngineOptions options_;
  std::string label_;
  Schedule forward_only_;
  std::optional<Schedule> training_; // when supports_backward
  bool is_forward_only_;
  bool switched_since_prepare_ = false; // set_forward_only changed the mode after prepare()
  bool enabled_ = true;
  bool compressed_ = false;   // compress_once has run
  int64_t encoded_again_ = 0; // CompressionStats::encoded_again
  std::size_t slot_bytes_ = 0;
  std::vector<int64_t> priority_; // host memory's (core/planner.hpp, host_priority)
  HostStore store_;               // every host address
  LoadPipeline loads_;            // every load (core/load_pipeline.hpp)
  std::vector<BlockState> blocks_;
  std::vector<SlotState> slots_;
  std::unique_ptr<Event> copies_done_, decodes_done_; // synchronize_locked's
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
  // Recursive: a listener, called with it held, may replace a block's frozen bytes
  // (Engine::replace_frozen).
  mutable std::recursive_mutex mutex_;
};

} // namespace blockswap
