// The planner: how many blocks of each list to swap so that the device weights fit a budget.
//
// A model may have several block lists on one device (FLUX: 19 double and 38 single blocks),
// each with its own offloader. They are planned together: the K for each list such that all
// their slots fit the budget and the fewest bytes move per step. Sizes are the packed block
// sizes; slots follow core/layout.hpp, so a plan's device bytes are the bytes the engines
// allocate. Forward-only, it also chooses the rotating slots R the simulator finds fastest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "blockswap/core/layout.hpp"
#include "blockswap/core/schedule.hpp"
#include "blockswap/core/simulator.hpp"

namespace blockswap {

struct ListPlan {
  int64_t blocks_to_swap = 0;
  std::size_t device_bytes = 0; // its slots
  std::size_t moved_bytes = 0;  // host-to-device bytes per step (training) or pass (inference)
};

struct SwapPlan {
  std::vector<ListPlan> lists;  // in the order given
  std::size_t device_bytes = 0; // every list's slots, plus the fixed bytes
  std::size_t moved_bytes = 0;
};

// The smallest device budget any plan needs: every list at its largest valid K, plus
// `fixed_bytes` (weights that never move).
std::size_t smallest_budget(std::span<const std::vector<std::size_t>> lists, Mode mode,
                            std::size_t fixed_bytes = 0);

// The K of each list whose slots, plus `fixed_bytes`, fit `budget_bytes` and move the fewest
// bytes per step; among plans that move as few, the one that uses the most of the budget.
// Bytes moved per list are the schedule's loads per pass times the list's average block.
// Throws Error naming the smallest budget that works when none fits, or for an empty list.
SwapPlan plan_swaps(std::span<const std::vector<std::size_t>> lists, std::size_t budget_bytes,
                    Mode mode, std::size_t fixed_bytes = 0);

// The plan for given K per list (checked against each list's range), whatever the budget.
SwapPlan plan_for(std::span<const std::vector<std::size_t>> lists, std::span<const int64_t> ks,
                  Mode mode, std::size_t fixed_bytes = 0);

// One or two lists: every plan that fits `budget_bytes` and that no other plan betters in both
// bytes moved and device bytes, by the first list's K (for each K of the first list, the
// smallest K of the second that fits). For choosing among them by another measure, such as the
// simulator's step time. Throws Error for more than two lists or when nothing fits.
std::vector<std::vector<int64_t>> budget_frontier(std::span<const std::vector<std::size_t>> lists,
                                                  std::size_t budget_bytes, Mode mode,
                                                  std::size_t fixed_bytes = 0);

// One list: the smallest valid K whose slots fit `budget_bytes` (plan_swaps for one list).
int64_t plan_blocks_to_swap(std::span<const std::size_t> block_bytes, std::size_t budget_bytes,
                            Mode mode);

// Forward-only: the number of rotating slots R (1..N-K) whose schedule the simulator finds
// fastest for these costs, the smaller on a tie (fewer loads); 0 when K = 0; N-K for the seed
// replay, which rotates every block whatever R is.
int64_t best_rotating_slots(int64_t blocks_to_swap, const BlockTiming& timing,
                            const LinkModel& link, Algorithm algorithm = Algorithm::blockswap);
// The same for the lists of one model on one device (K and timing per list): one list at a
// time from the default R, every other list fixed, twice round (a search that can miss the
// best pair: in 2 of 400 random two-list cases it did, by up to 4 %).
std::vector<int64_t> best_rotating_slots(std::span<const int64_t> blocks_to_swap,
                                         std::span<const BlockTiming> timings,
                                         const LinkModel& link);

// Pipeline stages (docs/distributed.md, "Pipeline stages"): the blocks of `lists`, run one list
// after another, cut into `stages` contiguous stages as DeepSpeed's partition_balanced cuts
// layers by their parameters (Note [stage partition] in planner.cpp), `first_bytes` (what runs
// before the blocks: embedders) counted with the first block. Per stage, per list: the first
// block and the end (a list the stage has none of: an empty range). Throws InvalidArgument for
// fewer blocks than stages.
struct BlockRange {
  int64_t begin = 0, end = 0;
  friend bool operator==(const BlockRange&, const BlockRange&) = default;
};
std::vector<std::vector<BlockRange>> split_stages(std::span<const std::vector<std::size_t>> lists,
                                                  int64_t stages, std::size_t first_bytes = 0);

// The order in which blocks are given host memory that is scarce (the file tier's budget,
// pinned memory where the system caps it): the blocks a pass of `schedules[0]` loads by a move,
// spread over the order the pass loads them (every prefix of the order, every budget, leaves
// blocks held alternating in time with the others, the turn from forward to backward included),
// then those of `schedules[1]`, then the blocks that never move.
std::vector<int64_t> host_priority(int64_t blocks, std::span<const Schedule* const> schedules);

// The file tier (DESIGN.md, "Tiers"): per block, whether its bytes are read from the model's file
// for each load. The blocks are held in host memory in `priority` order (host_priority) while
// `host_budget_left` lasts (their bytes taken from it); the others stay in the file (a block
// that never moves is read once, when first placed).
std::vector<bool> file_tier(std::span<const std::size_t> block_bytes,
                            std::span<const int64_t> priority, std::size_t& host_budget_left);

// The file tier's placement, chosen with the simulator where the costs are known (`lists`:
// every list's schedule and costs; their `from_file` is ignored). host_priority spreads the
// blocks read from the file evenly over the loads, but where the disk is close to the bound the
// ring of staging buffers makes some places better than others (which depends on the costs: the
// computes between a read's buffer freeing and its block's compute). From `priorities` (per
// list, every block once: host_priority's), swaps a moved block held in `host_budgets[l]` with
// one of the same list read from the file while the simulated step gets shorter, each pair
// tried once a round, at most `rounds` rounds. Returns the priorities, for FileTier::priority;
// the simulated step is never longer than with `priorities`.
std::vector<std::vector<int64_t>> file_priority(std::span<const SimulatedList> lists,
                                                const LinkModel& link,
                                                std::span<const std::size_t> host_budgets,
                                                std::vector<std::vector<int64_t>> priorities,
                                                int rounds = 4);

} // namespace blockswap
