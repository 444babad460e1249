// The schedule simulator and the bound T*: small cases worked by hand, and the bound against
// the simulator for every shape.
#include "blockswap/core/planner.hpp"
#include "blockswap/core/simulator.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

constexpr double kC = 1.0;         // a block's forward, seconds
constexpr std::size_t kS = 1000;   // a block's bytes
const LinkModel kUnitLink{1000.0}; // one block per second: l = c

TEST(Simulator, NothingSwappedIsPureCompute) {
  const Schedule s({8, 0, Mode::training});
  const Simulation r = simulate(s, uniform_timing(8, kC, kS, 2.0), kUnitLink);
  EXPECT_DOUBLE_EQ(r.step_seconds, 8 * 3.0);
  EXPECT_DOUBLE_EQ(r.compute_seconds, 24.0);
  EXPECT_DOUBLE_EQ(r.stall_seconds, 0);
  EXPECT_DOUBLE_EQ(r.link_busy_seconds, 0);
}

TEST(Simulator, OneSlotCannotOverlap) {
  // N=4, K=3 forward-only: one slot, every block loads after the previous one computed.
  const Schedule s({4, 3, Mode::forward_only});
  ASSERT_EQ(s.rotating_slots(), 1);
  const BlockTiming t = uniform_timing(4, kC, kS);
  const Simulation r = simulate(s, t, kUnitLink);
  EXPECT_DOUBLE_EQ(r.step_seconds, 4 * (kC + 1.0)); // N·(c + l)
  EXPECT_DOUBLE_EQ(step_bound(s, t, kUnitLink), 4 * (kC + 1.0));
  EXPECT_DOUBLE_EQ(r.link_busy_seconds, 4.0);
  // Every block waits for its own load, block 0 too: the previous pass loads it last.
  for (int b = 0; b < 4; ++b) EXPECT_DOUBLE_EQ(r.lists[0].forward_stall_seconds[b], 1.0);
}

TEST(Simulator, TwoSlotsGiveEachLoadOneBlockOfCompute) {
  // N=6, K=4, R=2: blocks alternate between two slots; each load hides behind one compute.
  const Schedule s({6, 4, Mode::forward_only, 2});
  const BlockTiming t = uniform_timing(6, kC, kS);
  const Simulation r = simulate(s, t, kUnitLink);
  // Each load runs during the previous block's compute, those of blocks 0 and 1 for the next
  // pass during blocks 5 and 0: a pass takes its compute and nothing more.
  EXPECT_DOUBLE_EQ(r.stall_seconds, 0);
  EXPECT_DOUBLE_EQ(r.step_seconds, 6.0);
  EXPECT_DOUBLE_EQ(step_bound(s, t, kUnitLink), 6.0);
}

TEST(Simulator, SlowLinkIsLinkBound) {
  // l = 3c: the link carries K+R = 4 loads per pass, 12 s, more than the 8 s of compute.
  const Schedule s({8, 2, Mode::forward_only, 2});
  const BlockTiming t = uniform_timing(8, kC, kS);
  const LinkModel slow{1000.0 / 3};
  const Simulation r = simulate(s, t, slow);
  EXPECT_DOUBLE_EQ(step_bound(s, t, slow), 12.0);
  EXPECT_GE(r.step_seconds, 12.0);
  EXPECT_NEAR(r.link_busy_seconds, 12.0, 1e-9);
}

TEST(Simulator, LatencyCountsPerCopy) {
  const Schedule s({4, 3, Mode::forward_only});
  const LinkModel link{1000.0, 0.25};
  EXPECT_DOUBLE_EQ(simulate(s, uniform_timing(4, kC, kS), link).step_seconds, 4 * (1 + 1.25));
}

TEST(Simulator, SeedReplayWaitsOnTheHostAndCopiesBack) {
  // N=3, K=1 training, the seed: forward of block 0, then block 0 copies back (1 s) and block 2
  // loads (1 s), the host waiting for the compute first; block 1 computes meanwhile.
  const Schedule seed({3, 1, Mode::training, 0, Algorithm::seed});
  const Schedule ours({3, 1, Mode::training});
  const BlockTiming t = uniform_timing(3, kC, kS, 2.0);
  const Simulation s = simulate(seed, t, kUnitLink);
  const Simulation o = simulate(ours, t, kUnitLink);
  EXPECT_DOUBLE_EQ(s.link_busy_seconds, 4.0); // 2 loads, 2 write-backs
  EXPECT_DOUBLE_EQ(o.link_busy_seconds, 2.0);
  EXPECT_GT(s.step_seconds, o.step_seconds);
}

TEST(Simulator, BackwardCostsItsFactor) {
  const Schedule s({5, 0, Mode::training});
  EXPECT_DOUBLE_EQ(simulate(s, uniform_timing(5, 0.5, kS, 3.0), kUnitLink).step_seconds,
                   5 * 0.5 * 4.0);
}

TEST(Simulator, TwoListsShareTheLinkAndTheComputeStream) {
  const Schedule a({4, 2, Mode::training}), b({6, 3, Mode::training});
  const BlockTiming ta = uniform_timing(4, 2.0, 2 * kS), tb = uniform_timing(6, kC, kS);
  const SimulatedList lists[] = {{&a, &ta}, {&b, &tb}};
  const Simulation both = simulate(lists, kUnitLink);
  const Simulation alone_a = simulate(a, ta, kUnitLink), alone_b = simulate(b, tb, kUnitLink);
  EXPECT_DOUBLE_EQ(both.compute_seconds, alone_a.compute_seconds + alone_b.compute_seconds);
  EXPECT_DOUBLE_EQ(both.link_busy_seconds, alone_a.link_busy_seconds + alone_b.link_busy_seconds);
  EXPECT_GE(both.step_seconds, std::max(alone_a.step_seconds, alone_b.step_seconds));
  EXPECT_GE(both.step_seconds, step_bound(lists, kUnitLink) - 1e-9);
  ASSERT_EQ(both.lists.size(), 2u);
  EXPECT_EQ(both.lists[1].backward_stall_seconds.size(), 6u);
}

// The bound is a bound: for every shape, both modes, both algorithms, several link speeds,
// the simulated step is never faster. And where the link is fast, the bound is the compute.
TEST(Simulator, NeverBeatsTheBound) {
  for (int64_t n = 1; n <= 48; ++n) {
    for (Mode mode : {Mode::forward_only, Mode::training}) {
      for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, mode); ++k) {
        for (Algorithm algorithm : {Algorithm::blockswap, Algorithm::seed}) {
          if (k > Schedule::max_blocks_to_swap(n, mode, algorithm)) continue;
          const Schedule s({n, k, mode, 0, algorithm});
          const BlockTiming t = uniform_timing(n, kC, kS, 2.0);
          for (double ratio : {0.5, 1.0, 1.5}) {
            const LinkModel link{1000.0 / ratio, 0.01};
            const double bound = step_bound(s, t, link);
            const Simulation r = simulate(s, t, link);
            ASSERT_GE(r.step_seconds, bound * (1 - 1e-9)) << s.describe() << " ratio " << ratio;
            ASSERT_GE(bound, r.compute_seconds * (1 - 1e-9));
            // A step is its computations and the waits before them: nothing after.
            ASSERT_NEAR(r.step_seconds, r.compute_seconds + r.stall_seconds, 1e-9)
                << s.describe() << " ratio " << ratio;
          }
        }
      }
    }
  }
}

// The same with blocks that differ (FLUX's double and single blocks, odd sizes), one or two
// lists, every R, a latency: random shapes.
TEST(Simulator, NeverBeatsTheBoundWithUnevenBlocks) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> seconds(0.1, 3.0);
  std::uniform_int_distribution<std::size_t> bytes(100, 5000);
  auto random_timing = [&](int64_t n) {
    BlockTiming t;
    for (int64_t b = 0; b < n; ++b) {
      t.forward_seconds.push_back(seconds(rng));
      t.bytes.push_back(bytes(rng));
    }
    t.backward_factor = std::uniform_real_distribution<double>(1.0, 3.0)(rng);
    return t;
  };
  for (int trial = 0; trial < 400; ++trial) {
    const Mode mode = trial % 2 == 0 ? Mode::forward_only : Mode::training;
    const Algorithm algorithm = trial % 5 == 0 ? Algorithm::seed : Algorithm::blockswap;
    const int lists = 1 + trial % 3 / 2;
    std::vector<Schedule> schedules;
    std::vector<BlockTiming> timings;
    for (int l = 0; l < lists; ++l) {
      const int64_t n = std::uniform_int_distribution<int64_t>(2, 16)(rng);
      const int64_t k = std::uniform_int_distribution<int64_t>(
          0, Schedule::max_blocks_to_swap(n, mode, algorithm))(rng);
      const int64_t r = mode == Mode::forward_only && k > 0 && algorithm == Algorithm::blockswap
                            ? std::uniform_int_distribution<int64_t>(1, n - k)(rng)
                            : 0;
      schedules.emplace_back(ScheduleOptions{n, k, mode, r, algorithm});
      timings.push_back(random_timing(n));
    }
    std::vector<SimulatedList> simulated;
    for (int l = 0; l < lists; ++l) simulated.push_back({&schedules[l], &timings[l]});
    const LinkModel link{std::uniform_real_distribution<double>(300, 3000)(rng), 0.05};
    const double bound = step_bound(simulated, link);
    const Simulation r = simulate(simulated, link);
    ASSERT_GE(r.step_seconds, bound * (1 - 1e-9))
        << "trial " << trial << ": " << schedules[0].describe();
  }
}

// A link slower than the compute by a hair: the backlog grows for longer than the simulator
// plays; then the link sets the pace, and the step is still never below the bound.
TEST(Simulator, ABacklogThatNeverSettlesIsPacedByTheLink) {
  for (double excess : {1e-3, 1e-4, 1e-6}) {
    const Schedule s({8, 1, Mode::forward_only, 7, Algorithm::seed});
    const BlockTiming t = uniform_timing(8, 0.01, 10'000'000);
    // The seed copies 16 blocks per pass: 16 copies take the 8 computes' time, times 1+excess.
    const LinkModel link{16 * 10'000'000 / (8 * 0.01) / (1 + excess)};
    const Simulation r = simulate(s, t, link);
    EXPECT_GE(r.step_seconds, step_bound(s, t, link) * (1 - 1e-9)) << excess;
    if (!r.steady) {
      EXPECT_NEAR(r.step_seconds, r.link_busy_seconds, 1e-12) << excess;
    }
  }
}

TEST(Simulator, BestRotatingSlotsIsTheFastest) {
  const BlockTiming t = uniform_timing(24, kC, kS);
  for (int64_t k : {1, 6, 12, 20}) {
    const int64_t best = best_rotating_slots(k, t, kUnitLink);
    ASSERT_GE(best, 1);
    ASSERT_LE(best, 24 - k);
    const double fastest =
        simulate(Schedule({24, k, Mode::forward_only, best}), t, kUnitLink).step_seconds;
    for (int64_t r = 1; r <= 24 - k; ++r) {
      EXPECT_LE(fastest,
                simulate(Schedule({24, k, Mode::forward_only, r}), t, kUnitLink).step_seconds +
                    1e-9);
    }
  }
  EXPECT_EQ(best_rotating_slots(0, t, kUnitLink), 0);
}

TEST(Simulator, RejectsTimingThatDoesNotFit) {
  const Schedule s({4, 1, Mode::forward_only});
  EXPECT_THROW(simulate(s, uniform_timing(3, kC, kS), kUnitLink), Error);
  BlockTiming negative = uniform_timing(4, kC, kS);
  negative.forward_seconds[2] = -1;
  EXPECT_THROW(simulate(s, negative, kUnitLink), Error);
  EXPECT_THROW(simulate(s, uniform_timing(4, kC, kS), LinkModel{0}), Error);
  EXPECT_THROW(
      simulate(s, uniform_timing(4, std::numeric_limits<double>::infinity(), kS), kUnitLink),
      Error);
  EXPECT_THROW(simulate(s, uniform_timing(4, kC, kS), LinkModel{1000, std::nan("")}), Error);
  EXPECT_THROW(step_bound(s, uniform_timing(4, kC, kS), LinkModel{-5}), Error);
}

// The file tier (DESIGN.md, "Tiers"): the disk is a second link in series with the host's.

// Every swapped block read from the file: flags for blocks 0..K-1 (training) or all.
BlockTiming from_file(BlockTiming t, int64_t first, int64_t last) {
  t.from_file.assign(t.bytes.size(), false);
  for (int64_t b = first; b < last; ++b) t.from_file[static_cast<std::size_t>(b)] = true;
  return t;
}

TEST(Simulator, ADiskFasterThanTheComputeCostsNothing) {
  // Reads run ahead of the copies: a disk that reads a block in half its compute never shows.
  for (Mode mode : {Mode::forward_only, Mode::training}) {
    const Schedule s({12, 5, mode});
    const BlockTiming t = uniform_timing(12, kC, kS);
    LinkModel link = kUnitLink;
    link.disk_bytes_per_second = 2.0 * kS / kC;
    const Simulation memory = simulate(s, t, link);
    const Simulation file = simulate(s, from_file(t, 0, 12), link);
    EXPECT_NEAR(file.step_seconds, memory.step_seconds, 1e-9) << s.describe();
    EXPECT_GT(file.disk_busy_seconds, 0);
    EXPECT_EQ(memory.disk_busy_seconds, 0);
  }
}

TEST(Simulator, ASlowDiskSetsThePaceAndTheBoundSaysSo) {
  for (Mode mode : {Mode::forward_only, Mode::training}) {
    const Schedule s({12, 5, mode});
    const BlockTiming t = from_file(uniform_timing(12, kC, kS), 0, 12);
    LinkModel link = kUnitLink;
    link.disk_bytes_per_second = 0.25 * kS / kC; // a read takes four computes
    const Simulation r = simulate(s, t, link);
    const double reads = r.disk_busy_seconds;
    EXPECT_NEAR(step_bound(s, t, link), reads, 1e-9) << s.describe(); // the disk term
    EXPECT_GE(r.step_seconds, reads * (1 - 1e-9));
    // Loads per step: K+R in inference, 2K in training, each read once.
    const double loads = mode == Mode::forward_only ? 5 + 2 : 2 * 5;
    EXPECT_NEAR(reads, loads * 4 * kC, 1e-9) << s.describe();
  }
}

TEST(Simulator, MoreStagingBuffersNeverSlowAStep) {
  for (Mode mode : {Mode::forward_only, Mode::training}) {
    for (double disk : {0.5, 1.0, 2.0}) {
      const Schedule s({16, 7, mode});
      const BlockTiming t = from_file(uniform_timing(16, kC, kS), 0, 16);
      double previous = std::numeric_limits<double>::infinity();
      for (int buffers : {1, 2, 3, 6}) {
        LinkModel link = kUnitLink;
        link.disk_bytes_per_second = disk * kS / kC;
        link.staging_buffers = buffers;
        const Simulation r = simulate(s, t, link);
        EXPECT_LE(r.step_seconds, previous + 1e-9) << s.describe() << " buffers " << buffers;
        EXPECT_GE(r.step_seconds, step_bound(s, t, link) * (1 - 1e-9));
        previous = r.step_seconds;
      }
    }
  }
}

// Training with every block in the file, a read taking 3.5 forwards (Wan 14B at 7 GB/s, copy =
// compute): the forward's 20 reads take 70 against its 40 of compute, the backward's 70 against
// 80. The reader reads the next step's first loads during the backward's spare time, as far as
// the ring holds (Note [training steps in sequence]); the step is the steady state, and the
// bound counts what a ring of Q leaves (Note [the disk in each half], Note [the staging ring]).
TEST(Simulator, TheStagingRingSetsTheStepWhereTheDiskIsTheBound) {
  const Schedule s({40, 20, Mode::training});
  const BlockTiming t = from_file(uniform_timing(40, kC, kS), 0, 40);
  // Ring 1: each read waits for the copy before it, 40 x (3.5 + 1). Ring 2 and 3: the forward
  // waits for its block 0 and first copy, then the 18 (17) reads the ring did not hold, then the
  // last copy and block 39; then the backward's 80. Ring 4: the disk, 40 x 3.5.
  const std::vector<std::pair<int, double>> expected = {{1, 180.0},
                                                        {2, 1 + 1 + 18 * 3.5 + 1 + 1 + 80},
                                                        {3, 1 + 1 + 17 * 3.5 + 1 + 1 + 80},
                                                        {4, 140.0}};
  for (const auto& [ring, step] : expected) {
    LinkModel link = kUnitLink;
    link.disk_bytes_per_second = kS / 3.5;
    link.staging_buffers = ring;
    const Simulation r = simulate(s, t, link);
    EXPECT_NEAR(r.step_seconds, step, 1e-9) << "ring " << ring;
    EXPECT_NEAR(step_bound(s, t, link), step, 1e-9) << "ring " << ring;
    EXPECT_NEAR(r.disk_busy_seconds, 140.0, 1e-9);
    EXPECT_TRUE(r.steady);
    EXPECT_GE(r.warmup_passes, 1) << "the first step reads nothing ahead";
  }
}

// Random shapes with blocks in the file: any disk, any ring, one to three lists.
TEST(Simulator, NeverBeatsTheBoundWithTheFileTier) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    const Mode mode = trial % 2 == 0 ? Mode::forward_only : Mode::training;
    const int lists = 1 + trial % 3;
    std::vector<Schedule> schedules;
    std::vector<BlockTiming> timings;
    for (int l = 0; l < lists; ++l) {
      const int64_t n = std::uniform_int_distribution<int64_t>(2, 16)(rng);
      const int64_t k = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
      const int64_t r = mode == Mode::forward_only && k > 0
                            ? std::uniform_int_distribution<int64_t>(1, n - k)(rng)
                            : 0;
      schedules.emplace_back(ScheduleOptions{n, k, mode, r});
      BlockTiming t;
      for (int64_t b = 0; b < n; ++b) {
        t.forward_seconds.push_back(std::uniform_real_distribution<double>(0.1, 3.0)(rng));
        t.bytes.push_back(std::uniform_int_distribution<std::size_t>(100, 5000)(rng));
        t.from_file.push_back(rng() % 2 == 0);
      }
      timings.push_back(std::move(t));
    }
    std::vector<SimulatedList> simulated;
    for (int l = 0; l < lists; ++l) simulated.push_back({&schedules[l], &timings[l]});
    LinkModel link{std::uniform_real_distribution<double>(300, 3000)(rng), 0.05 * (trial % 2)};
    link.disk_bytes_per_second = std::uniform_real_distribution<double>(50, 3000)(rng);
    link.staging_buffers = 1 + trial % 4;
    const double bound = step_bound(simulated, link);
    const Simulation r = simulate(simulated, link);
    ASSERT_GE(r.step_seconds, bound * (1 - 1e-9))
        << "trial " << trial << ": " << schedules[0].describe() << ", ring "
        << link.staging_buffers;
  }
}

TEST(Simulator, TrainingWithoutTheFileIsOneStep) {
  const Simulation r =
      simulate(Schedule({12, 5, Mode::training}), uniform_timing(12, kC, kS), kUnitLink);
  EXPECT_EQ(r.warmup_passes, 0);
  EXPECT_TRUE(r.steady);
}

TEST(Simulator, FileTierBlocksNeedADisk) {
  const Schedule s({4, 1, Mode::forward_only});
  BlockTiming t = from_file(uniform_timing(4, kC, kS), 0, 4);
  EXPECT_THROW(simulate(s, t, kUnitLink), Error); // no disk bandwidth given
  LinkModel link = kUnitLink;
  link.disk_bytes_per_second = 1000;
  link.staging_buffers = 0;
  EXPECT_THROW(simulate(s, t, link), Error);
  t.from_file.pop_back();
  link.staging_buffers = 2;
  EXPECT_THROW(simulate(s, t, link), Error); // a flag per block
}

} // namespace
} // namespace blockswap
