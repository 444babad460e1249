// The planner: how many blocks to swap so that the device weights fit a budget.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "blockswap/schedule.hpp"

namespace blockswap {

// Device bytes of the slots for N blocks with K swapped: N-K slots, each the size of the
// largest block (rounded up to `alignment`).
std::size_t slot_device_bytes(std::span<const std::size_t> block_bytes, int64_t blocks_to_swap,
                              std::size_t alignment = 256);

// The smallest valid K whose slots fit in `budget_bytes`. Throws Error naming the smallest
// budget that works when even the largest valid K does not fit.
int64_t plan_blocks_to_swap(std::span<const std::size_t> block_bytes, std::size_t budget_bytes,
                            Mode mode, std::size_t alignment = 256);

} // namespace blockswap
