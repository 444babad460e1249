#include "blockswap/core/schedule.hpp"

#include <algorithm>
#include <utility>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"

namespace blockswap {

const char* to_string(Mode mode) {
  return mode == Mode::training ? "training" : "forward-only";
}

const char* to_string(Algorithm algorithm) {
  return algorithm == Algorithm::seed ? "seed" : "blockswap";
}

int64_t Schedule::max_blocks_to_swap(int64_t blocks, Mode mode, Algorithm algorithm) {
  // One slot to stream through, in either mode (DESIGN.md trap 3: musubi-tuner accepts N-1 in
  // training). With one slot in training every load waits for the compute before it, so
  // nothing overlaps, but each block still computes its backward in the slot its forward used.
  // The seed's own training moves hand a slot back one backward late (build_training): with
  // one slot, block 0's backward would find block 1 there, so its replay stops at N-2.
  const bool late = algorithm == Algorithm::seed && mode == Mode::training;
  return std::max<int64_t>(0, blocks - (late ? 2 : 1));
}

void Schedule::check(int64_t blocks, int64_t blocks_to_swap, Mode mode, Algorithm algorithm) {
  BLOCKSWAP_CHECK_ARGUMENT(blocks >= 1, "a model needs at least one block, got N=", blocks);
  const int64_t max_k = max_blocks_to_swap(blocks, mode, algorithm);
  BLOCKSWAP_CHECK_ARGUMENT(
      blocks_to_swap >= 0 && blocks_to_swap <= max_k, "blocks_to_swap K=", blocks_to_swap,
      " is out of range for N=", blocks, " blocks in ", to_string(mode), " mode",
      algorithm == Algorithm::seed ? " (the seed's schedule)" : "", ": expected 0 <= K <= ", max_k);
}

void Schedule::check(const ScheduleOptions& options) {
  check(options.blocks, options.blocks_to_swap, options.mode, options.algorithm);
  // Training: any R >= min(K, N-K) is the seed's layout, so only a negative R is wrong.
  if (options.mode == Mode::training || options.algorithm == Algorithm::seed) {
    BLOCKSWAP_CHECK_ARGUMENT(options.rotating_slots >= 0,
                             "rotating slots R=", options.rotating_slots,
                             " must be >= 0 (0: the seed's layout)");
    return;
  }
  // Checked with K = 0 too (R is unused then), so that a configuration does not fail only once
  // K is raised.
  if (options.rotating_slots == 0) return;
  const int64_t max_r = options.blocks - options.blocks_to_swap;
  BLOCKSWAP_CHECK_ARGUMENT(options.rotating_slots >= 1 && options.rotating_slots <= max_r,
                           "rotating_slots R=", options.rotating_slots,
                           " is out of range for N=", options.blocks,
                           ", K=", options.blocks_to_swap, ": expected 1 <= R <= N-K = ", max_r);
}

Schedule::Schedule(const ScheduleOptions& options)
    : blocks_(options.blocks), blocks_to_swap_(options.blocks_to_swap), mode_(options.mode),
      algorithm_(options.algorithm) {
  check(options);
  slots_ = layout::slot_count(blocks_, blocks_to_swap_);
  initial_slots_.assign(blocks_, -1);
  forward_moves_.resize(blocks_);
  backward_moves_.resize(blocks_);

  if (blocks_to_swap_ == 0) {
    for (int64_t b = 0; b < blocks_; ++b) initial_slots_[b] = b;
    return;
  }
  if (mode_ == Mode::training) {
    const int64_t seed_r = std::min(blocks_to_swap_, blocks_ - blocks_to_swap_);
    rotating_slots_ = options.rotating_slots == 0 || algorithm_ == Algorithm::seed
                          ? seed_r
                          : std::min(options.rotating_slots, seed_r);
    if (rotating_slots_ == seed_r) {
      build_training();
    } else {
      build_training_rotation();
    }
    return;
  }
  const int64_t max_r = blocks_ - blocks_to_swap_;
  if (algorithm_ == Algorithm::seed) {
    rotating_slots_ = max_r;
  } else if (options.rotating_slots == 0) {
    rotating_slots_ = layout::default_rotating_slots(blocks_, blocks_to_swap_);
  } else {
    rotating_slots_ = options.rotating_slots;
  }
  build_forward_only();
}

// The K+R rotating blocks r_0 < ... spread evenly among the N (Note [rotation]), r_0..r_{R-1}
// in slots 0..R-1 and the blocks that never move in the slots after them.
std::vector<int64_t> Schedule::spread_rotating() {
  const int64_t rotating = blocks_to_swap_ + rotating_slots_;
  std::vector<int64_t> order(rotating);
  std::vector<bool> rotates(blocks_, false);
  for (int64_t j = 0; j < rotating; ++j) {
    order[j] = j * blocks_ / rotating; // strictly increasing because rotating <= blocks_
    rotates[order[j]] = true;
    if (j < rotating_slots_) initial_slots_[order[j]] = j;
  }
  int64_t fixed_slot = rotating_slots_;
  for (int64_t b = 0; b < blocks_; ++b) {
    if (!rotates[b]) initial_slots_[b] = fixed_slot++;
  }
  BLOCKSWAP_ASSERT(fixed_slot == slots_, "fixed slots ", fixed_slot, " != ", slots_);
  return order;
}

// Note [rotation]
// Forward-only, K blocks do not fit. R slots are set aside for rotation and the other N-K-R
// slots hold blocks that never move. M = K+R blocks rotate: r_0 < r_1 < ... < r_{M-1}; prepare
// loads r_0..r_{R-1}. After r_j's forward, its slot receives r_{(j+R) mod M}: the
// next rotating block that uses that slot, possibly in the next pass. (When R does not divide
// M, a block meets a different slot in each pass; the engine follows the moves, not slot
// numbers.) Every rotating block is
// loaded once per pass, so a pass loads K+R blocks (the seed loads all N).
//
// The load into a slot can start once the previous occupant's compute has finished and must
// end before the new occupant's compute starts, so it hides behind the compute of the blocks
// in between. Spreading the rotating blocks evenly between the fixed ones maximises the
// smallest such gap; a contiguous run would give each load the compute of about R-1 blocks.
// With R = N-K every block rotates (r_j = j), which is exactly the seed's cyclic scheme.
void Schedule::build_forward_only() {
  const std::vector<int64_t> order = spread_rotating();
  const auto rotating = static_cast<int64_t>(order.size());
  for (int64_t j = 0; j < rotating; ++j) {
    forward_moves_[order[j]].push_back(Move{order[j], order[(j + rotating_slots_) % rotating]});
  }
  loads_per_pass_ = layout::loads_per_pass(blocks_to_swap_, mode_, rotating_slots_);
}

// The seed's training moves (DESIGN.md section 1). Blocks 0..N-K-1 start in slots 0..N-K-1.
// Forward: after block i < K, block N-K+i takes slot i. Backward: with p = 1..K, block
// N-p (which borrowed slot K-p in forward) hands the slot back to block K-p.
//
// The seed makes that move after the backward of block N-p-1, the hook it has; but block N-p
// was done one block earlier, after its own backward. blockswap moves then, which gives each
// backward load the compute of one more block to hide behind (N-K-1 blocks instead of
// N-K-2: with two slots, the seed's backward loads cannot overlap at all). The seed replay
// keeps the seed's timing.
void Schedule::build_training() {
  const int64_t n = blocks_;
  const int64_t k = blocks_to_swap_;
  for (int64_t b = 0; b < n - k; ++b) initial_slots_[b] = b;
  for (int64_t i = 0; i < k; ++i) forward_moves_[i].push_back(Move{i, n - k + i});
  const int64_t delay = algorithm_ == Algorithm::seed ? 1 : 0;
  for (int64_t p = 1; p <= k; ++p) {
    backward_moves_[n - p - delay].push_back(Move{n - p, k - p});
  }
  loads_per_pass_ = layout::loads_per_pass(k, mode_, 0);
}

// Note [training rotation]
// A pipeline stage runs several forwards before their backwards (1F1B's warm-up, GPipe), and
// every backward needs each block in the slot its forward ran in (Note [exact backward] in
// engine_training.cpp), so every micro-batch uses the same slots. A forward after a forward
// then reloads every block that moves: prepare() puts back the blocks the pass starts with
// (the ones the last forward evicted) and the forward evicts them again; a backward after a
// backward does the same in reverse. With the seed's layout that is K blocks each way, 2K per
// such turn on top of the plan's 2K per micro-batch.
//
// With R rotating slots (R < min(K, N-K)) only the K+R rotating blocks r_0 < ... < r_{K+R-1}
// move, r_j always in slot j mod R: prepare loads r_0..r_{R-1}; after r_j's forward its slot
// receives r_{j+R}; after r_{j+R}'s backward, r_j comes back. A pass still loads K blocks each
// way, and a turn costs R reloads instead of K. The price is overlap: r_{j+R}'s load hides
// behind the compute of the blocks between r_j and r_{j+R}, about R*N/(K+R) - 1 of them,
// against N-K-1 in the seed's layout; so the rotating blocks are spread evenly between the
// blocks that never move (Note [rotation] does the same for forward-only passes).
void Schedule::build_training_rotation() {
  const std::vector<int64_t> order = spread_rotating();
  const auto rotating = static_cast<int64_t>(order.size());
  for (int64_t j = 0; j < rotating; ++j) {
    if (j + rotating_slots_ < rotating) {
      forward_moves_[order[j]].push_back(Move{order[j], order[j + rotating_slots_]});
      backward_moves_[order[j + rotating_slots_]].push_back(
          Move{order[j + rotating_slots_], order[j]});
    }
  }
  loads_per_pass_ = layout::loads_per_pass(blocks_to_swap_, mode_, 0);
}

std::span<const Move> Schedule::after_forward(int64_t block) const {
  detail::check_block_index("", block, blocks_);
  return forward_moves_[block];
}

std::span<const Move> Schedule::after_backward(int64_t block) const {
  detail::check_block_index("", block, blocks_);
  return backward_moves_[block];
}

std::vector<Op> Schedule::pass() const {
  std::vector<Op> ops;
  std::vector<int64_t> slot = initial_slots_;
  auto emit = [&](Op::Kind kind, int64_t block, std::span<const Move> moves) {
    ops.push_back(Op{kind, block, {}, slot[block]});
    for (const Move& m : moves) {
      slot[m.in] = std::exchange(slot[m.out], -1);
      ops.push_back(Op{Op::Kind::move, block, m, slot[m.in]});
    }
  };
  for (int64_t b = 0; b < blocks_; ++b) emit(Op::Kind::forward, b, forward_moves_[b]);
  if (mode_ == Mode::training) {
    for (int64_t b = blocks_ - 1; b >= 0; --b) emit(Op::Kind::backward, b, backward_moves_[b]);
  }
  return ops;
}

std::vector<int64_t> Schedule::slots_after_forward() const {
  BLOCKSWAP_CHECK_ARGUMENT(mode_ == Mode::training, "slots_after_forward: a ", describe(),
                           " has no backward");
  std::vector<int64_t> slot = initial_slots_;
  for (int64_t b = 0; b < blocks_; ++b) {
    for (const Move& m : forward_moves_[b]) slot[m.in] = std::exchange(slot[m.out], -1);
  }
  return slot;
}

std::vector<Move> Schedule::turn_moves(Op::Kind half) const {
  BLOCKSWAP_CHECK_ARGUMENT(mode_ == Mode::training && half != Op::Kind::move,
                           "turn_moves: a training schedule's forward or backward half");
  const std::vector<int64_t> after_forward = slots_after_forward();
  std::vector<int64_t> first(slots_, -1), last(slots_, -1);
  for (int64_t b = 0; b < blocks_; ++b) {
    if (initial_slots_[b] >= 0) first[initial_slots_[b]] = b;
    if (after_forward[b] >= 0) last[after_forward[b]] = b;
  }
  std::vector<Move> moves;
  for (int64_t s = 0; s < slots_; ++s) {
    if (first[s] == last[s]) continue;
    moves.push_back(half == Op::Kind::forward ? Move{last[s], first[s]} : Move{first[s], last[s]});
  }
  const bool forward = half == Op::Kind::forward;
  std::sort(moves.begin(), moves.end(), [forward](const Move& a, const Move& b) {
    return forward ? a.in < b.in : a.in > b.in;
  });
  return moves;
}

int64_t Schedule::loads(std::span<const Op::Kind> halves) const {
  BLOCKSWAP_CHECK_ARGUMENT(mode_ == Mode::training, "loads: a ", describe(), " has no backward");
  const std::vector<int64_t> after_forward = slots_after_forward();
  std::vector<bool> resident(blocks_);
  for (int64_t b = 0; b < blocks_; ++b) resident[b] = initial_slots_[b] >= 0;
  int64_t loads = 0;
  // The blocks `wanted` names on the device, counting those that were not; then the moves.
  auto play = [&](const std::vector<int64_t>& wanted, const std::vector<std::vector<Move>>& moves,
                  bool forward) {
    for (int64_t b = 0; b < blocks_; ++b) {
      if (wanted[b] >= 0 && !resident[b]) ++loads;
      resident[b] = wanted[b] >= 0;
    }
    for (int64_t i = 0; i < blocks_; ++i) {
      for (const Move& m : moves[forward ? i : blocks_ - 1 - i]) {
        resident[m.out] = false;
        if (!resident[m.in]) ++loads;
        resident[m.in] = true;
      }
    }
  };
  for (const Op::Kind half : halves) {
    BLOCKSWAP_CHECK_ARGUMENT(half != Op::Kind::move,
                             "loads: a step is made of forward and backward halves");
    if (half == Op::Kind::forward) {
      play(initial_slots_, forward_moves_, true);
    } else {
      play(after_forward, backward_moves_, false);
    }
  }
  return loads;
}

const char* to_string(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::gpipe ? "GPipe" : "1F1B";
}

std::vector<Op::Kind> pipeline_halves(PipelineSchedule schedule, int64_t stages, int64_t stage,
                                      int64_t micro_batches) {
  BLOCKSWAP_CHECK_ARGUMENT(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1,
                           "a pipeline of ", stages, " stages and ", micro_batches,
                           " micro-batches has no stage ", stage,
                           ": expected stages >= 1, 0 <= stage < stages, micro-batches >= 1");
  using enum Op::Kind;
  std::vector<Op::Kind> halves;
  const int64_t warmup =
      schedule == PipelineSchedule::gpipe ? micro_batches : std::min(stages - stage, micro_batches);
  halves.assign(warmup, forward);
  for (int64_t i = warmup; i < micro_batches; ++i) {
    halves.push_back(backward);
    halves.push_back(forward);
  }
  halves.insert(halves.end(), warmup, backward);
  return halves;
}

std::string Schedule::describe() const {
  return detail::concat(to_string(algorithm_), " schedule, ", to_string(mode_), ", N=", blocks_,
                        ", K=", blocks_to_swap_, ", slots=", slots_, ", R=", rotating_slots_,
                        ", loads per pass=", loads_per_pass_);
}

} // namespace blockswap
