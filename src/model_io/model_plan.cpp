#include "blockswap/model_io/model_plan.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>

#include "blockswap/core/error.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/model_io/size.hpp"

namespace blockswap {
namespace {

bool is_block_list(std::string_view part) {
  return part == "blocks" || part == "layers" || part == "h" ||
         (part.size() > 7 && part.substr(part.size() - 7) == "_blocks") ||
         (part.size() > 7 && part.substr(part.size() - 7) == "_layers");
}

bool is_index(std::string_view part) {
  return !part.empty() && part.size() < 10 &&
         std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
}

} // namespace

uint64_t BlockGroup::total_bytes() const {
  uint64_t total = 0;
  for (uint64_t b : block_bytes) total += b;
  return total;
}

uint64_t BlockGroup::largest_bytes() const {
  return block_bytes.empty() ? 0 : *std::max_element(block_bytes.begin(), block_bytes.end());
}

ModelLayout group_blocks(const std::vector<TensorInfo>& tensors) {
  ModelLayout layout;
  std::map<std::string, std::map<int64_t, uint64_t>> groups;   // prefix -> index -> bytes
  std::map<std::string, std::map<int64_t, uint64_t>> elements; // prefix -> index -> elements
  std::vector<std::string> order;
  for (const TensorInfo& t : tensors) {
    std::vector<std::string_view> parts;
    std::string_view rest = t.name;
    for (std::size_t dot; (dot = rest.find('.')) != std::string_view::npos;
         rest.remove_prefix(dot + 1)) {
      parts.push_back(rest.substr(0, dot));
    }
    parts.push_back(rest);
    bool grouped = false;
    for (std::size_t i = 0; i + 2 < parts.size() && !grouped; ++i) {
      if (!is_block_list(parts[i]) || !is_index(parts[i + 1])) continue;
      const std::string prefix(t.name.substr(
          0, static_cast<std::size_t>(parts[i].data() - t.name.data()) + parts[i].size()));
      if (!groups.contains(prefix)) order.push_back(prefix);
      const int64_t index = std::stoll(std::string(parts[i + 1]));
      groups[prefix][index] += t.bytes();
      uint64_t count = 1;
      for (int64_t d : t.shape) count *= static_cast<uint64_t>(d);
      elements[prefix][index] += count;
      grouped = true;
    }
    if (!grouped) layout.non_block_bytes += t.bytes();
  }
  for (const std::string& name : order) {
    BlockGroup group{name, {}, {}};
    for (const auto& [index, bytes] : groups[name]) group.block_bytes.push_back(bytes);
    for (const auto& [index, count] : elements[name]) group.block_elements.push_back(count);
    layout.groups.push_back(std::move(group));
  }
  return layout;
}

std::vector<std::vector<std::size_t>> block_lists(const ModelLayout& layout) {
  std::vector<std::vector<std::size_t>> lists;
  for (const BlockGroup& group : layout.groups) {
    lists.emplace_back(group.block_bytes.begin(), group.block_bytes.end());
  }
  return lists;
}

namespace {

ModelPlan to_model_plan(const ModelLayout& layout,
                        const std::vector<std::vector<std::size_t>>& lists, const SwapPlan& swaps,
                        uint64_t budget_bytes, Mode mode) {
  ModelPlan plan{mode, budget_bytes, layout.non_block_bytes, swaps.device_bytes, swaps.moved_bytes,
                 {}};
  for (std::size_t i = 0; i < lists.size(); ++i) {
    const BlockGroup& group = layout.groups[i];
    const ListPlan& list = swaps.lists[i];
    plan.groups.push_back(GroupPlan{group.name, static_cast<int64_t>(lists[i].size()),
                                    layout::slot_bytes(lists[i]), group.total_bytes(),
                                    list.blocks_to_swap, list.device_bytes, list.moved_bytes});
  }
  return plan;
}

} // namespace

ModelPlan plan_model(const ModelLayout& layout, uint64_t budget_bytes, Mode mode) {
  BLOCKSWAP_CHECK(!layout.groups.empty(),
                  "no blocks found: tensor names must look like blocks.N.…, double_blocks.N.…, "
                  "single_blocks.N.… or layers.N.…");
  const std::vector<std::vector<std::size_t>> lists = block_lists(layout);
  const uint64_t smallest = smallest_budget(lists, mode, layout.non_block_bytes);
  BLOCKSWAP_CHECK(budget_bytes >= smallest, "a device budget of ", format_bytes(budget_bytes), " (",
                  budget_bytes, " bytes) cannot hold this model in ", to_string(mode),
                  " mode: the smallest budget that works is ", format_bytes(smallest), " (",
                  smallest, " bytes)");
  const SwapPlan swaps = plan_swaps(lists, budget_bytes, mode, layout.non_block_bytes);
  return to_model_plan(layout, lists, swaps, budget_bytes, mode);
}

ModelPlan plan_model(const ModelLayout& layout, uint64_t budget_bytes, Mode mode,
                     std::span<const int64_t> blocks_to_swap) {
  const std::vector<std::vector<std::size_t>> lists = block_lists(layout);
  const SwapPlan swaps = plan_for(lists, blocks_to_swap, mode, layout.non_block_bytes);
  BLOCKSWAP_CHECK(swaps.device_bytes <= budget_bytes, "the plan's ", swaps.device_bytes,
                  " device bytes do not fit the budget of ", budget_bytes, " bytes");
  return to_model_plan(layout, lists, swaps, budget_bytes, mode);
}

} // namespace blockswap
