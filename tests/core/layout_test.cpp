#include "blockswap/core/layout.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace blockswap {
namespace {

TEST(Layout, SlotsAreTheLargestBlockAligned) {
  const std::vector<std::size_t> blocks{1000, 3000, 2000};
  EXPECT_EQ(layout::slot_bytes(blocks), 3072u);
  EXPECT_EQ(layout::slot_device_bytes(blocks, 0), 3u * 3072);
  EXPECT_EQ(layout::slot_device_bytes(blocks, 2), 1u * 3072);
  EXPECT_EQ(layout::align_up(0), 0u);
  EXPECT_EQ(layout::align_up(1), layout::kAlignment);
  EXPECT_EQ(layout::align_up(layout::kAlignment), layout::kAlignment);
}

// The schedule is built from the same facts the planners use: for every N and K, its slots
// and loads per pass are the layout's.
TEST(Layout, AgreesWithTheScheduleForEveryNAndK) {
  for (int64_t n = 1; n <= 24; ++n) {
    for (Mode mode : {Mode::forward_only, Mode::training}) {
      for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, mode); ++k) {
        const Schedule schedule(ScheduleOptions{n, k, mode});
        EXPECT_EQ(schedule.slots(), layout::slot_count(n, k));
        const int64_t r = mode == Mode::training ? 0 : layout::default_rotating_slots(n, k);
        EXPECT_EQ(schedule.loads_per_pass(), layout::loads_per_pass(k, mode, r))
            << "N=" << n << " K=" << k << " " << to_string(mode);
        // Counted from the pass itself.
        int64_t moves = 0;
        for (const Op& op : schedule.pass()) moves += op.kind == Op::Kind::move ? 1 : 0;
        EXPECT_EQ(moves, schedule.loads_per_pass()) << "N=" << n << " K=" << k;
      }
    }
  }
}

} // namespace
} // namespace blockswap
