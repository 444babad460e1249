// Engine::Impl: the engine's state and the steps its verbs share, for engine.cpp and
// engine_training.cpp. Private to src/core.
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
    std::unique_ptr<Event> loaded;   // recorded on the copy stream after its load
    int64_t replaced = -1;           // for debug lines: the block its load evicted
    Clock::time_point submitted;
    const Buffer* computed_in = nullptr; // the slot of its last forward: backward prefetches
    StagingReader::Staged read;          // its load's read from the file, not yet waited for
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
  // Loads through the staging ring: the file tier, pageable host memory (engine_staging.cpp).
  static constexpr int64_t kPageableStaging = 2; // the ring, without a file tier's own count
  void start_staging();
  void plan_reads();                                     // the current schedule's order
  void expect_loads(const std::vector<int64_t>& blocks); // prepare's, in its order
  // Note [pageable host memory]: a new pass; copies ahead around `evicted` leaving the device.
  void restart_reads();
  bool hold_reads(int64_t evicted); // true: resume_reads() after the eviction
  void resume_reads();
  void load_staged(int64_t block, std::byte* slot);
  // `wait`: the host waits for the read; else the copy stream will (Note [the file tier]).
  StagingReader::Staged take_from_file(int64_t block, bool wait);
  void finish_read(int64_t block); // before the block is ready: its read's failure, if any
  void read_ahead();
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
  std::vector<int64_t> priority_; // host memory's (core/planner.hpp, host_priority)
  HostStore store_;               // every host address
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
  std::size_t staging_depth_ = 0;   // the file tier's staging buffers: read-ahead's depth
  std::vector<bool> staged_;        // per block: loaded through the staging ring
  bool stages_memory_ = false;      // some of them from pageable host memory
  std::vector<int64_t> file_order_; // the staged blocks a pass of the current schedule loads
  std::size_t file_cursor_ = 0;     // the next of them to request
  std::deque<int64_t> file_ahead_;  // requested from the reader, not yet taken
  std::unique_ptr<StagingReader> reader_;
};

} // namespace blockswap
