// The simulator and the bound T* with offloaded activations (BlockTiming::activation_bytes):
// a duplex link hides them under compute, one channel for both ways costs more, and the
// simulator never beats the bound.
#include "blockswap/core/simulator.hpp"

#include <gtest/gtest.h>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

constexpr double kC = 1.0;       // a block's forward, seconds
constexpr std::size_t kS = 1000; // a block's weight bytes

BlockTiming with_activations(int64_t n, std::size_t weight_bytes, std::size_t activation) {
  BlockTiming t = uniform_timing(n, kC, weight_bytes, 2.0);
  t.activation_bytes.assign(static_cast<std::size_t>(n), activation);
  return t;
}

TEST(SimulatorActivations, SmallActivationsHideUnderCompute) {
  // No weight swapping: activations of a quarter block's compute each way.
  const Schedule s({8, 0, Mode::training});
  const LinkModel link{1000.0};
  const Simulation r = simulate(s, with_activations(8, kS, 250), link);
  EXPECT_NEAR(r.step_seconds, 8 * 3.0, 1e-9);
  EXPECT_NEAR(r.d2h_busy_seconds, 7 * 0.25, 1e-9);  // the last block keeps its own
  EXPECT_NEAR(r.link_busy_seconds, 7 * 0.25, 1e-9); // and they all come back
  EXPECT_NEAR(step_bound(s, with_activations(8, kS, 250), link), 24.0, 1e-9);
}

TEST(SimulatorActivations, LargeActivationsAreLinkBoundAndTheBoundSaysSo) {
  const Schedule s({8, 0, Mode::training});
  const LinkModel link{1000.0};
  const BlockTiming t = with_activations(8, kS, 4000); // 4 s each way a block, compute 3 s
  const Simulation r = simulate(s, t, link);
  const double bound = step_bound(s, t, link);
  EXPECT_GE(r.step_seconds, bound * (1 - 1e-9));
  EXPECT_GE(bound, 7 * 4.0); // the copies back, in series
  EXPECT_GT(r.step_seconds, 24.0);
}

TEST(SimulatorActivations, OneChannelForBothWaysIsNeverFaster) {
  for (int64_t k : {0, 2, 5}) {
    const Schedule s({12, k, Mode::training});
    for (std::size_t a : {200u, 600u, 1500u}) {
      const BlockTiming t = with_activations(12, kS, a);
      LinkModel duplex{1500.0};
      LinkModel simplex = duplex;
      simplex.duplex = false;
      const Simulation d = simulate(s, t, duplex), o = simulate(s, t, simplex);
      EXPECT_LE(d.step_seconds, o.step_seconds * (1 + 1e-9)) << k << " " << a;
      EXPECT_GE(o.step_seconds, step_bound(s, t, simplex) * (1 - 1e-9));
      EXPECT_DOUBLE_EQ(o.d2h_busy_seconds, 0);
    }
  }
}

TEST(SimulatorActivations, NeverBeatsTheBound) {
  for (int64_t n = 2; n <= 24; ++n) {
    for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, Mode::training); ++k) {
      const Schedule s({n, k, Mode::training});
      for (double ratio : {0.5, 1.0, 1.5}) {
        for (double share : {0.25, 1.0, 2.0}) {
          const BlockTiming t =
              with_activations(n, kS, static_cast<std::size_t>(share * static_cast<double>(kS)));
          for (bool duplex : {true, false}) {
            LinkModel link{1000.0 / ratio, 0.01};
            link.duplex = duplex;
            const double bound = step_bound(s, t, link);
            const Simulation r = simulate(s, t, link);
            ASSERT_GE(r.step_seconds, bound * (1 - 1e-9))
                << s.describe() << " ratio " << ratio << " share " << share << " " << duplex;
          }
        }
      }
    }
  }
}

TEST(SimulatorActivations, TwoListsHandOverInTheForwardOrder) {
  // FLUX-like: the second list's first backward brings back the first list's last block.
  const Schedule a({4, 1, Mode::training}), b({6, 2, Mode::training});
  const BlockTiming ta = with_activations(4, kS, 300), tb = with_activations(6, kS / 2, 300);
  const std::vector<SimulatedList> lists{{&a, &ta}, {&b, &tb}};
  const LinkModel link{2000.0};
  const Simulation r = simulate(lists, link);
  EXPECT_NEAR(r.d2h_busy_seconds, 9 * 0.15, 1e-9);
  EXPECT_GE(r.step_seconds, step_bound(lists, link) * (1 - 1e-9));
  EXPECT_NEAR(r.stall_seconds, 0, 1e-9); // every restore is one block ahead
}

TEST(SimulatorActivations, InferenceMovesNoActivations) {
  const Schedule s({8, 3, Mode::forward_only});
  const Simulation r = simulate(s, with_activations(8, kS, 5000), LinkModel{1000.0});
  EXPECT_DOUBLE_EQ(r.d2h_busy_seconds, 0);
}

TEST(SimulatorActivations, RejectsSizesThatDoNotFit) {
  const Schedule s({8, 2, Mode::training});
  BlockTiming t = uniform_timing(8, kC, kS);
  t.activation_bytes.assign(7, 1);
  EXPECT_THROW(simulate(s, t, LinkModel{}), Error);
  EXPECT_THROW(step_bound(s, t, LinkModel{}), Error);
}

} // namespace
} // namespace blockswap
