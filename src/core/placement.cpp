// Where a step's host memory goes (core/planner.hpp): which blocks get scarce pinned memory
// first (host_priority), which stay in the model's file under a host budget (file_tier), and the
// placement the simulator finds shortest (file_priority).
#include <algorithm>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/simulator.hpp"

namespace blockswap {

std::vector<int64_t> host_priority(int64_t blocks, std::span<const Schedule* const> schedules) {
  std::vector<int64_t> order;
  std::vector<bool> placed(static_cast<std::size_t>(blocks), false);
  auto add = [&](int64_t b) {
    if (placed[static_cast<std::size_t>(b)]) return;
    placed[static_cast<std::size_t>(b)] = true;
    order.push_back(b);
  };
  for (const Schedule* schedule : schedules) { // the first schedule's moved blocks first
    std::vector<bool> moved(static_cast<std::size_t>(blocks), false);
    std::vector<int64_t> in_order; // moved, in the order a pass first loads them
    for (const Op& op : schedule->pass()) {
      if (op.kind != Op::Kind::move || moved[static_cast<std::size_t>(op.move.in)]) continue;
      moved[static_cast<std::size_t>(op.move.in)] = true;
      in_order.push_back(op.move.in);
    }
    // Spread: every prefix of the order is spaced evenly over the pass's loads (bit-reversed
    // positions), so that the blocks left in the file alternate in time with blocks held, the
    // turn from forward to backward included, and the disk reads ahead while the link copies
    // held blocks instead of reading a run of them in turn.
    const auto m = static_cast<uint64_t>(in_order.size());
    int bits = 0;
    while ((uint64_t{1} << bits) < m) ++bits;
    for (uint64_t i = 0; i < (uint64_t{1} << bits); ++i) {
      uint64_t reversed = 0;
      for (int bit = 0; bit < bits; ++bit) reversed |= ((i >> bit) & 1) << (bits - 1 - bit);
      if (reversed < m) add(in_order[reversed]);
    }
  }
  for (int64_t b = 0; b < blocks; ++b) add(b);
  return order;
}

std::vector<bool> file_tier(std::span<const std::size_t> block_bytes,
                            std::span<const int64_t> priority, std::size_t& host_budget_left) {
  std::vector<bool> from_file(block_bytes.size(), true);
  for (int64_t b : priority) {
    const auto i = static_cast<std::size_t>(b);
    if (block_bytes[i] > host_budget_left) continue;
    host_budget_left -= block_bytes[i];
    from_file[i] = false;
  }
  return from_file;
}

// A local search: each accepted swap shortens the simulated step, so it ends; a round tries
// every pair of a held and a file block of each list (a few hundred simulations for FLUX's
// lists, milliseconds).
std::vector<std::vector<int64_t>> file_priority(std::span<const SimulatedList> lists,
                                                const LinkModel& link,
                                                std::span<const std::size_t> host_budgets,
                                                std::vector<std::vector<int64_t>> priorities,
                                                int rounds) {
  BLOCKSWAP_CHECK(!lists.empty() && lists.size() == host_budgets.size() &&
                      lists.size() == priorities.size(),
                  "file_priority: one host budget and one priority per list, and a list");
  std::vector<BlockTiming> timings;
  std::vector<SimulatedList> simulated;
  std::vector<std::vector<bool>> moved;
  for (std::size_t l = 0; l < lists.size(); ++l) {
    BLOCKSWAP_CHECK(lists[l].schedule != nullptr && lists[l].timing != nullptr,
                    "file_priority: a list needs a schedule and a timing");
    const auto n = static_cast<std::size_t>(lists[l].schedule->blocks());
    std::vector<bool> seen(n, false);
    for (int64_t b : priorities[l]) {
      BLOCKSWAP_CHECK(b >= 0 && static_cast<std::size_t>(b) < n && !seen[b], "file_priority: list ",
                      l, "'s priority must name each of its ", n, " blocks once");
      seen[b] = true;
    }
    BLOCKSWAP_CHECK(priorities[l].size() == n, "file_priority: list ", l, "'s priority names ",
                    priorities[l].size(), " of its ", n, " blocks");
    moved.emplace_back(n, false);
    for (const Op& op : lists[l].schedule->pass()) {
      if (op.kind == Op::Kind::move) moved[l][op.move.in] = true;
    }
    timings.push_back(*lists[l].timing);
  }
  auto place = [&](std::size_t l) {
    std::size_t left = host_budgets[l];
    timings[l].from_file = file_tier(timings[l].bytes, priorities[l], left);
  };
  for (std::size_t l = 0; l < lists.size(); ++l) {
    place(l);
    simulated.push_back({lists[l].schedule, &timings[l]});
  }
  double best = simulate(simulated, link).step_seconds;
  for (int round = 0; round < rounds; ++round) {
    bool improved = false;
    for (std::size_t l = 0; l < lists.size(); ++l) {
      std::vector<int64_t>& order = priorities[l];
      for (std::size_t i = 0; i < order.size(); ++i) {
        for (std::size_t j = 0; j < order.size(); ++j) {
          const std::vector<bool>& file = timings[l].from_file;
          if (!moved[l][order[i]] || !moved[l][order[j]] || file[order[i]] || !file[order[j]]) {
            continue;
          }
          std::swap(order[i], order[j]);
          place(l);
          const double seconds = simulate(simulated, link).step_seconds;
          // Shorter by more than rounding: otherwise the spread stays.
          if (seconds < best * (1 - 1e-9)) {
            best = seconds;
            improved = true;
          } else {
            std::swap(order[i], order[j]);
            place(l);
          }
        }
      }
    }
    if (!improved) break;
  }
  return priorities;
}

} // namespace blockswap
