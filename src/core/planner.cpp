#include "blockswap/core/planner.hpp"

#include <limits>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

struct ListFacts {
  std::size_t slot_bytes = 0;
  int64_t max_k = 0;
  std::vector<std::size_t> moved; // bytes moved per step, by K
};

// Bytes moved per step for each valid K, from the schedule itself.
ListFacts facts(const std::vector<std::size_t>& blocks, Mode mode) {
  const auto n = static_cast<int64_t>(blocks.size());
  BLOCKSWAP_CHECK(n >= 1, "the planner needs at least one block in every list");
  std::size_t total = 0;
  for (std::size_t bytes : blocks) total += bytes;
  ListFacts f{layout::slot_bytes(blocks), Schedule::max_blocks_to_swap(n, mode), {}};
  for (int64_t k = 0; k <= f.max_k; ++k) {
    const Schedule schedule(ScheduleOptions{n, k, mode});
    f.moved.push_back(static_cast<std::size_t>(schedule.loads_per_pass()) * (total / blocks.size()));
  }
  return f;
}

} // namespace

std::size_t smallest_budget(std::span<const std::vector<std::size_t>> lists, Mode mode,
                            std::size_t fixed_bytes) {
  std::size_t smallest = fixed_bytes;
  for (const auto& list : lists) {
    const auto n = static_cast<int64_t>(list.size());
    smallest += layout::slot_device_bytes(list, Schedule::max_blocks_to_swap(n, mode));
  }
  return smallest;
}

SwapPlan plan_swaps(std::span<const std::vector<std::size_t>> lists, std::size_t budget_bytes,
                    Mode mode, std::size_t fixed_bytes) {
  BLOCKSWAP_CHECK(!lists.empty(), "the planner needs at least one block list");
  std::vector<ListFacts> f;
  for (const auto& list : lists) f.push_back(facts(list, mode));
  const std::size_t smallest = smallest_budget(lists, mode, fixed_bytes);
  BLOCKSWAP_CHECK(budget_bytes >= smallest, "a device budget of ", budget_bytes,
                  " bytes cannot hold the slots ", to_string(mode), " needs for ", lists.size(),
                  " block list(s) even with the most blocks swapped: the smallest budget that "
                  "works is ",
                  smallest, " bytes");

  // A handful of lists of tens of blocks each: search every combination of K, pruned.
  const std::size_t g = lists.size();
  std::vector<int64_t> k(g, 0), best;
  std::size_t best_moved = std::numeric_limits<std::size_t>::max(), best_device = 0;
  auto search = [&](auto&& self, std::size_t i, std::size_t device, std::size_t moved) -> void {
    if (device > budget_bytes || moved > best_moved) return;
    if (i == g) {
      if (moved < best_moved || device > best_device) {
        best = k;
        best_moved = moved;
        best_device = device;
      }
      return;
    }
    const auto n = static_cast<int64_t>(lists[i].size());
    for (k[i] = 0; k[i] <= f[i].max_k; ++k[i]) {
      self(self, i + 1, device + static_cast<std::size_t>(layout::slot_count(n, k[i])) * f[i].slot_bytes,
           moved + f[i].moved[k[i]]);
    }
  };
  search(search, 0, fixed_bytes, 0);
  BLOCKSWAP_ASSERT(!best.empty(), "no plan although the budget covers the smallest one");

  SwapPlan plan{{}, fixed_bytes, 0};
  for (std::size_t i = 0; i < g; ++i) {
    const ListPlan p{best[i], layout::slot_device_bytes(lists[i], best[i]), f[i].moved[best[i]]};
    plan.device_bytes += p.device_bytes;
    plan.moved_bytes += p.moved_bytes;
    plan.lists.push_back(p);
  }
  return plan;
}

int64_t plan_blocks_to_swap(std::span<const std::size_t> block_bytes, std::size_t budget_bytes,
                            Mode mode) {
  const std::vector<std::vector<std::size_t>> lists{{block_bytes.begin(), block_bytes.end()}};
  return plan_swaps(lists, budget_bytes, mode).lists[0].blocks_to_swap;
}

} // namespace blockswap
