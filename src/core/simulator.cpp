#include "blockswap/core/simulator.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "blockswap/core/activation_rule.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"

namespace blockswap {
namespace {

void check_list(const SimulatedList& list) {
  BLOCKSWAP_CHECK(list.schedule != nullptr && list.timing != nullptr,
                  "simulator: a list needs a schedule and a timing");
  const auto n = static_cast<std::size_t>(list.schedule->blocks());
  const BlockTiming& t = *list.timing;
  BLOCKSWAP_CHECK(t.forward_seconds.size() == n && t.bytes.size() == n, "simulator: ", n,
                  " blocks in the schedule but ", t.forward_seconds.size(), " forward times and ",
                  t.bytes.size(), " block sizes");
  BLOCKSWAP_CHECK(std::isfinite(t.backward_factor) && t.backward_factor >= 0,
                  "simulator: backward_factor must be finite and >= 0, got ", t.backward_factor);
  for (double s : t.forward_seconds) {
    BLOCKSWAP_CHECK(std::isfinite(s) && s >= 0,
                    "simulator: a forward time must be finite and >= 0, got ", s);
  }
  BLOCKSWAP_CHECK(t.from_file.empty() || t.from_file.size() == n, "simulator: ", n,
                  " blocks in the schedule but ", t.from_file.size(), " file-tier flags");
  BLOCKSWAP_CHECK(t.activation_bytes.empty() || t.activation_bytes.size() == n, "simulator: ", n,
                  " blocks in the schedule but ", t.activation_bytes.size(), " activation sizes");
}

std::size_t activation_bytes(const BlockTiming& timing, int64_t block) {
  return timing.activation_bytes.empty() ? 0 : timing.activation_bytes[block];
}

bool reads_file(const SimulatedList& list) {
  const std::vector<bool>& f = list.timing->from_file;
  return std::find(f.begin(), f.end(), true) != f.end();
}

void check_lists(std::span<const SimulatedList> lists, const LinkModel& link) {
  BLOCKSWAP_CHECK(!lists.empty(), "simulator: no block list");
  BLOCKSWAP_CHECK(std::isfinite(link.bytes_per_second) && std::isfinite(link.latency_seconds) &&
                      link.bytes_per_second > 0 && link.latency_seconds >= 0,
                  "simulator: the link needs bytes_per_second > 0 and latency_seconds >= 0, got ",
                  link.bytes_per_second, " and ", link.latency_seconds);
  for (const SimulatedList& list : lists) {
    check_list(list);
    BLOCKSWAP_CHECK(list.schedule->mode() == lists[0].schedule->mode(),
                    "simulator: every list of a step must be in the same mode");
    BLOCKSWAP_CHECK(!reads_file(list) ||
                        (std::isfinite(link.disk_bytes_per_second) &&
                         link.disk_bytes_per_second > 0 && link.staging_buffers >= 1),
                    "simulator: file-tier blocks need disk_bytes_per_second > 0 and "
                    "staging_buffers >= 1, got ",
                    link.disk_bytes_per_second, " and ", link.staging_buffers);
  }
}

double compute_seconds(const BlockTiming& timing, const Op& op) {
  const double forward = timing.forward_seconds[op.block];
  return op.kind == Op::Kind::backward ? forward * timing.backward_factor : forward;
}

// Note [simulated engine]
// The clock follows what the engine enqueues (engine.cpp), op by op of Schedule::pass():
//  - a computation waits for its block's load (an event on the copy stream) and, for the seed
//    replay, for the host, which waited for that load itself (host_waits);
//  - a move evicts the slot's occupant: the copy stream waits for the compute stream to finish
//    it (an event recorded after the block whose compute triggered the move); the seed replay's
//    host waits for that too and copies the occupant back first; then the load;
//  - a copy starts when the copy stream is free and the host has enqueued it.
// Blocks on the device at the start of the step are loaded already (the steady state).
class VirtualClock {
public:
  explicit VirtualClock(const LinkModel& link)
      : link_(link), staging_(static_cast<std::size_t>(std::max(1, link.staging_buffers)), 0.0) {}

  void play(const SimulatedList& list, bool backward, ListSimulation& out, double weight) {
    const Schedule& schedule = *list.schedule;
    const BlockTiming& timing = *list.timing;
    const auto n = static_cast<std::size_t>(schedule.blocks());
    if (ready_.size() < offset_ + n) ready_.resize(offset_ + n, 0.0);
    for (const Op& op : ops(schedule, backward)) {
      double& ready = ready_[offset_ + op.block];
      if (op.kind == Op::Kind::move) {
        move(schedule, timing, op, weight);
        continue;
      }
      if (schedule.host_waits()) host_ = std::max(host_, ready);
      const std::size_t g = offset_ + static_cast<std::size_t>(op.block);
      const bool training = schedule.mode() != Mode::forward_only;
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

  // Training: a step ends when nothing is in flight on any stream (time_step's finish()).
  double step_end() const { return std::max({compute_, copy_, host_, d2h_}); }

  // Training, the next step of a sequence (Note [training steps in sequence]): every stream
  // starts where the step before ended; the disk and the staging ring go on, and the
  // activations start over, as the front end's hooks do at each step.
  void start_next_step() {
    compute_ = copy_ = host_ = d2h_ = step_end();
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
                              std::max(0.0, disk_ - compute_)};
    for (double ready : ready_) state.push_back(std::max(0.0, ready - compute_));
    for (std::size_t i = 0; i < staging_.size(); ++i) {
      state.push_back(std::max(0.0, staging_[(next_staging_ + i) % staging_.size()] - compute_));
    }
    return state;
  }

  void reset_counters() { stall_ = busy_compute_ = busy_link_ = busy_disk_ = 0; }

  // The schedule's lists take turns on one device: each list's blocks have their own entries.
  void next_list(std::size_t blocks) { offset_ += blocks; }
  void restart_lists() { offset_ = 0; }

  Simulation result() const {
    Simulation s;
    s.step_seconds = std::max({compute_, copy_, host_, d2h_});
    s.compute_seconds = busy_compute_;
    s.stall_seconds = stall_;
    s.link_busy_seconds = busy_link_;
    s.disk_busy_seconds = busy_disk_;
    s.d2h_busy_seconds = busy_d2h_;
    return s;
  }

private:
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
    const bool from_file = !timing.from_file.empty() && timing.from_file[op.move.in];
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
    copy(in, weight);
    if (from_file) {
      staging_[next_staging_] = copy_;
      next_staging_ = (next_staging_ + 1) % staging_.size();
    }
    ready_[offset_ + op.move.in] = copy_;
  }

  LinkModel link_;
  double compute_ = 0, copy_ = 0, host_ = 0, disk_ = 0;
  double stall_ = 0, busy_compute_ = 0, busy_link_ = 0, busy_disk_ = 0;
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

// The bound's third term (step_bound in simulator.hpp).
double slot_seconds(const SimulatedList& list, const LinkModel& link) {
  const Schedule& schedule = *list.schedule;
  const BlockTiming& timing = *list.timing;
  auto load_seconds = [&](const Move& m) {
    double seconds = link.seconds(timing.bytes[m.in]);
    if (schedule.writes_back()) seconds += link.seconds(timing.bytes[m.out]);
    return seconds;
  };
  if (schedule.mode() == Mode::forward_only) {
    if (schedule.rotating_slots() == 0) return 0;
    // Every block that moves in a pass is a rotating block; each computes and loads once.
    double rotating = 0;
    for (int64_t b = 0; b < schedule.blocks(); ++b) {
      for (const Move& m : schedule.after_forward(b)) {
        rotating += timing.forward_seconds[m.out] + load_seconds(m);
      }
    }
    return rotating / static_cast<double>(schedule.rotating_slots());
  }
  std::vector<double> per_slot(static_cast<std::size_t>(schedule.slots()), 0.0);
  for (const Op& op : schedule.pass()) {
    if (op.slot < 0) continue;
    per_slot[op.slot] +=
        op.kind == Op::Kind::move ? load_seconds(op.move) : compute_seconds(timing, op);
  }
  return per_slot.empty() ? 0.0 : *std::max_element(per_slot.begin(), per_slot.end());
}

// Forward-only, a stronger slot term across lists. Number the list's M rotating blocks
// r_0 < ... < r_{M-1} (r_0 is block 0). A rotating slot passes from r_i to r_{i+R}, so the slot
// that computes r_0 in a pass computes r_0, r_R, ..., r_{(q-1)R} in it, q = ceil(M/R). From
// the start of r_0's compute to the end of r_{(q-1)R}'s, the compute stream runs only this
// list's blocks in that range, and the slot runs those q computes and the q-1 loads between
// them; every other block of the pass (the other lists', and this list's outside the range)
// computes outside that stretch. Returns the pass's compute when nothing rotates.
double chained_pass_seconds(const SimulatedList& list, double pass_compute, const LinkModel& link) {
  const Schedule& schedule = *list.schedule;
  const BlockTiming& timing = *list.timing;
  std::vector<int64_t> rotating;
  for (int64_t b = 0; b < schedule.blocks(); ++b) {
    if (!schedule.after_forward(b).empty()) rotating.push_back(b);
  }
  const auto m = static_cast<int64_t>(rotating.size());
  const int64_t r = schedule.rotating_slots();
  if (m == 0 || r == 0) return pass_compute;
  const int64_t q = (m + r - 1) / r;
  double chain = 0;
  for (int64_t i = 0; i < q; ++i) {
    const int64_t b = rotating[i * r];
    chain += timing.forward_seconds[b];
    if (i > 0) chain += link.seconds(timing.bytes[b]);
  }
  double inside = 0; // this list's computes within the stretch
  for (int64_t b = rotating[0]; b <= rotating[(q - 1) * r]; ++b) {
    inside += timing.forward_seconds[b];
  }
  return chain + pass_compute - inside;
}

// Training, a stronger term per half of the step. In the forward half (and likewise the
// backward half) the first load starts only after the computes before its move, the loads run
// one after another on the link, and the block loaded last computes only after its load, then
// the rest of the half. Every list's halves are disjoint stretches of the compute stream, so
// their bounds add up. Returns the half's compute when it moves nothing.
//
// Note [the disk in each half]
// Likewise the file tier's reads of the half (docs/performance.md, "The bound T*"). A read holds
// a staging buffer until the copy out of it ends, and the half's copies wait for slots that the
// half's own computes free. So when the half starts at most Q of its reads (Q = the ring's
// staging buffers) are done or under way, the one step before having read ahead what the ring
// holds; the others follow one another on the disk. If Q are, every buffer is held, and the next
// read waits for the first copy out of one: the half's first move from the file, after the
// computes before it and its copy. The copy stream copies in order, each copy after its read,
// so the half's last load ends after every read of the half, then the block it loads computes,
// then the rest of the half. It is what binds when the disk is slower than the forward's compute
// and the ring too shallow to carry the backward's spare disk time into the next forward.
double half_seconds(const std::vector<Op>& ops, const SimulatedList& list, const LinkModel& link) {
  const Schedule& schedule = *list.schedule;
  const BlockTiming& timing = *list.timing;
  double compute = 0, copies = 0;
  std::ptrdiff_t first_move = -1, last_move = -1;
  std::vector<double> reads;    // the half's reads from the file
  double before_first_read = 0; // the computes before the half's first move from the file
  double first_read_copy = 0;   // and its copy
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    if (op.kind != Op::Kind::move) {
      compute += compute_seconds(timing, op);
      continue;
    }
    if (first_move < 0) first_move = static_cast<std::ptrdiff_t>(i);
    last_move = static_cast<std::ptrdiff_t>(i);
    copies += link.seconds(timing.bytes[op.move.in]);
    if (schedule.writes_back()) copies += link.seconds(timing.bytes[op.move.out]);
    if (!timing.from_file.empty() && timing.from_file[op.move.in]) {
      if (reads.empty()) {
        before_first_read = compute;
        first_read_copy = link.seconds(timing.bytes[op.move.in]);
      }
      reads.push_back(link.disk_seconds(timing.bytes[op.move.in]));
    }
  }
  if (first_move < 0) return compute;
  double before = 0, after = 0;
  for (std::ptrdiff_t i = 0; i < first_move; ++i) {
    if (ops[i].kind != Op::Kind::move) before += compute_seconds(timing, ops[i]);
  }
  const int64_t last_loaded = ops[last_move].move.in;
  std::ptrdiff_t from = -1;
  for (std::size_t i = static_cast<std::size_t>(last_move) + 1; i < ops.size(); ++i) {
    if (ops[i].kind != Op::Kind::move && ops[i].block == last_loaded) {
      from = static_cast<std::ptrdiff_t>(i);
      break;
    }
  }
  if (from < 0) return compute; // the last load is for later: no stronger claim here
  for (std::size_t i = static_cast<std::size_t>(from); i < ops.size(); ++i) {
    if (ops[i].kind != Op::Kind::move) after += compute_seconds(timing, ops[i]);
  }
  double disk = 0;
  if (!reads.empty()) {
    // Every read but the j longest (those done or under way when the half starts).
    std::sort(reads.begin(), reads.end(), std::greater<>());
    auto all_but = [&](std::size_t j) {
      double sum = 0;
      for (std::size_t i = j; i < reads.size(); ++i) sum += reads[i];
      return sum;
    };
    const auto q = static_cast<std::size_t>(std::max(1, link.staging_buffers));
    const double rest =
        reads.size() <= q
            ? 0.0 // all of them may be read already
            : std::min(all_but(q - 1), before_first_read + first_read_copy + all_but(q));
    disk = rest + link.seconds(timing.bytes[last_loaded]) + after;
  }
  return std::max({compute, before + copies + after, disk});
}

// Every list's forward and backward segments are disjoint stretches of the compute stream.
double halves_seconds(const SimulatedList& list, const LinkModel& link) {
  std::vector<Op> forward, backward;
  bool in_backward = false;
  for (const Op& op : list.schedule->pass()) {
    if (op.kind == Op::Kind::backward) in_backward = true;
    (in_backward ? backward : forward).push_back(op);
  }
  return half_seconds(forward, list, link) + half_seconds(backward, list, link);
}

} // namespace

double LinkModel::seconds(std::size_t bytes) const {
  return latency_seconds + static_cast<double>(bytes) / bytes_per_second;
}

double LinkModel::disk_seconds(std::size_t bytes) const {
  return static_cast<double>(bytes) / disk_bytes_per_second;
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
        if (!steady) result.step_seconds = std::max(result.step_seconds, result.link_busy_seconds);
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

// Note [the staging ring]
// A load from the file holds one of the list's Q staging buffers from the start of its read to
// the end of its copy out: the disk and the link in series, per block. In the steady state the
// buffers carry a step's loads from the file, so Q buffers take at least the sum of their reads
// and copies over Q. It binds with a ring of one: every read then waits for the copy before it.
// (The simulator plays one ring for every list, the engine has one per list: the bound takes
// the list that needs most, which holds for both.)

double step_bound(std::span<const SimulatedList> lists, const LinkModel& link) {
  check_lists(lists, link);
  double compute = 0, copies = 0, slots = 0, reads = 0, ring = 0, out = 0;
  // Offloaded activations: the groups the rule sends out in the forward (the last stays).
  ActivationRule rule;
  std::vector<double> out_seconds; // per block of every list
  for (const SimulatedList& list : lists) {
    const Schedule& schedule = *list.schedule;
    const BlockTiming& timing = *list.timing;
    const std::size_t offset = out_seconds.size();
    out_seconds.resize(offset + static_cast<std::size_t>(schedule.blocks()), 0.0);
    double staged = 0; // Note [the staging ring]
    for (const Op& op : schedule.pass()) {
      if (op.kind != Op::Kind::move) {
        compute += compute_seconds(timing, op);
        const std::size_t a = activation_bytes(timing, op.block);
        if (op.kind == Op::Kind::forward && schedule.mode() != Mode::forward_only) {
          const std::size_t g = offset + static_cast<std::size_t>(op.block);
          for (const ActivationRule::Group p : rule.open(g)) out += out_seconds[p];
          if (a > 0) {
            rule.saved(g);
            out_seconds[g] = link.seconds(a);
          }
        }
        continue;
      }
      if (!timing.from_file.empty() && timing.from_file[op.move.in]) {
        reads += link.disk_seconds(timing.bytes[op.move.in]);
        staged +=
            link.disk_seconds(timing.bytes[op.move.in]) + link.seconds(timing.bytes[op.move.in]);
      }
      copies += link.seconds(timing.bytes[op.move.in]);
      if (schedule.writes_back()) copies += link.seconds(timing.bytes[op.move.out]);
    }
    slots = std::max(slots, slot_seconds(list, link));
    ring = std::max(ring, staged / std::max(1, link.staging_buffers));
  }
  double halves = 0;
  for (const SimulatedList& list : lists) {
    if (lists[0].schedule->mode() == Mode::forward_only) {
      slots = std::max(slots, chained_pass_seconds(list, compute, link));
    } else {
      halves += halves_seconds(list, link);
    }
  }
  slots = std::max(slots, halves);
  copies += out; // every offloaded activation comes back on the host->device link
  if (!link.duplex) copies += out;
  return std::max({compute, copies, slots, reads, ring, link.duplex ? out : 0.0});
}

double step_bound(const Schedule& schedule, const BlockTiming& timing, const LinkModel& link) {
  const SimulatedList list{&schedule, &timing};
  return step_bound(std::span<const SimulatedList>(&list, 1), link);
}

} // namespace blockswap
