// The schedule: which block moves where, and when, for N blocks of which K are swapped.
//
// Pure data, no threads, no devices. The engine (engine.hpp) executes it on a backend.
//
// A schedule places blocks in `slots()` fixed device slots. After a block's forward (or, when
// training, its backward) the engine performs that block's moves: each evicts the block in a
// slot and loads another block from host memory into the same slot. See DESIGN.md section 1 for
// the seed's rules and Note [rotation] in schedule.cpp for the forward-only rotation.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace blockswap {

enum class Mode {
  forward_only, // inference: blocks are computed in order 0..N-1, pass after pass
  training,     // forward 0..N-1, then backward N-1..0
};
const char* to_string(Mode mode);

enum class Algorithm {
  blockswap, // only missing blocks load; frozen weights are never copied back
  seed,      // the seed's exchange swap replayed exactly: every eviction copies the block back,
             // forward-only rotates every block, and waits block the host
};
const char* to_string(Algorithm algorithm);

// Evict block `out`, then load block `in` into the slot `out` occupied. Which slot that is
// depends on the history: in forward-only rotation a block may use a different slot each pass.
struct Move {
  int64_t out = -1;
  int64_t in = -1;
  friend bool operator==(const Move&, const Move&) = default;
};

struct ScheduleOptions {
  int64_t blocks = 0;         // N
  int64_t blocks_to_swap = 0; // K: blocks left in host memory by prepare
  Mode mode = Mode::forward_only;
  // Forward-only: the number R of slots that blocks rotate through, 1 <= R <= N-K; K+R blocks
  // load per pass. 0 picks the default, min(2, N-K). R = N-K is the seed's cyclic scheme.
  // Training: R < min(K, N-K) rotates K+R blocks through R slots (Note [training rotation] in
  // schedule.cpp: a forward after a forward, or a backward after a backward, reloads R blocks
  // instead of K); 0, or R >= min(K, N-K), is the seed's layout. Ignored by Algorithm::seed.
  int64_t rotating_slots = 0;
  Algorithm algorithm = Algorithm::blockswap;
};

// One step of a whole pass, for tests, simulation and benchmarks.
struct Op {
  enum class Kind { forward, backward, move };
  Kind kind = Kind::forward;
  int64_t block = -1; // the block computed, or for a move the block whose compute triggered it
  Move move{};        // Kind::move only
  int64_t slot = -1;  // the slot the block is computed in, or the slot a move refills
};

class Schedule {
public:
  // Throws blockswap::InvalidArgument naming N, K and the mode when K is out of range (check).
  explicit Schedule(const ScheduleOptions& options);

  // The largest valid K: N-1 in either mode (0 when N < 2); the seed's replay trains to N-2.
  static int64_t max_blocks_to_swap(int64_t blocks, Mode mode,
                                    Algorithm algorithm = Algorithm::blockswap);
  // Throws blockswap::InvalidArgument unless 0 <= K <= max_blocks_to_swap(N, mode, algorithm)
  // and N >= 1.
  static void check(int64_t blocks, int64_t blocks_to_swap, Mode mode,
                    Algorithm algorithm = Algorithm::blockswap);
  // That, and R in range (forward-only, Algorithm::blockswap, R > 0: 1 <= R <= N-K; else
  // R >= 0).
  static void check(const ScheduleOptions& options);

  int64_t blocks() const { return blocks_; }
  int64_t blocks_to_swap() const { return blocks_to_swap_; }
  Mode mode() const { return mode_; }
  Algorithm algorithm() const { return algorithm_; }
  int64_t slots() const { return slots_; } // device slots: N-K (N when K=0)
  // R: forward-only, the slots blocks rotate through; training, min(K, N-K) in the seed's
  // layout, else the rotating slots asked for. 0 when K = 0.
  int64_t rotating_slots() const { return rotating_slots_; }
  // Seed replay: every eviction copies the block back, and the host blocks on every wait.
  bool writes_back() const { return algorithm_ == Algorithm::seed; }
  bool host_waits() const { return algorithm_ == Algorithm::seed; }

  // A slot for each block that prepare places on the device, -1 for a block left in host
  // memory. Later the moves decide the slots.
  const std::vector<int64_t>& initial_slots() const { return initial_slots_; }
  // Moves to perform after block `block`'s forward / backward (empty in forward-only mode).
  std::span<const Move> after_forward(int64_t block) const;
  std::span<const Move> after_backward(int64_t block) const;

  // Blocks loaded from host memory per pass (forward-only: K+R) or step (training: 2K).
  int64_t loads_per_pass() const { return loads_per_pass_; }
  // The whole pass (forward-only) or step (forward then backward), moves in place, each op
  // with its slot: which block sits in which slot when. In training every block is computed
  // in the same slot in its backward as in its forward (Note [exact backward] in
  // engine_training.cpp).
  std::vector<Op> pass() const;
  std::string describe() const;

  // Training: the slot of each block on the device once a forward is over, -1 for the others
  // (where a backward finds them).
  std::vector<int64_t> slots_after_forward() const;
  // Training: the blocks loaded over a sequence of halves (Op::Kind::forward, a pass of the
  // blocks forward; Op::Kind::backward, the same in reverse) from the steady state (the blocks
  // a pass starts with on the device), as the engine loads them: a forward first puts back the
  // blocks a pass starts with, a backward those a forward ends with, then the moves run. A
  // micro-batch's forward then its backward loads 2K; a forward after a forward, or a backward
  // after a backward, R more (Note [training rotation]). Throws InvalidArgument for a move in
  // `halves` or in forward-only mode.
  int64_t loads(std::span<const Op::Kind> halves) const;
  // Training: the moves a turn makes before its half starts, slot by slot: a forward after a
  // forward (Op::Kind::forward) puts back the blocks a pass starts with where the last forward
  // ended with others, in block order; a backward after a backward (Op::Kind::backward) the
  // reverse, from the last block down. R moves (Note [training rotation]).
  std::vector<Move> turn_moves(Op::Kind half) const;

private:
  void build_forward_only();
  void build_training();
  void build_training_rotation();
  std::vector<int64_t> spread_rotating();

  int64_t blocks_;
  int64_t blocks_to_swap_;
  Mode mode_;
  Algorithm algorithm_;
  int64_t slots_ = 0;
  int64_t rotating_slots_ = 0;
  int64_t loads_per_pass_ = 0;
  std::vector<int64_t> initial_slots_;
  std::vector<std::vector<Move>> forward_moves_;
  std::vector<std::vector<Move>> backward_moves_;
};

// The pipeline schedules a stage's halves follow (torch.distributed.pipelining's): GPipe runs
// every micro-batch forward, then every one backward; 1F1B runs min(S-s, M) forwards on stage
// s of S, then one backward and one forward in turn, then the backwards left.
enum class PipelineSchedule { gpipe, one_f_one_b };
const char* to_string(PipelineSchedule schedule);
// Stage `stage`'s halves in one step of `micro_batches` (InvalidArgument when out of range).
std::vector<Op::Kind> pipeline_halves(PipelineSchedule schedule, int64_t stages, int64_t stage,
                                      int64_t micro_batches);

} // namespace blockswap
