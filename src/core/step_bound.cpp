// The bound T* (simulator.hpp, step_bound): the largest of the terms no schedule of the step can
// beat, each from its own constraint (DESIGN.md section 6).
#include <algorithm>
#include <vector>

#include "blockswap/core/activation_rule.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/simulator.hpp"
#include "simulated_lists.hpp"

namespace blockswap {
namespace {

using namespace simulated;

// The bound's third term (step_bound in simulator.hpp).
double slot_seconds(const SimulatedList& list, const LinkModel& link) {
  const Schedule& schedule = *list.schedule;
  const BlockTiming& timing = *list.timing;
  auto move_seconds = [&](const Move& m) {
    double seconds = load_seconds(timing, m.in, link);
    if (schedule.writes_back()) seconds += link.seconds(timing.bytes[m.out]);
    return seconds;
  };
  if (schedule.mode() == Mode::forward_only) {
    if (schedule.rotating_slots() == 0) return 0;
    // Every block that moves in a pass is a rotating block; each computes and loads once.
    double rotating = 0;
    for (int64_t b = 0; b < schedule.blocks(); ++b) {
      for (const Move& m : schedule.after_forward(b)) {
        rotating += timing.forward_seconds[m.out] + move_seconds(m);
      }
    }
    return rotating / static_cast<double>(schedule.rotating_slots());
  }
  std::vector<double> per_slot(static_cast<std::size_t>(schedule.slots()), 0.0);
  for (const Op& op : schedule.pass()) {
    if (op.slot < 0) continue;
    per_slot[op.slot] +=
        op.kind == Op::Kind::move ? move_seconds(op.move) : compute_seconds(timing, op);
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
    if (i > 0) chain += load_seconds(timing, b, link);
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
//
// Compressed loads (Note [a decode step]): the link carries their copies and the decode stream
// their decodes, each in order. The half's last load ends after every copy of the half and its
// own decode; where it is decoded, also after every decode of the half, which start after the
// first decoded load's copy at the earliest.
double half_seconds(const std::vector<Op>& ops, const SimulatedList& list, const LinkModel& link) {
  const Schedule& schedule = *list.schedule;
  const BlockTiming& timing = *list.timing;
  double compute = 0, copies = 0, decodes = 0, first_decoded_copy = -1;
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
    copies += copy_seconds(timing, op.move.in, link);
    decodes += decode_seconds(timing, op.move.in, link);
    if (decoded(timing, op.move.in) && first_decoded_copy < 0) {
      first_decoded_copy = copies;
    }
    if (schedule.writes_back()) copies += link.seconds(timing.bytes[op.move.out]);
    if (!timing.from_file.empty() && timing.from_file[op.move.in]) {
      if (reads.empty()) {
        before_first_read = compute;
        first_read_copy = load_seconds(timing, op.move.in, link);
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
    disk = rest + load_seconds(timing, last_loaded, link) + after;
  }
  double loads = copies + decode_seconds(timing, last_loaded, link);
  if (!link.decode_stream) {
    loads = copies + decodes; // one stream for both
  } else if (decoded(timing, last_loaded)) {
    loads = std::max(loads, first_decoded_copy + decodes);
  }
  return std::max({compute, before + loads + after, disk});
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

// Note [the staging ring]
// A load from the file holds one of the list's Q staging buffers from the start of its read to
// the end of its copy out: the disk and the link in series, per block. In the steady state the
// buffers carry a step's loads from the file, so Q buffers take at least the sum of their reads
// and copies over Q. It binds with a ring of one: every read then waits for the copy before it.
// (The simulator plays one ring for every list, the engine has one per list: the bound takes
// the list that needs most, which holds for both.)

double step_bound(std::span<const SimulatedList> lists, const LinkModel& link) {
  check_lists(lists, link);
  double compute = 0, copies = 0, decodes = 0, slots = 0, reads = 0, ring = 0, out = 0;
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
      copies += copy_seconds(timing, op.move.in, link);
      decodes += decode_seconds(timing, op.move.in, link);
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
  // Compressed loads: their decodes in order on the decode stream, or on the copy stream.
  if (!link.decode_stream) copies += decodes;
  return std::max({compute, copies, decodes, slots, reads, ring, link.duplex ? out : 0.0});
}

double step_bound(const Schedule& schedule, const BlockTiming& timing, const LinkModel& link) {
  const SimulatedList list{&schedule, &timing};
  return step_bound(std::span<const SimulatedList>(&list, 1), link);
}

} // namespace blockswap
