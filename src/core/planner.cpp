#include "blockswap/core/planner.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

struct ListFacts {
  std::size_t slot_bytes = 0;
  int64_t max_k = 0;
  std::vector<std::size_t> moved; // bytes moved per step, by K
};

// Bytes moved per step for each valid K, from the schedule itself.
// Sizes whose sums could wrap around are refused: every sum the planner makes (a list's bytes,
// its slots, every list's slots and moves together) stays below this.
constexpr std::size_t kMostBytes = std::numeric_limits<std::size_t>::max() / 8;

void check_sizes(const std::vector<std::size_t>& blocks) {
  std::size_t total = 0, largest = 0;
  for (std::size_t bytes : blocks) {
    BLOCKSWAP_CHECK(bytes <= kMostBytes - total, "the planner cannot plan blocks of ", bytes,
                    " bytes: a list's blocks must add up to at most ", kMostBytes, " bytes");
    total += bytes;
    largest = std::max(largest, bytes);
  }
  BLOCKSWAP_CHECK(largest <= kMostBytes / blocks.size(), "the planner cannot plan ", blocks.size(),
                  " slots of ", largest, " bytes: at most ", kMostBytes,
                  " bytes of slots per list");
}

// Every list's slots with nothing swapped, plus the fixed bytes, must stay below kMostBytes:
// then no sum of device bytes or bytes moved the planner makes can wrap around.
void check_lists(std::span<const std::vector<std::size_t>> lists, std::size_t fixed_bytes) {
  std::size_t most = fixed_bytes;
  BLOCKSWAP_CHECK(fixed_bytes <= kMostBytes, "the planner cannot plan ", fixed_bytes,
                  " fixed bytes: at most ", kMostBytes);
  for (const auto& list : lists) {
    BLOCKSWAP_CHECK(!list.empty(), "the planner needs at least one block in every list");
    check_sizes(list);
    const std::size_t slots = list.size() * layout::slot_bytes(list);
    BLOCKSWAP_CHECK(slots <= kMostBytes - most,
                    "the planner cannot plan these block lists: "
                    "their slots add up to more than ",
                    kMostBytes, " bytes");
    most += slots;
  }
}

ListFacts facts(const std::vector<std::size_t>& blocks, Mode mode) {
  const auto n = static_cast<int64_t>(blocks.size());
  BLOCKSWAP_CHECK(n >= 1, "the planner needs at least one block in every list");
  check_sizes(blocks);
  std::size_t total = 0;
  for (std::size_t bytes : blocks) total += bytes;
  ListFacts f{layout::slot_bytes(blocks), Schedule::max_blocks_to_swap(n, mode), {}};
  for (int64_t k = 0; k <= f.max_k; ++k) {
    const Schedule schedule(ScheduleOptions{n, k, mode});
    f.moved.push_back(static_cast<std::size_t>(schedule.loads_per_pass()) *
                      (total / blocks.size()));
  }
  return f;
}

// A plan is better when it moves fewer bytes, or as few and uses more of the budget.
struct Score {
  std::size_t moved = 0, device = 0;
  bool better_than(const Score& other) const {
    return moved < other.moved || (moved == other.moved && device > other.device);
  }
};

// How many slots of `slot_bytes` fit `room`, at most `blocks` (slots of empty blocks take none).
int64_t slots_in(std::size_t room, std::size_t slot_bytes, int64_t blocks) {
  if (slot_bytes == 0) return blocks;
  return static_cast<int64_t>(
      std::min<std::size_t>(room / slot_bytes, static_cast<std::size_t>(blocks)));
}

std::size_t device_of(const std::vector<std::size_t>& list, const ListFacts& f, int64_t k) {
  return static_cast<std::size_t>(layout::slot_count(static_cast<int64_t>(list.size()), k)) *
         f.slot_bytes;
}

// Lists a and b together in `room` bytes: for each K of list a that fits, the smallest K of
// list b that fits with it (moved bytes never fall as K grows, and the smallest K holds the
// most), as {K_a, K_b} pairs: every plan that no other betters in both bytes moved and device
// bytes.
std::vector<std::pair<int64_t, int64_t>> pair_frontier(const std::vector<std::size_t>& a,
                                                       const ListFacts& fa,
                                                       const std::vector<std::size_t>& b,
                                                       const ListFacts& fb, std::size_t room) {
  std::vector<std::pair<int64_t, int64_t>> frontier;
  const auto nb = static_cast<int64_t>(b.size());
  for (int64_t ka = 0; ka <= fa.max_k; ++ka) {
    const std::size_t da = device_of(a, fa, ka);
    if (da > room) continue;
    const int64_t kb = std::max<int64_t>(0, nb - slots_in(room - da, fb.slot_bytes, nb));
    if (kb <= fb.max_k) frontier.emplace_back(ka, kb);
  }
  return frontier;
}

// The best K for lists i and j together, the others' slots taking `others` of `budget`: the
// best of their frontier. Exact. Leaves k unchanged when nothing fits.
void best_pair(std::span<const std::vector<std::size_t>> lists, const std::vector<ListFacts>& f,
               std::size_t budget, std::size_t others, std::size_t i, std::size_t j,
               std::vector<int64_t>& k) {
  if (others > budget) return;
  Score best{std::numeric_limits<std::size_t>::max(), 0};
  for (const auto& [ki, kj] : pair_frontier(lists[i], f[i], lists[j], f[j], budget - others)) {
    const Score score{f[i].moved[ki] + f[j].moved[kj],
                      device_of(lists[i], f[i], ki) + device_of(lists[j], f[j], kj)};
    if (score.better_than(best)) {
      best = score;
      k[i] = ki;
      k[j] = kj;
    }
  }
}

// The K of every list. One list: the smallest K that fits. Two: exact (best_pair). More: from
// every list at its largest K (the smallest plan, which fits), each pair of lists in turn is
// made optimal with the others fixed, round after round until no pair improves (at most 64
// rounds): a plan no change to one or two lists can better, in time polynomial in the lists
// and blocks, where the exhaustive search is exponential in the number of lists.
std::vector<int64_t> search(std::span<const std::vector<std::size_t>> lists,
                            const std::vector<ListFacts>& f, std::size_t budget) {
  const std::size_t g = lists.size();
  std::vector<int64_t> k(g);
  for (std::size_t i = 0; i < g; ++i) k[i] = f[i].max_k;
  auto device = [&](const std::vector<int64_t>& ks, std::size_t skip_a, std::size_t skip_b) {
    std::size_t total = 0;
    for (std::size_t i = 0; i < g; ++i) {
      if (i != skip_a && i != skip_b) total += device_of(lists[i], f[i], ks[i]);
    }
    return total;
  };
  if (g == 1) {
    const auto n = static_cast<int64_t>(lists[0].size());
    const int64_t fitting = slots_in(budget, f[0].slot_bytes, n);
    k[0] = std::max<int64_t>(0, n - fitting);
    return k;
  }
  auto score = [&](const std::vector<int64_t>& ks) {
    Score s{0, device(ks, g, g)};
    for (std::size_t i = 0; i < g; ++i) s.moved += f[i].moved[ks[i]];
    return s;
  };
  for (int round = 0; round < 64; ++round) {
    bool improved = false;
    for (std::size_t i = 0; i < g; ++i) {
      for (std::size_t j = i + 1; j < g; ++j) {
        std::vector<int64_t> trial = k;
        best_pair(lists, f, budget, device(k, i, j), i, j, trial);
        if (score(trial).better_than(score(k))) {
          k = trial;
          improved = true;
        }
      }
    }
    if (!improved || g == 2) break;
  }
  return k;
}

} // namespace

std::size_t smallest_budget(std::span<const std::vector<std::size_t>> lists, Mode mode,
                            std::size_t fixed_bytes) {
  check_lists(lists, fixed_bytes);
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

  const std::vector<int64_t> best = search(lists, f, budget_bytes - fixed_bytes);
  SwapPlan plan{{}, fixed_bytes, 0};
  for (std::size_t i = 0; i < lists.size(); ++i) {
    const ListPlan p{best[i], layout::slot_device_bytes(lists[i], best[i]), f[i].moved[best[i]]};
    plan.device_bytes += p.device_bytes;
    plan.moved_bytes += p.moved_bytes;
    plan.lists.push_back(p);
  }
  return plan;
}

SwapPlan plan_for(std::span<const std::vector<std::size_t>> lists, std::span<const int64_t> ks,
                  Mode mode, std::size_t fixed_bytes) {
  BLOCKSWAP_CHECK(lists.size() == ks.size() && !lists.empty(),
                  "plan_for: one K per block list, and at least one list");
  check_lists(lists, fixed_bytes);
  SwapPlan plan{{}, fixed_bytes, 0};
  for (std::size_t i = 0; i < lists.size(); ++i) {
    const ListFacts f = facts(lists[i], mode);
    Schedule::check(static_cast<int64_t>(lists[i].size()), ks[i], mode);
    const ListPlan p{ks[i], layout::slot_device_bytes(lists[i], ks[i]), f.moved[ks[i]]};
    plan.device_bytes += p.device_bytes;
    plan.moved_bytes += p.moved_bytes;
    plan.lists.push_back(p);
  }
  return plan;
}

std::vector<std::vector<int64_t>> budget_frontier(std::span<const std::vector<std::size_t>> lists,
                                                  std::size_t budget_bytes, Mode mode,
                                                  std::size_t fixed_bytes) {
  BLOCKSWAP_CHECK(lists.size() == 1 || lists.size() == 2,
                  "budget_frontier: one or two block lists, got ", lists.size());
  const SwapPlan best = plan_swaps(lists, budget_bytes, mode, fixed_bytes); // checks the budget
  if (lists.size() == 1) return {{best.lists[0].blocks_to_swap}};
  const ListFacts a = facts(lists[0], mode), b = facts(lists[1], mode);
  std::vector<std::vector<int64_t>> frontier;
  for (const auto& [ka, kb] : pair_frontier(lists[0], a, lists[1], b, budget_bytes - fixed_bytes)) {
    frontier.push_back({ka, kb});
  }
  return frontier;
}

int64_t plan_blocks_to_swap(std::span<const std::size_t> block_bytes, std::size_t budget_bytes,
                            Mode mode) {
  const std::vector<std::vector<std::size_t>> lists{{block_bytes.begin(), block_bytes.end()}};
  return plan_swaps(lists, budget_bytes, mode).lists[0].blocks_to_swap;
}

// The search over R: the simulator plays each candidate schedule.
int64_t best_rotating_slots(int64_t blocks_to_swap, const BlockTiming& timing,
                            const LinkModel& link, Algorithm algorithm) {
  const auto n = static_cast<int64_t>(timing.forward_seconds.size());
  Schedule::check(n, blocks_to_swap, Mode::forward_only);
  if (blocks_to_swap == 0) return 0;
  if (algorithm == Algorithm::seed) return n - blocks_to_swap; // the seed rotates every block
  int64_t best = 1;
  double best_seconds = std::numeric_limits<double>::infinity();
  for (int64_t r = 1; r <= n - blocks_to_swap; ++r) {
    const Schedule schedule({n, blocks_to_swap, Mode::forward_only, r, algorithm});
    const double seconds = simulate(schedule, timing, link).step_seconds;
    // A faster schedule must win by more than rounding: otherwise fewer loads are better.
    if (seconds < best_seconds * (1 - 1e-9)) {
      best = r;
      best_seconds = seconds;
    }
  }
  return best;
}

std::vector<int64_t> best_rotating_slots(std::span<const int64_t> blocks_to_swap,
                                         std::span<const BlockTiming> timings,
                                         const LinkModel& link) {
  BLOCKSWAP_CHECK(blocks_to_swap.size() == timings.size() && !timings.empty(),
                  "best_rotating_slots: one K per timing, and at least one list");
  const std::size_t lists = timings.size();
  std::vector<int64_t> n(lists), r(lists);
  for (std::size_t l = 0; l < lists; ++l) {
    n[l] = static_cast<int64_t>(timings[l].forward_seconds.size());
    Schedule::check(n[l], blocks_to_swap[l], Mode::forward_only);
    r[l] = blocks_to_swap[l] == 0 ? 0 : layout::default_rotating_slots(n[l], blocks_to_swap[l]);
  }
  auto seconds = [&](const std::vector<int64_t>& rs) {
    std::vector<Schedule> schedules;
    for (std::size_t l = 0; l < lists; ++l) {
      schedules.emplace_back(ScheduleOptions{n[l], blocks_to_swap[l], Mode::forward_only, rs[l]});
    }
    std::vector<SimulatedList> simulated;
    for (std::size_t l = 0; l < lists; ++l) simulated.push_back({&schedules[l], &timings[l]});
    return simulate(simulated, link).step_seconds;
  };
  double best = seconds(r);
  for (int round = 0; round < 2; ++round) {
    for (std::size_t l = 0; l < lists; ++l) {
      for (int64_t candidate = 1; blocks_to_swap[l] > 0 && candidate <= n[l] - blocks_to_swap[l];
           ++candidate) {
        std::vector<int64_t> trial = r;
        trial[l] = candidate;
        const double t = seconds(trial);
        // A faster schedule must win by more than rounding: otherwise fewer loads are better.
        if (t < best * (1 - 1e-9)) {
          best = t;
          r = trial;
        }
      }
    }
  }
  return r;
}
// Note [stage partition]
// DeepSpeed's partition_balanced (partition_method "parameters", which diffusion-pipe uses):
// the smallest possible largest stage B, then the stages filled from the first, each taking
// blocks while it stays within B and one block is left for each stage after it.
std::vector<std::vector<BlockRange>> split_stages(std::span<const std::vector<std::size_t>> lists,
                                                  int64_t stages, std::size_t first_bytes) {
  std::vector<std::size_t> weights; // every block, the lists one after another
  std::vector<std::pair<std::size_t, int64_t>> where;
  for (std::size_t l = 0; l < lists.size(); ++l) {
    for (std::size_t b = 0; b < lists[l].size(); ++b) {
      weights.push_back(lists[l][b] + (weights.empty() ? first_bytes : 0));
      where.emplace_back(l, static_cast<int64_t>(b));
    }
  }
  const auto blocks = static_cast<int64_t>(weights.size());
  BLOCKSWAP_CHECK_ARGUMENT(stages >= 1 && blocks >= stages, "cannot cut ", blocks, " blocks into ",
                           stages, " pipeline stages: each needs a block");
  // The stages greedy filling makes when no stage may exceed `limit` (more than `stages`: none).
  auto fill = [&](std::size_t limit) {
    std::vector<int64_t> ends;
    std::size_t sum = 0;
    for (int64_t i = 0; i < blocks; ++i) {
      const std::size_t w = weights[static_cast<std::size_t>(i)];
      const auto left_stages = stages - static_cast<int64_t>(ends.size()) - 1;
      if (i > 0 && (sum + w > limit || blocks - i <= left_stages) && sum > 0 &&
          static_cast<int64_t>(ends.size()) < stages - 1) {
        ends.push_back(i);
        sum = 0;
      }
      sum += w;
      if (sum > limit) return std::vector<int64_t>{};
    }
    ends.push_back(blocks);
    return ends;
  };
  std::size_t low = *std::max_element(weights.begin(), weights.end()), high = 0;
  for (std::size_t w : weights) high += w;
  while (low < high) { // the smallest limit the stages can keep
    const std::size_t mid = low + (high - low) / 2;
    (fill(mid).empty() ? low = mid + 1 : high = mid);
  }
  const std::vector<int64_t> ends = fill(low);
  std::vector<std::vector<BlockRange>> out(static_cast<std::size_t>(stages),
                                           std::vector<BlockRange>(lists.size()));
  int64_t begin = 0;
  for (std::size_t s = 0; s < ends.size(); ++s) {
    for (int64_t i = begin; i < ends[s]; ++i) {
      const auto [l, b] = where[static_cast<std::size_t>(i)];
      BlockRange& r = out[s][l];
      if (r.end == r.begin) r.begin = b;
      r.end = b + 1;
    }
    begin = ends[s];
  }
  return out;
}

} // namespace blockswap
