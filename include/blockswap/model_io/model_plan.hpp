// Planning a real model: group a safetensors file's tensors into blocks, and choose per group
// how many blocks to swap so that the device weights fit a budget. Used by `blockswap plan`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "blockswap/core/schedule.hpp"
#include "blockswap/model_io/safetensors.hpp"
#include "blockswap/model_io/size.hpp"

namespace blockswap {

struct BlockGroup {
  std::string name;                     // the name prefix: "double_blocks", "model.layers"
  std::vector<uint64_t> block_bytes;    // by block index order
  std::vector<uint64_t> block_elements; // parameters (tensor elements), by block
  uint64_t total_bytes() const;
  uint64_t largest_bytes() const;
};

struct ModelLayout {
  uint64_t non_block_bytes = 0; // everything outside the groups: always on the device
  std::vector<BlockGroup> groups;
};

// Groups tensors named `<prefix>.<blocks|double_blocks|single_blocks|layers|...>.<index>.…`.
ModelLayout group_blocks(const std::vector<TensorInfo>& tensors);

struct GroupPlan {
  std::string name;
  int64_t blocks = 0;
  uint64_t block_bytes = 0; // the largest block: the size of each slot (core/layout.hpp)
  uint64_t total_bytes = 0;
  int64_t blocks_to_swap = 0;
  uint64_t device_bytes = 0; // its slots
  uint64_t moved_bytes = 0;  // host-to-device bytes per step (training) or pass (inference)
};

struct ModelPlan {
  Mode mode = Mode::training;
  uint64_t budget_bytes = 0;
  uint64_t non_block_bytes = 0;
  uint64_t device_bytes = 0; // non-block bytes plus every group's slots
  uint64_t moved_bytes = 0;
  std::vector<GroupPlan> groups;
};

// The per-group K that fits `budget_bytes` and moves the fewest bytes per step. Throws Error
// with the smallest budget that works when none fits, or when there are no groups.
ModelPlan plan_model(const ModelLayout& layout, uint64_t budget_bytes, Mode mode);
// The plan with the given K per group (for choosing among planner::budget_frontier's plans).
ModelPlan plan_model(const ModelLayout& layout, uint64_t budget_bytes, Mode mode,
                     std::span<const int64_t> blocks_to_swap);
// The groups' block sizes as the planner's lists.
std::vector<std::vector<std::size_t>> block_lists(const ModelLayout& layout);

} // namespace blockswap
