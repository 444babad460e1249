// The schedule simulator: what a step costs, on a virtual clock.
//
// Pure: no threads, no devices. It plays the ops of one step of one or more schedules (the
// block lists of a model, one after another on one device) the way the engine enqueues them:
// a compute stream that computes blocks in order, a copy stream (the link) that copies in order,
// a decode stream that decodes compressed loads in order (Note [a decode step] in
// load_pipeline.cpp), events between them, and, for the seed replay, a host that waits. It returns
// the step time, the stall before each block's compute and the link's busy time; step_bound() gives
// the bound T* that no execution of the schedule can beat (docs/performance.md, "The bound T*").
//
//   const blockswap::Schedule schedule({.blocks = 40, .blocks_to_swap = 20});
//   const auto result = blockswap::simulate(schedule, blockswap::uniform_timing(40, 0.01, 1e8,
//                                                                               {1e9}));
//
// The timed device (device/timed.hpp) runs the real engine on the same model of time; the
// tests hold the two to each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "blockswap/core/schedule.hpp"

namespace blockswap {

// The link between host and device: a copy of `bytes` occupies it for latency + bytes / B.
// The file tier's disk is a second link in series (DESIGN.md, "Tiers"): a block read from the
// file goes disk -> a staging buffer (one of `staging_buffers`, in turn) -> the link. Reads run
// ahead of the copies in load order, as far as free staging buffers allow; a buffer is free
// again when the copy out of it ends.
struct LinkModel {
  double bytes_per_second = 25e9;   // B (PCIe 4, pinned, measured: DESIGN.md section 6)
  double latency_seconds = 0;       // per copy
  double disk_bytes_per_second = 0; // D, the disk's read bandwidth (needed by file-tier blocks)
  int staging_buffers = 2;          // the file tier's ring
  // Offloaded activations (BlockTiming::activation_bytes) go out on a device->host channel of
  // their own beside the host->device one, as PCIe's two copy engines; false: one channel for
  // both ways. They come back on the host->device channel, in series with the weights' loads.
  bool duplex = true;
  // Compressed weights (BlockTiming::compressed_bytes): the device decodes a load's bytes at
  // this rate (decoded bytes per second), on a decode stream of its own after the load's copy,
  // so that it overlaps the next load's copy (Note [a decode step] in load_pipeline.cpp);
  // 0: decoding takes no time.
  double decode_bytes_per_second = 0;
  // false: the decodes run on the copy stream, in series with the copies (a backend without a
  // decode stream of its own; blockswap before its decode stream, for comparison).
  bool decode_stream = true;
  double seconds(std::size_t bytes) const;
  double disk_seconds(std::size_t bytes) const;
  double decode_seconds(std::size_t decoded_bytes) const;
};

// What each block of one list costs.
struct BlockTiming {
  std::vector<double> forward_seconds; // per block
  std::vector<std::size_t> bytes;      // per block: what one load moves
  double backward_factor = 2.0;        // a block's backward takes this multiple of its forward
  std::vector<bool> from_file;         // per block: read from the file for each load (empty: none)
  // Training with activation offloading (empty: none): per block, the bytes its forward saves
  // for backward that go to host memory. They go out when the next block's forward starts
  // (the block computed last keeps its own) and come back when the backward of the block
  // computed after it in the forward starts; a block's backward waits for its own.
  std::vector<std::size_t> activation_bytes;
  // Compressed weights (EngineOptions::compress; empty: none): per block, the bytes a load from
  // host memory moves over the link, its frozen bytes compressed; its `bytes` are then decoded
  // on the device (LinkModel::decode_bytes_per_second). A load from the file moves `bytes`
  // (the file tier stays raw).
  std::vector<std::size_t> compressed_bytes = {};
};

// N blocks alike: `forward_seconds` each, `bytes` each.
BlockTiming uniform_timing(int64_t blocks, double forward_seconds, std::size_t bytes,
                           double backward_factor = 2.0);

// One block list of a model: its schedule and its blocks' costs.
struct SimulatedList {
  const Schedule* schedule = nullptr;
  const BlockTiming* timing = nullptr;
};

struct ListSimulation {
  std::vector<double> forward_stall_seconds;  // per block: compute idle before its forward
  std::vector<double> backward_stall_seconds; // per block (training; zeros otherwise)
};

// Forward-only, a step is one pass of a sequence of passes (a denoising loop): the loads a pass
// starts for the next one overlap the next one's first blocks, and a link slower than the
// compute builds a backlog over several passes. The simulator plays passes in chunks of
// kPassesPerChunk until a chunk ends in the state the previous one ended in (relative to the
// compute stream: the steady state), at most kMaxPasses, and reports the mean pass of the last
// chunk; time_step() on the timed device plays the same passes.
inline constexpr int kPassesPerChunk = 6;
inline constexpr int kMaxPasses = 1200;
// Training with the file tier, whose reader reads the next step's first loads during the
// backward: steps are played in sequence until one ends in the state the one before ended in,
// at most kMaxTrainingSteps, and the last is reported. Without it every step starts from the
// same state, and one step is played.
inline constexpr int kMaxTrainingSteps = 64;

struct Simulation {
  // Training: one step from the steady state (every block the schedule starts with is loaded;
  // with the file tier, the reads the step before started ahead go on) to the end of its last
  // backward, when nothing is in flight. Forward-only: one pass in the steady state of a
  // sequence, from the end of the previous pass's last computation to the end of its own.
  double step_seconds = 0;
  double compute_seconds = 0;     // the compute stream busy, per step
  double stall_seconds = 0;       // the compute stream idle before a block, per step
  double link_busy_seconds = 0;   // the copy stream busy (loads, write-backs), per step
  double decode_busy_seconds = 0; // the decode stream busy (compressed weights), per step
  double disk_busy_seconds = 0;   // the disk busy reading file-tier blocks, per step
  double d2h_busy_seconds = 0;    // the device->host channel busy with activations, per step
  std::vector<ListSimulation> lists;
  // Forward-only: the passes played before the measured chunk of kPassesPerChunk, and whether
  // the state repeated within kMaxPasses (when it did not, a backlog on the link still grew,
  // and step_seconds is the larger of the last chunk's mean and the link's time per pass).
  // Training: the steps played before the measured one (0 without the file tier), and whether
  // the state repeated within kMaxTrainingSteps.
  int warmup_passes = 0;
  bool steady = true;
};

// One step of `lists` on one device: every list's forward in the order given, then (training)
// every list's backward in the reverse order. The lists must all be in the same mode.
// Throws Error when a list's timing does not have one entry per block, or a time is negative.
Simulation simulate(std::span<const SimulatedList> lists, const LinkModel& link);
Simulation simulate(const Schedule& schedule, const BlockTiming& timing, const LinkModel& link);
// A pipeline stage's step (Note [halves in the simulator]): its micro-batches' halves in the
// order given (pipeline_halves in core/schedule.hpp), from the steady state, each forward every
// list's in order, each backward every list's in reverse, as time_halves plays them on the
// timed device. Training lists only; throws Error for offloaded activations or the file tier.
Simulation simulate_halves(std::span<const SimulatedList> lists, std::span<const Op::Kind> halves,
                           const LinkModel& link);

// T*: the bound that no execution of these schedules can beat, the largest of
//   - the compute: every forward (and backward) of a step, one after another;
//   - the link: every copy of a step, one after another;
//   - the slots: a slot computes one block at a time, and a load into it starts only after its
//     last occupant's compute and ends before the next one's, so the loads and computes of the
//     blocks that pass through one slot add up. Training: the slot with the most of them in a
//     step. Forward-only: the R rotating slots share the K+R rotating blocks, so one of them
//     carries at least (sum of c + l over those blocks) / R per pass; and some slot holds
//     q = ceil((K+R)/R) of them in every pass, whose q computes and q-1 loads run while the
//     compute stream runs nothing but that list's blocks between them, every other block of
//     the pass (other lists' too) computing outside that stretch;
//   - the halves (training): in each half of the step (forward, backward) the first load starts
//     after the computes before its move, the loads follow one another, and the block loaded
//     last computes after its load, then the rest of the half; every list's halves are
//     disjoint stretches of the compute stream, so these add up over halves and lists.
//   - the disk: every read of a file-tier block in a step, one after another; the staging ring:
//     a read holds one of a list's Q buffers until its copy ends, so the list's reads and their
//     copies, over Q; and in each half of a training step, at most Q of the half's reads are
//     done or under way when it starts, the others follow one another (the first of them after
//     the half's first copy from the file when Q are), then the half's last load and the
//     computes from its block on.
// Offloaded activations add their copies back to the link term and, duplex, make a second
// term of their copies out (one channel: both to the link term). Compressed loads
// (BlockTiming::compressed_bytes) count their compressed bytes in the link term and make a
// decode term of their decodes, one after another on the decode stream (without one,
// LinkModel::decode_stream false, the decodes add to the link term); a slot's load is its copy
// then its decode; a half's last load ends after the half's copies and its own decode, and,
// decoded, after the half's decodes too.
// With one slot nothing overlaps: N·(c + l). docs/performance.md states it in full.
double step_bound(std::span<const SimulatedList> lists, const LinkModel& link);
double step_bound(const Schedule& schedule, const BlockTiming& timing, const LinkModel& link);

} // namespace blockswap
