#include "blockswap/planner.hpp"

#include <algorithm>

#include "blockswap/error.hpp"

namespace blockswap {

std::size_t slot_device_bytes(std::span<const std::size_t> block_bytes, int64_t blocks_to_swap,
                              std::size_t alignment) {
  std::size_t largest = 0;
  for (std::size_t bytes : block_bytes) largest = std::max(largest, bytes);
  const std::size_t slot = (largest + alignment - 1) / alignment * alignment;
  const auto slots =
      static_cast<std::size_t>(static_cast<int64_t>(block_bytes.size()) - blocks_to_swap);
  return slots * slot;
}

int64_t plan_blocks_to_swap(std::span<const std::size_t> block_bytes, std::size_t budget_bytes,
                            Mode mode, std::size_t alignment) {
  const auto n = static_cast<int64_t>(block_bytes.size());
  BLOCKSWAP_CHECK(n >= 1, "the planner needs at least one block");
  const int64_t max_k = Schedule::max_blocks_to_swap(n, mode);
  for (int64_t k = 0; k <= max_k; ++k) {
    if (slot_device_bytes(block_bytes, k, alignment) <= budget_bytes) return k;
  }
  throw Error(detail::concat("a device budget of ", budget_bytes, " bytes cannot hold the ",
                             n - max_k, " block slot(s) that ", to_string(mode), " needs with ", n,
                             " blocks: the smallest budget that works is ",
                             slot_device_bytes(block_bytes, max_k, alignment), " bytes"));
}

} // namespace blockswap
