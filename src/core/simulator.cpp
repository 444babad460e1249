#include "blockswap/core/simulator.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>

#include "blockswap/core/activation_rule.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "simulated_lists.hpp"

namespace blockswap {
namespace {

using namespace simulated;

// Note [simulated engine]
// The clock follows what the engine enqueues (engine.cpp), op by op of Schedule::pass():
//  - a computation waits for its block's load (an event on the copy stream) and, for the seed
//    replay, for the host, which waited for that load itself (host_waits);
//  - a move evicts the slot's occupant: the copy stream waits for the compute stream to finish
//    it (an event recorded after the block whose compute triggered the move); the seed replay's
//    host waits for that too and copies the occupant back first; then the load;
//  - a copy starts when the copy stream is free and the host has enqueued it;
//  - a compressed load (BlockTiming::compressed_bytes) copies into one of its list's two decode
//    buffers once the decode out of it before is done, and is ready when the decode stream,
//    after that copy and the decode before, has decoded it (Note [a decode step] in
//    load_pipeline.cpp); with !LinkModel::decode_stream the decode runs on the copy stream.
// Blocks on the device at the start of the step are loaded already (the steady state).
class VirtualClock {
public:
  explicit VirtualClock(const LinkModel& link)
      : link_(link), staging_(static_cast<std::size_t>(std::max(1, link.staging_buffers)), 0.0) {}

  void play(const SimulatedList& list, bool backward, ListSimulation& out, double weight) {
    play(list, ops(*list.schedule, backward), backward, out, weight);
  }

  // `ops` of one half: a move evicts what the compute stream has run so far; a move before the
  // half's first compute (a turn's, Schedule::turn_moves) too.
  void play(const SimulatedList& list, const std::vector<Op>& ops, bool backward,
            ListSimulation& out, double weight) {
    const Schedule& schedule = *list.schedule;
    const BlockTiming& timing = *list.timing;
    const auto n = static_cast<std::size_t>(schedule.blocks());
    if (ready_.size() < offset_ + n) ready_.resize(offset_ + n, 0.0);
    for (const Op& op : ops) {
      if (op.kind == Op::Kind::move) {
        move(schedule, timing, op, weight);
        continue;
      }
      double& ready = ready_[offset_ + op.block];
      if (schedule.host_waits()) host_ = std::max(host_, ready);
      const std::size_t g = offset_ + static_cast<std::size_t>(op.block);
      const bool training = activations_ && schedule.mode() != Mode::forward_only;
      if (training && op.kind == Op::Kind::forward)
        offload_previous(g, activation_bytes(timing, op.block));
      double start = std::max({compute_, host_, ready});
      if (training && op.kind == Op::Kind::backward) start = restore_for_backward(g, start);
      (backward ? out.backward_stall_seconds : out.forward_stall_seconds)[op.block] +=
          weight * (start - compute_);
      stall_ += weight * (start - compute_);
      const double busy = compute_seconds(timing, op);
      busy_compute_ += weight * busy;
      compute_ = start + busy;
    }
  }

  double compute_end() const { return compute_; }

  // Several micro-batches in flight: no offloaded activations (simulate_halves).
  void without_activations() { activations_ = false; }

  // Training: a step ends when nothing is in flight on any stream (time_step's finish()).
  double step_end() const { return std::max({compute_, copy_, host_, d2h_, decode_}); }

  // Training, the next step of a sequence (Note [training steps in sequence]): every stream
  // starts where the step before ended; the disk and the staging ring go on, and the
  // activations start over, as the front end's hooks do at each step.
  void start_next_step() {
    compute_ = copy_ = host_ = d2h_ = decode_ = step_end();
    rule_ = ActivationRule{};
    std::fill(activation_bytes_.begin(), activation_bytes_.end(), 0);
    std::fill(out_end_.begin(), out_end_.end(), 0.0);
    std::fill(act_ready_.begin(), act_ready_.end(), 0.0);
  }

  // Where everything stands, relative to the compute stream: equal at the ends of two chunks
  // means the steady state.
  std::vector<double> relative_state() const {
    // Anything at or before the compute stream's time waits for nothing any more: 0.
    std::vector<double> state{std::max(0.0, copy_ - compute_), std::max(0.0, host_ - compute_),
                              std::max(0.0, disk_ - compute_), std::max(0.0, decode_ - compute_)};
    for (const auto& [list, buffers] : decode_buffers_) {
      for (int i = 0; i < 2; ++i) {
        state.push_back(std::max(0.0, buffers.free[(buffers.next + i) % 2] - compute_));
      }
    }
    for (double ready : ready_) state.push_back(std::max(0.0, ready - compute_));
    for (std::size_t i = 0; i < staging_.size(); ++i) {
      state.push_back(std::max(0.0, staging_[(next_staging_ + i) % staging_.size()] - compute_));
    }
    return state;
  }

  void reset_counters() { stall_ = busy_compute_ = busy_link_ = busy_disk_ = busy_decode_ = 0; }

  // The schedule's lists take turns on one device: each list's blocks have their own entries.
  void next_list(std::size_t blocks) { offset_ += blocks; }
  void restart_lists() { offset_ = 0; }

  Simulation result() const {
    Simulation s;
    s.step_seconds = std::max({compute_, copy_, host_, d2h_, decode_});
    s.compute_seconds = busy_compute_;
    s.stall_seconds = stall_;
    s.link_busy_seconds = busy_link_;
    s.decode_busy_seconds = busy_decode_;
    s.disk_busy_seconds = busy_disk_;
    s.d2h_busy_seconds = busy_d2h_;
    return s;
  }

private:
public:
  // The forward half of a step's ops, or the backward half.
  static std::vector<Op> ops(const Schedule& schedule, bool backward) {
    std::vector<Op> all = schedule.pass();
    std::vector<Op> half;
    bool in_backward = false;
    for (const Op& op : all) {
      if (op.kind == Op::Kind::backward) in_backward = true;
      if (in_backward == backward) half.push_back(op);
    }
    return half;
  }

private:
  // Block g's forward starts: the groups that go out now (Note [offloaded activations] in
  // core/activation_rule.hpp) go after what the compute stream has run so far.
  void offload_previous(std::size_t g, std::size_t bytes) {
    grow_activations(g);
    for (const ActivationRule::Group out : rule_.open(g)) {
      const auto p = static_cast<std::size_t>(out);
      double& channel = link_.duplex ? d2h_ : copy_;
      channel = std::max(channel, compute_) + link_.seconds(activation_bytes_[p]);
      (link_.duplex ? busy_d2h_ : busy_link_) += link_.seconds(activation_bytes_[p]);
      out_end_[p] = channel;
    }
    activation_bytes_[g] = bytes;
    if (bytes > 0) rule_.saved(g);
  }

  // Block g's backward is about to start at `start`: its activations must be back (brought
  // now if nothing did), and the group the rule names starts coming back.
  double restore_for_backward(std::size_t g, double start) {
    grow_activations(g);
    const ActivationRule::Restore r = rule_.backward_starts(g);
    if (r.own) restore(g, start);
    if (rule_.out(g)) start = std::max(start, act_ready_[g]);
    if (r.ahead) restore(static_cast<std::size_t>(*r.ahead), start);
    return start;
  }

  void restore(std::size_t g, double after) {
    copy_ = std::max({copy_, after, out_end_[g]}) + link_.seconds(activation_bytes_[g]);
    busy_link_ += link_.seconds(activation_bytes_[g]);
    act_ready_[g] = copy_;
  }

  void grow_activations(std::size_t g) {
    if (activation_bytes_.size() > g) return;
    activation_bytes_.resize(g + 1, 0);
    out_end_.resize(g + 1, 0.0);
    act_ready_.resize(g + 1, 0.0);
  }

  void copy(std::size_t bytes, double weight) {
    const double busy = link_.seconds(bytes);
    copy_ = std::max(copy_, host_) + busy;
    busy_link_ += weight * busy;
  }

  void move(const Schedule& schedule, const BlockTiming& timing, const Op& op, double weight) {
    const std::size_t in = timing.bytes[op.move.in];
    const bool from_file = simulated::from_file(timing, op.move.in);
    double read_end = 0;
    if (from_file) { // the read waits for the disk and a free staging buffer, not the compute
      read_end = std::max(disk_, staging_[next_staging_]) + link_.disk_seconds(in);
      busy_disk_ += weight * link_.disk_seconds(in);
      disk_ = read_end;
    }
    // The occupant's last reader is everything computed so far.
    if (schedule.host_waits()) host_ = std::max(host_, compute_);
    copy_ = std::max(copy_, compute_);
    if (schedule.writes_back()) copy(timing.bytes[op.move.out], weight);
    copy_ = std::max(copy_, read_end); // the copy out of the staging buffer waits for its read
    if (!from_file && !timing.compressed_bytes.empty()) { // the compressed bytes, then the decode
      DecodeBuffers& buffers = decode_buffers_[offset_];
      double& free = buffers.free[buffers.next];
      buffers.next = 1 - buffers.next;
      copy_ = std::max(copy_, free); // the decode out of this buffer before
      copy(timing.compressed_bytes[op.move.in], weight);
      double& decoder = link_.decode_stream ? decode_ : copy_;
      decoder = std::max(decoder, copy_) + link_.decode_seconds(in);
      busy_decode_ += weight * link_.decode_seconds(in);
      free = decoder;
      ready_[offset_ + op.move.in] = decoder;
      return;
    }
    copy(in, weight);
    if (from_file) {
      staging_[next_staging_] = copy_;
      next_staging_ = (next_staging_ + 1) % staging_.size();
    }
    ready_[offset_ + op.move.in] = copy_;
  }

  LinkModel link_;
  bool activations_ = true;
  double compute_ = 0, copy_ = 0, host_ = 0, disk_ = 0;
  double stall_ = 0, busy_compute_ = 0, busy_link_ = 0, busy_disk_ = 0;
  // Compressed weights: the decode stream, and each list's two decode buffers (by its offset_):
  // when each is free again (its last decode ended), and the one the next load copies into.
  struct DecodeBuffers {
    double free[2] = {0, 0};
    int next = 0;
  };
  double decode_ = 0, busy_decode_ = 0;
  std::map<std::size_t, DecodeBuffers> decode_buffers_;
  std::vector<double> staging_; // when each staging buffer is free again
  std::size_t next_staging_ = 0;
  std::vector<double> ready_; // when each block's last load ends
  std::size_t offset_ = 0;
  // Training with offloaded activations, per block of every list (offset_ + index).
  ActivationRule rule_;
  double d2h_ = 0, busy_d2h_ = 0;
  std::vector<std::size_t> activation_bytes_;
  std::vector<double> out_end_, act_ready_;
};

} // namespace

double LinkModel::seconds(std::size_t bytes) const {
  return latency_seconds + static_cast<double>(bytes) / bytes_per_second;
}

double LinkModel::disk_seconds(std::size_t bytes) const {
  return static_cast<double>(bytes) / disk_bytes_per_second;
}

double LinkModel::decode_seconds(std::size_t decoded_bytes) const {
  return decode_bytes_per_second > 0 ? static_cast<double>(decoded_bytes) / decode_bytes_per_second
                                     : 0.0;
}

BlockTiming uniform_timing(int64_t blocks, double forward_seconds, std::size_t bytes,
                           double backward_factor) {
  BLOCKSWAP_CHECK(blocks >= 0, "uniform_timing: blocks must be >= 0, got ", blocks);
  const auto n = static_cast<std::size_t>(blocks);
  return BlockTiming{std::vector<double>(n, forward_seconds),
                     std::vector<std::size_t>(n, bytes),
                     backward_factor,
                     {},
                     {}};
}

Simulation simulate(std::span<const SimulatedList> lists, const LinkModel& link) {
  check_lists(lists, link);
  VirtualClock clock(link);
  std::vector<ListSimulation> out;
  for (const SimulatedList& list : lists) {
    const auto n = static_cast<std::size_t>(list.schedule->blocks());
    out.push_back({std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)});
  }
  if (lists[0].schedule->mode() == Mode::forward_only) {
    const std::vector<ListSimulation> zero = out;
    std::vector<double> last_state;
    int played = 0;
    for (;;) {
      clock.reset_counters();
      out = zero;
      const double chunk_start = clock.compute_end();
      for (int pass = 0; pass < kPassesPerChunk; ++pass) {
        clock.restart_lists();
        for (std::size_t i = 0; i < lists.size(); ++i) {
          clock.play(lists[i], false, out[i], 1.0 / kPassesPerChunk);
          clock.next_list(static_cast<std::size_t>(lists[i].schedule->blocks()));
        }
      }
      played += kPassesPerChunk;
      std::vector<double> state = clock.relative_state();
      bool steady = state.size() == last_state.size();
      for (std::size_t i = 0; steady && i < state.size(); ++i) {
        steady = std::abs(state[i] - last_state[i]) <= 1e-9 * (1 + std::abs(state[i]));
      }
      if (steady || played + kPassesPerChunk > kMaxPasses) {
        Simulation result = clock.result();
        result.step_seconds = (clock.compute_end() - chunk_start) / kPassesPerChunk;
        result.lists = std::move(out);
        result.warmup_passes = played - kPassesPerChunk;
        result.steady = steady;
        // Not steady within kMaxPasses: a backlog on the link still grows (a link slower than
        // the compute by a hair), so in the long run the link sets the pace.
        if (!steady) {
          result.step_seconds = std::max(
              {result.step_seconds, result.link_busy_seconds,
               link.decode_stream ? result.decode_busy_seconds
                                  : result.link_busy_seconds + result.decode_busy_seconds});
        }
        return result;
      }
      last_state = std::move(state);
    }
  }
  // Backward goes through the lists in the reverse order; each keeps its own entries.
  std::vector<std::size_t> offsets;
  std::size_t offset = 0;
  for (const SimulatedList& list : lists) {
    offsets.push_back(offset);
    offset += static_cast<std::size_t>(list.schedule->blocks());
  }
  auto play_step = [&] {
    clock.restart_lists();
    for (std::size_t i = 0; i < lists.size(); ++i) {
      clock.play(lists[i], false, out[i], 1.0);
      clock.next_list(static_cast<std::size_t>(lists[i].schedule->blocks()));
    }
    for (std::size_t i = lists.size(); i-- > 0;) {
      clock.restart_lists();
      clock.next_list(offsets[i]);
      clock.play(lists[i], true, out[i], 1.0);
    }
  };
  bool file = false;
  for (const SimulatedList& list : lists) file = file || reads_file(list);
  if (!file) { // every step starts from the same state: one is the steady state
    play_step();
    Simulation result = clock.result();
    result.lists = std::move(out);
    return result;
  }
  // Note [training steps in sequence]
  // The file tier's reader reads the next step's first loads during the backward, as far as the
  // staging ring allows (engine_staging.cpp, read_ahead), so a step of a sequence may start with
  // reads done that the first step must wait for. Steps are played until one ends in the state
  // the previous one ended in (relative to the compute stream), and the last one is reported,
  // from the end of the step before it; time_step() plays as many before it measures.
  const std::vector<ListSimulation> zero = out;
  std::vector<double> last_state;
  double start = 0;
  for (int step = 0;; ++step) {
    clock.reset_counters();
    out = zero;
    play_step();
    const double end = clock.step_end();
    std::vector<double> state = clock.relative_state();
    bool steady = state.size() == last_state.size();
    for (std::size_t i = 0; steady && i < state.size(); ++i) {
      steady = std::abs(state[i] - last_state[i]) <= 1e-9 * (1 + std::abs(state[i]));
    }
    if (steady || step + 1 >= kMaxTrainingSteps) {
      Simulation result = clock.result();
      result.step_seconds = end - start;
      result.lists = std::move(out);
      result.warmup_passes = step;
      result.steady = steady;
      return result;
    }
    last_state = std::move(state);
    start = end;
    clock.start_next_step();
  }
}

Simulation simulate(const Schedule& schedule, const BlockTiming& timing, const LinkModel& link) {
  const SimulatedList list{&schedule, &timing};
  return simulate(std::span<const SimulatedList>(&list, 1), link);
}

// Note [halves in the simulator]
// A pipeline stage's halves as time_halves plays them on the timed device: a forward after a
// forward starts with the turn's moves (prepare() puts back the blocks a pass starts with, each
// waiting for the compute before it, the host not), a backward after a backward with its own
// (the engine's prefetch when a backward starts, Note [a backward after a backward]), each list's
// before its own half. Offloaded activations are not modelled across micro-batches.
Simulation simulate_halves(std::span<const SimulatedList> lists, std::span<const Op::Kind> halves,
                           const LinkModel& link) {
  check_lists(lists, link);
  for (const SimulatedList& list : lists) {
    BLOCKSWAP_CHECK(list.schedule->mode() == Mode::training,
                    "simulate_halves: every list must be training");
    BLOCKSWAP_CHECK(list.timing->activation_bytes.empty() && !reads_file(list),
                    "simulate_halves: offloaded activations and the file tier are not modelled "
                    "across micro-batches");
  }
  VirtualClock clock(link);
  clock.without_activations();
  std::vector<ListSimulation> out;
  std::vector<std::size_t> offsets;
  std::size_t offset = 0;
  for (const SimulatedList& list : lists) {
    const auto n = static_cast<std::size_t>(list.schedule->blocks());
    out.push_back({std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)});
    offsets.push_back(offset);
    offset += n;
  }
  auto with_turn = [](const Schedule& schedule, bool backward, bool turn, bool half_too) {
    std::vector<Op> ops;
    if (turn) {
      const Op::Kind half = backward ? Op::Kind::backward : Op::Kind::forward;
      for (const Move& m : schedule.turn_moves(half)) {
        ops.push_back(Op{Op::Kind::move, m.out, m, -1});
      }
    }
    if (!half_too) return ops;
    const std::vector<Op> rest = VirtualClock::ops(schedule, backward);
    ops.insert(ops.end(), rest.begin(), rest.end());
    return ops;
  };
  std::optional<Op::Kind> last;
  for (const Op::Kind half : halves) {
    BLOCKSWAP_CHECK(half != Op::Kind::move, "simulate_halves: a step is made of halves");
    const bool backward = half == Op::Kind::backward;
    const bool turn = last == half;
    last = half;
    if (!backward) { // every list's prepare, then every list's blocks
      for (const bool blocks : {false, true}) {
        for (std::size_t i = 0; i < lists.size(); ++i) {
          clock.restart_lists();
          clock.next_list(offsets[i]);
          const Schedule& schedule = *lists[i].schedule;
          clock.play(lists[i],
                     blocks ? VirtualClock::ops(schedule, false)
                            : with_turn(schedule, false, turn, false),
                     false, out[i], 1.0);
        }
      }
      continue;
    }
    for (std::size_t i = lists.size(); i-- > 0;) {
      clock.restart_lists();
      clock.next_list(offsets[i]);
      clock.play(lists[i], with_turn(*lists[i].schedule, true, turn, true), true, out[i], 1.0);
    }
  }
  Simulation result = clock.result();
  result.step_seconds = clock.step_end();
  result.lists = std::move(out);
  return result;
}

} // namespace blockswap
