#include "blockswap/core/schedule.hpp"

#include <gtest/gtest.h>

#include <set>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

constexpr int kPasses = 3;

// Follows a schedule op by op, as the engine would, checking the invariants of DESIGN.md
// section 7 on the way. Returns the loads of each pass.
struct Replay {
  const Schedule& schedule;
  std::vector<bool> resident;
  std::vector<int64_t> loads;

  explicit Replay(const Schedule& s) : schedule(s), resident(s.blocks(), false) {
    std::set<int64_t> used;
    for (int64_t b = 0; b < s.blocks(); ++b) {
      const int64_t slot = s.initial_slots()[b];
      if (slot < 0) continue;
      resident[b] = true;
      EXPECT_LT(slot, s.slots()) << s.describe();
      EXPECT_TRUE(used.insert(slot).second)
          << "two blocks in slot " << slot << ": " << s.describe();
    }
    EXPECT_EQ(static_cast<int64_t>(used.size()), s.slots()) << s.describe();
  }

  int64_t resident_count() const { return std::count(resident.begin(), resident.end(), true); }

  void run_pass() {
    int64_t pass_loads = 0;
    bool in_backward = false;
    for (const Op& op : schedule.pass()) {
      if (op.kind != Op::Kind::move) {
        in_backward = op.kind == Op::Kind::backward;
        ASSERT_TRUE(resident[op.block])
            << "block " << op.block << " computed while not resident: " << schedule.describe();
        continue;
      }
      // A move evicts a block whose compute in this phase is over: in forward the block just
      // computed, in backward one already differentiated (its readers have all been enqueued).
      if (in_backward) {
        ASSERT_GE(op.move.out, op.block) << schedule.describe();
      } else {
        ASSERT_EQ(op.move.out, op.block) << schedule.describe();
      }
      ASSERT_TRUE(resident[op.move.out]) << schedule.describe();
      ASSERT_FALSE(resident[op.move.in]) << schedule.describe();
      resident[op.move.out] = false;
      resident[op.move.in] = true;
      ++pass_loads;
      ASSERT_LE(resident_count(), schedule.slots()) << schedule.describe();
    }
    loads.push_back(pass_loads);
  }
};

// The seed's rules (DESIGN.md section 1), written independently of the schedule: which blocks
// are on the device after each verb.
struct SeedModel {
  int64_t n, k;
  bool forward_only;
  std::vector<bool> on_device;

  SeedModel(int64_t blocks, int64_t swap, bool fwd_only)
      : n(blocks), k(swap), forward_only(fwd_only), on_device(blocks) {
    for (int64_t b = 0; b < n; ++b) on_device[b] = k == 0 || b < n - k;
  }
  void submit_move_blocks_forward(int64_t i) {
    if (k == 0 || (!forward_only && i >= k)) return;
    on_device[i] = false;
    on_device[(n - k + i) % n] = true;
  }
  void after_backward(int64_t b) {
    const int64_t p = n - b - 1;
    if (k == 0 || p < 1 || p > k) return;
    on_device[b + 1] = false;
    on_device[k - p] = true;
  }
};

std::vector<bool> residency_after(const std::vector<bool>& before, std::span<const Move> moves) {
  std::vector<bool> after = before;
  for (const Move& m : moves) {
    after[m.out] = false;
    after[m.in] = true;
  }
  return after;
}

TEST(Schedule, InvariantsForEveryShape) {
  for (int64_t n = 1; n <= 48; ++n) {
    for (Mode mode : {Mode::forward_only, Mode::training}) {
      for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, mode); ++k) {
        // Training: 0 is the seed's layout, 1 <= R < min(K, N-K) a rotation.
        const int64_t max_r = k > 0 ? n - k : 0;
        const int64_t min_r = mode == Mode::forward_only && max_r > 0 ? 1 : 0;
        for (int64_t r = min_r; r <= max_r; ++r) {
          Schedule s({n, k, mode, r});
          EXPECT_EQ(s.slots(), n - k);
          Replay replay(s);
          for (int pass = 0; pass < kPasses; ++pass) {
            replay.run_pass();
            if (HasFatalFailure()) return;
          }
          const int64_t expected = mode == Mode::training ? 2 * k : (k == 0 ? 0 : k + r);
          EXPECT_EQ(s.loads_per_pass(), expected) << s.describe();
          for (int64_t loads : replay.loads) EXPECT_EQ(loads, expected) << s.describe();
          // Every pass ends with the blocks it started with: prepare() has nothing to copy.
          for (int64_t b = 0; b < n; ++b) {
            EXPECT_EQ(replay.resident[b], s.initial_slots()[b] >= 0) << s.describe();
          }
        }
      }
    }
  }
}

// Note [exact backward]: the schedule says which slot every block is computed in. Every block
// is computed in a slot it occupies, no slot holds two blocks, and in training every block's
// backward runs in the slot its forward ran in, so autograd's saved views of its weights read
// its own weights and the engine's check before each backward loads nothing.
TEST(Schedule, EveryBlockIsDifferentiatedInTheSlotOfItsForward) {
  for (int64_t n = 1; n <= 48; ++n) {
    for (Mode mode : {Mode::forward_only, Mode::training}) {
      for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, mode); ++k) {
        for (int64_t r = 0; r <= (mode == Mode::training && k > 0 ? n - k : 0); ++r) {
          const Schedule s({n, k, mode, r});
          std::vector<int64_t> forward_slot(n, -1), occupant(s.slots(), -1);
          for (int64_t b = 0; b < n; ++b) {
            if (s.initial_slots()[b] >= 0) occupant[s.initial_slots()[b]] = b;
          }
          int64_t backwards = 0;
          for (const Op& op : s.pass()) {
            ASSERT_GE(op.slot, 0) << s.describe();
            ASSERT_LT(op.slot, s.slots()) << s.describe();
            if (op.kind == Op::Kind::move) {
              ASSERT_EQ(occupant[op.slot], op.move.out) << s.describe();
              occupant[op.slot] = op.move.in;
              continue;
            }
            ASSERT_EQ(occupant[op.slot], op.block) << s.describe() << " block " << op.block;
            if (op.kind == Op::Kind::forward) forward_slot[op.block] = op.slot;
            if (op.kind == Op::Kind::backward) {
              ++backwards;
              EXPECT_EQ(op.slot, forward_slot[op.block]) << s.describe() << " block " << op.block;
            }
          }
          EXPECT_EQ(backwards, mode == Mode::training ? n : 0) << s.describe();
        }
      }
    }
  }
}

// Note [training rotation]: R rotating slots carry K+R blocks; a forward after a forward and a
// backward after a backward reload R of them, the seed's layout min(K, N-K).
TEST(Schedule, TrainingRotationReloadsRAtEachTurn) {
  using enum Op::Kind;
  for (int64_t n = 2; n <= 32; ++n) {
    for (int64_t k = 1; k <= n - 1; ++k) {
      const int64_t seed_r = std::min(k, n - k);
      for (int64_t r = 0; r <= n - k; ++r) {
        const Schedule s({n, k, Mode::training, r});
        const int64_t rr = r == 0 ? seed_r : std::min(r, seed_r);
        ASSERT_EQ(s.rotating_slots(), rr) << s.describe();
        EXPECT_EQ(s.loads(std::vector{forward, backward}), 2 * k) << s.describe();
        EXPECT_EQ(s.loads(std::vector{forward, forward, backward, backward}), 4 * k + 2 * rr)
            << s.describe();
        EXPECT_EQ(s.loads(std::vector{forward, forward, forward}), 3 * k + 2 * rr) << s.describe();
        // Only the rotating blocks move; each in one slot, every pass.
        int64_t moving = 0;
        for (int64_t b = 0; b < n; ++b) {
          moving += !s.after_forward(b).empty() || s.initial_slots()[b] < 0;
        }
        EXPECT_EQ(moving, k + rr) << s.describe();
      }
    }
  }
}

TEST(Schedule, PipelineHalvesAreTheSchedulesOrder) {
  using enum Op::Kind;
  using H = std::vector<Op::Kind>;
  EXPECT_EQ(pipeline_halves(PipelineSchedule::gpipe, 2, 1, 3),
            (H{forward, forward, forward, backward, backward, backward}));
  // 1F1B: stage s of S warms up with min(S-s, M) forwards.
  EXPECT_EQ(pipeline_halves(PipelineSchedule::one_f_one_b, 2, 0, 4),
            (H{forward, forward, backward, forward, backward, forward, backward, backward}));
  EXPECT_EQ(pipeline_halves(PipelineSchedule::one_f_one_b, 2, 1, 3),
            (H{forward, backward, forward, backward, forward, backward}));
  EXPECT_EQ(pipeline_halves(PipelineSchedule::one_f_one_b, 4, 0, 2),
            (H{forward, forward, backward, backward}));
  EXPECT_THROW(pipeline_halves(PipelineSchedule::gpipe, 2, 2, 3), InvalidArgument);
  EXPECT_THROW(pipeline_halves(PipelineSchedule::gpipe, 2, 0, 0), InvalidArgument);
  const Schedule s({8, 3, Mode::forward_only});
  EXPECT_THROW(s.loads(H{forward}), InvalidArgument);
}

// Note [rotation]: each load hides behind the compute of the blocks between the slot's
// previous occupant and the block loaded. Spread evenly, that is at least floor(R*N/M) - 1
// blocks for every load, where a contiguous run of rotating blocks would give R-1.
TEST(Schedule, RotatingBlocksAreSpreadBetweenFixedOnes) {
  for (int64_t n = 2; n <= 48; ++n) {
    for (int64_t k = 1; k <= n - 1; ++k) {
      for (int64_t r = 1; r <= n - k; ++r) {
        Schedule s({n, k, Mode::forward_only, r});
        const int64_t m = k + r;
        for (int64_t b = 0; b < n; ++b) {
          for (const Move& move : s.after_forward(b)) {
            const int64_t hidden = (move.in - move.out - 1 + n) % n; // blocks computed between
            EXPECT_GE(hidden, r * n / m - 1)
                << s.describe() << " move " << move.out << "->" << move.in;
          }
        }
      }
    }
  }
}

TEST(Schedule, DefaultRotationUsesTwoSlots) {
  Schedule s({24, 6, Mode::forward_only});
  EXPECT_EQ(s.rotating_slots(), 2);
  EXPECT_EQ(s.loads_per_pass(), 8);
  EXPECT_EQ(Schedule({24, 23, Mode::forward_only}).rotating_slots(), 1);
}

TEST(Schedule, FullRotationIsTheSeedsCyclicScheme) {
  const int64_t n = 10, k = 4;
  Schedule s({n, k, Mode::forward_only, n - k});
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(s.after_forward(i).size(), 1u);
    EXPECT_EQ(s.after_forward(i)[0], (Move{i, (n - k + i) % n}));
    EXPECT_EQ(s.initial_slots()[i] >= 0, i < n - k);
  }
}

TEST(Schedule, TrainingMovesAreTheSeeds) {
  const int64_t n = 8, k = 3;
  for (Algorithm algorithm : {Algorithm::seed, Algorithm::blockswap}) {
    Schedule s({n, k, Mode::training, 0, algorithm});
    EXPECT_FALSE(s.writes_back() && algorithm == Algorithm::blockswap);
    EXPECT_EQ(s.after_forward(0)[0], (Move{0, 5}));
    EXPECT_EQ(s.after_forward(2)[0], (Move{2, 7}));
    EXPECT_TRUE(s.after_forward(3).empty());
  }
  // The seed hands block 7's slot back to block 2 after block 6's backward (p = 1) ...
  Schedule seed({n, k, Mode::training, 0, Algorithm::seed});
  EXPECT_TRUE(seed.after_backward(7).empty());
  EXPECT_EQ(seed.after_backward(6)[0], (Move{7, 2}));
  EXPECT_EQ(seed.after_backward(4)[0], (Move{5, 0})); // p = K
  EXPECT_TRUE(seed.after_backward(3).empty());
  // ... blockswap as soon as block 7's own backward is done.
  Schedule ours({n, k, Mode::training});
  EXPECT_EQ(ours.after_backward(7)[0], (Move{7, 2}));
  EXPECT_EQ(ours.after_backward(5)[0], (Move{5, 0}));
  EXPECT_TRUE(ours.after_backward(4).empty());
}

// In backward, a load hides behind the blocks differentiated between the move and the block's
// own backward: N-K-1 for blockswap, one fewer for the seed.
TEST(Schedule, BackwardLoadsHideBehindOneMoreBlockThanTheSeeds) {
  for (int64_t n = 3; n <= 24; ++n) {
    for (int64_t k = 1; k <= n - 2; ++k) {
      for (Algorithm algorithm : {Algorithm::blockswap, Algorithm::seed}) {
        Schedule s({n, k, Mode::training, 0, algorithm});
        for (int64_t b = n - 1; b >= 0; --b) {
          for (const Move& m : s.after_backward(b)) {
            const int64_t hidden = b - m.in - 1; // blocks differentiated in between
            EXPECT_EQ(hidden, n - k - 1 - (algorithm == Algorithm::seed ? 1 : 0)) << s.describe();
          }
        }
      }
    }
  }
}

// The seed replay (and blockswap's training schedule) must place blocks exactly as the seed
// does after every verb, pass after pass.
TEST(Schedule, SeedReplayResidencyFollowsTheSeedsRules) {
  for (int64_t n = 1; n <= 24; ++n) {
    for (Mode mode : {Mode::forward_only, Mode::training}) {
      for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, mode); ++k) {
        for (Algorithm algorithm : {Algorithm::seed, Algorithm::blockswap}) {
          if (algorithm == Algorithm::blockswap && mode == Mode::forward_only) continue;
          if (k > Schedule::max_blocks_to_swap(n, mode, algorithm)) continue;
          Schedule s({n, k, mode, 0, algorithm});
          SeedModel seed(n, k, mode == Mode::forward_only);
          std::vector<bool> ours(n);
          for (int64_t b = 0; b < n; ++b) ours[b] = s.initial_slots()[b] >= 0;
          ASSERT_EQ(ours, seed.on_device) << s.describe();
          for (int pass = 0; pass < kPasses; ++pass) {
            for (int64_t i = 0; i < n; ++i) {
              ours = residency_after(ours, s.after_forward(i));
              seed.submit_move_blocks_forward(i);
              ASSERT_EQ(ours, seed.on_device) << s.describe() << " after forward " << i;
            }
            if (mode == Mode::forward_only) continue;
            for (int64_t b = n - 1; b >= 0; --b) {
              ours = residency_after(ours, s.after_backward(b));
              seed.after_backward(b);
              // blockswap makes each backward move one block earlier (BackwardLoadsHide...):
              // the same moves, so the residency agrees again once the step is over.
              if (algorithm == Algorithm::seed || b == 0) {
                ASSERT_EQ(ours, seed.on_device) << s.describe() << " after backward " << b;
              }
            }
          }
        }
      }
    }
  }
}

TEST(Schedule, SeedReplayCopiesBackAndRotatesEveryBlock) {
  Schedule s({24, 6, Mode::forward_only, 0, Algorithm::seed});
  EXPECT_TRUE(s.writes_back());
  EXPECT_TRUE(s.host_waits());
  EXPECT_EQ(s.loads_per_pass(), 24);
  EXPECT_EQ(Schedule({24, 6, Mode::training, 0, Algorithm::seed}).loads_per_pass(), 12);
}

void expect_error(const ScheduleOptions& options, const std::vector<std::string>& parts) {
  try {
    Schedule s(options);
    ADD_FAILURE() << "no error for " << s.describe();
  } catch (const Error& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << e.what() << "' does not mention '" << part << "'";
    }
  }
}

TEST(Schedule, KOutOfRangeIsAnErrorNamingNKAndTheMode) {
  expect_error({8, 8, Mode::forward_only}, {"N=8", "K=8", "forward-only", "K <= 7"});
  expect_error({8, -1, Mode::forward_only}, {"N=8", "K=-1", "forward-only"});
  expect_error({8, 8, Mode::training}, {"N=8", "K=8", "training", "K <= 7"});
  expect_error({1, 1, Mode::forward_only}, {"N=1", "K=1"});
  expect_error({0, 0, Mode::forward_only}, {"N=0"});
  expect_error({8, 2, Mode::forward_only, 7}, {"R=7", "N-K = 6"});
  EXPECT_NO_THROW(Schedule({8, 7, Mode::forward_only}));
  EXPECT_NO_THROW(Schedule({8, 7, Mode::training})); // one slot: musubi-tuner accepts N-1
  EXPECT_NO_THROW(Schedule({1, 0, Mode::training}));
}

TEST(Schedule, NoSwapMeansNoMoves) {
  Schedule s({5, 0, Mode::training});
  EXPECT_EQ(s.slots(), 5);
  for (const Op& op : s.pass()) EXPECT_NE(op.kind, Op::Kind::move);
}

TEST(Schedule, BlockIndexOutOfRangeIsAnError) {
  Schedule s({4, 1, Mode::forward_only});
  EXPECT_THROW(s.after_forward(4), Error);
  EXPECT_THROW(s.after_backward(-1), Error);
}

} // namespace
} // namespace blockswap
