// The facts of the device layout, in one place: how big a slot is, how many slots a schedule
// uses, and how many blocks a pass loads. The engine allocates by them, the planners plan by
// them and the front end packs by them, so that a plan's bytes are the bytes allocated.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "blockswap/core/schedule.hpp"

namespace blockswap::layout {

// Every slot, and every tensor packed inside a block, starts at a multiple of this: what
// cudaMalloc guarantees, enough for every dtype and vector load.
inline constexpr std::size_t kAlignment = 256;

constexpr std::size_t align_up(std::size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// One slot holds any block: the largest block, aligned.
constexpr std::size_t slot_bytes(std::span<const std::size_t> block_bytes) {
  std::size_t largest = 0;
  for (std::size_t bytes : block_bytes) largest = std::max(largest, bytes);
  return align_up(largest);
}

// Slots for N blocks with K swapped, in either mode: N-K (the rotating slots of forward-only
// are among them).
constexpr int64_t slot_count(int64_t blocks, int64_t blocks_to_swap) {
  return blocks - blocks_to_swap;
}

// Device bytes of the slots for N blocks (their sizes) with K swapped.
constexpr std::size_t slot_device_bytes(std::span<const std::size_t> block_bytes,
                                        int64_t blocks_to_swap) {
  return static_cast<std::size_t>(
             slot_count(static_cast<int64_t>(block_bytes.size()), blocks_to_swap)) *
         slot_bytes(block_bytes);
}

// Forward-only, the rotating slots R when none is asked for: two, so that one block loads while
// the other computes, or N-K when fewer slots are free.
constexpr int64_t default_rotating_slots(int64_t blocks, int64_t blocks_to_swap) {
  return std::min<int64_t>(2, blocks - blocks_to_swap);
}

// Blocks loaded from host memory per pass (forward-only, R rotating slots: K+R) or per step
// (training: K in forward, K in backward). Nothing moves when K = 0.
constexpr int64_t loads_per_pass(int64_t blocks_to_swap, Mode mode, int64_t rotating_slots) {
  if (blocks_to_swap == 0) return 0;
  return mode == Mode::training ? 2 * blocks_to_swap : blocks_to_swap + rotating_slots;
}

} // namespace blockswap::layout
