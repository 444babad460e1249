// time_step: a driver of engines on the timed device. It replays the LibTorch front end's
// calls (run_block's enter, compute, leave; the backward's acquire_for_backward) with modelled
// computations, so that a step's time is measured without tensors.
#include <algorithm>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "blockswap/core/activation_rule.hpp"
#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/device/timed.hpp"

namespace blockswap {

namespace {

// Offloaded activations (BlockTiming::activation_bytes), every list's blocks numbered in the
// forward order, moved as ActivationRule says (Note [offloaded activations] in
// core/activation_rule.hpp), as the front end's store and the simulator move them.
class Activations {
public:
  explicit Activations(std::span<const TimedList> lists) {
    for (const TimedList& list : lists) {
      const auto n = static_cast<std::size_t>(list.engine->blocks());
      const std::vector<std::size_t>& a = list.timing->activation_bytes;
      BLOCKSWAP_CHECK(a.empty() || a.size() == n, "time_step: the engine has ", n,
                      " blocks but the timing ", a.size(), " activation sizes");
      for (std::size_t b = 0; b < n; ++b) bytes_.push_back(a.empty() ? 0 : a[b]);
    }
    out_.resize(bytes_.size());
    in_.resize(bytes_.size());
  }

  void forward_starts(TimedDevice& device, std::size_t g) {
    for (const ActivationRule::Group p : rule_.open(g)) {
      out_[p] = device.copy_out_after_compute(bytes_[p]);
    }
    if (bytes_[g] > 0) rule_.saved(g);
  }

  void backward_starts(TimedDevice& device, std::size_t g) {
    const ActivationRule::Restore r = rule_.backward_starts(g);
    if (r.own) restore(device, g);
    if (in_[g]) device.wait(Stream::compute, *in_[g]);
    if (r.ahead) restore(device, static_cast<std::size_t>(*r.ahead));
  }

private:
  void restore(TimedDevice& device, std::size_t g) {
    in_[g] = device.copy_in_after(bytes_[g], *out_[g]);
  }

  ActivationRule rule_;
  std::vector<std::size_t> bytes_;
  std::vector<std::unique_ptr<Event>> out_, in_;
};

// One pass of every list forward: enter, compute, leave, as the front end's run_block does.
void forward_pass(TimedDevice& device, std::span<const TimedList> lists, Compute compute,
                  std::vector<std::vector<const Buffer*>>& computed_in,
                  Activations* activations = nullptr) {
  for (const TimedList& list : lists) list.engine->prepare();
  std::size_t g = 0;
  for (std::size_t l = 0; l < lists.size(); ++l) {
    Engine& engine = *lists[l].engine;
    computed_in[l].clear();
    for (int64_t b = 0; b < engine.blocks(); ++b, ++g) {
      const Entered entered = engine.enter(b, compute);
      computed_in[l].push_back(entered.slot.get());
      if (activations) activations->forward_starts(device, g);
      device.compute(lists[l].timing->forward_seconds[b], b);
      engine.leave(b, compute);
    }
  }
}

// Every list backward in the reverse order, as autograd runs the blocks' backward functions.
void backward_pass(TimedDevice& device, std::span<const TimedList> lists,
                   const std::vector<std::vector<const Buffer*>>& computed_in,
                   Activations& activations) {
  std::size_t g = 0;
  for (const TimedList& list : lists) g += static_cast<std::size_t>(list.engine->blocks());
  for (std::size_t l = lists.size(); l-- > 0;) {
    Engine& engine = *lists[l].engine;
    const BlockTiming& timing = *lists[l].timing;
    for (int64_t b = engine.blocks() - 1; b >= 0; --b) {
      engine.acquire_for_backward(b, computed_in[l][b]);
      activations.backward_starts(device, --g);
      device.compute(timing.forward_seconds[b] * timing.backward_factor, b);
    }
  }
}

} // namespace

TimedStep time_step(TimedDevice& device, std::span<const TimedList> lists, int warmup_passes) {
  BLOCKSWAP_CHECK(!lists.empty(), "time_step: no block list");
  bool training = false;
  std::size_t blocks = 0;
  for (const TimedList& list : lists) {
    BLOCKSWAP_CHECK(list.engine != nullptr && list.timing != nullptr,
                    "time_step: a list needs an engine and a timing");
    const auto n = static_cast<std::size_t>(list.engine->blocks());
    BLOCKSWAP_CHECK(list.timing->forward_seconds.size() == n, "time_step: the engine has ", n,
                    " blocks but the timing ", list.timing->forward_seconds.size());
    blocks += n;
  }
  training = !lists[0].engine->forward_only();
  for (const TimedList& list : lists) {
    BLOCKSWAP_CHECK(list.engine->forward_only() != training,
                    "time_step: every engine of a step must be in the same mode");
  }
  std::vector<std::vector<const Buffer*>> computed_in(lists.size());
  const Compute compute{.differentiable = training};
  // From the steady state: every block the schedules start with is loaded.
  for (const TimedList& list : lists) list.engine->prepare();
  const double start_of_passes = device.finish();
  device.take_compute_log();

  BLOCKSWAP_CHECK(warmup_passes >= 0, "time_step: warmup_passes must be >= 0, got ", warmup_passes);
  TimedStep step;
  if (training) {
    // With the file tier the reader reads the next step's first loads during the backward (Note
    // [training steps in sequence] in src/core/simulator.cpp): `warmup_passes` steps, then the
    // mean of kPassesPerChunk, each from the end of the one before (the disk reads on between
    // them; one step's end moves with the host's timing, the mean hardly). Without the file tier
    // every step starts from the same state: one step, from when the host starts it.
    bool file = false;
    for (const TimedList& list : lists) {
      const std::vector<bool>& f = list.timing->from_file;
      file = file || std::find(f.begin(), f.end(), true) != f.end();
    }
    const int warmups = file ? warmup_passes : 0, measured = file ? kPassesPerChunk : 1;
    auto play = [&] {
      Activations activations(lists);
      forward_pass(device, lists, compute, computed_in, &activations);
      backward_pass(device, lists, computed_in, activations);
      return device.finish();
    };
    double start = 0;
    for (int i = 0; i < warmups; ++i) start = play();
    device.take_compute_log();
    const double link_before = device.link_busy_seconds();
    const double out_before = device.activations_out_busy_seconds();
    if (warmups == 0) start = device.now();
    double end = start;
    for (int i = 0; i < measured; ++i) end = play();
    step.step_seconds = (end - start) / measured;
    step.link_busy_seconds = (device.link_busy_seconds() - link_before) / measured;
    step.activations_out_busy_seconds =
        (device.activations_out_busy_seconds() - out_before) / measured;
    step.computations = device.take_compute_log();
    if (!step.computations.empty()) {
      // The first computation's idle time reaches back before the step: from its start only.
      ComputeRecord& first = step.computations.front();
      first.idle_before = std::max(0.0, first.start - start);
    }
    for (const ComputeRecord& c : step.computations) step.stall_seconds += c.idle_before;
    step.stall_seconds /= measured;
    return step;
  }
  // Forward-only: `warmup_passes`, then a measured chunk of kPassesPerChunk, the host never
  // waiting between passes.
  // Every pass makes the same copies, so the link's time per pass is its time over all of
  // them divided by their number (counted at the end: the copy thread may lag the host).
  const double link_before = device.link_busy_seconds();
  const int passes = warmup_passes + kPassesPerChunk;
  for (int pass = 0; pass < passes; ++pass) forward_pass(device, lists, compute, computed_in);
  device.finish();
  const std::vector<ComputeRecord> log = device.take_compute_log();
  BLOCKSWAP_ASSERT(log.size() == blocks * static_cast<std::size_t>(passes));
  const std::size_t first = blocks * static_cast<std::size_t>(warmup_passes);
  const double chunk_start = first == 0 ? start_of_passes : log[first - 1].end;
  step.step_seconds = (log.back().end - chunk_start) / kPassesPerChunk;
  step.computations.assign(log.begin() + static_cast<std::ptrdiff_t>(first), log.end());
  if (first == 0) {
    ComputeRecord& c = step.computations.front();
    c.idle_before = std::max(0.0, c.start - start_of_passes);
  }
  for (const ComputeRecord& c : step.computations) step.stall_seconds += c.idle_before;
  step.stall_seconds /= kPassesPerChunk;
  step.link_busy_seconds = (device.link_busy_seconds() - link_before) / passes;
  return step;
}

// A pipeline stage's halves: each micro-batch's forward records the slots its blocks ran in
// and its own offloaded activations, and its backward (the oldest pending first, as GPipe and
// 1F1B run them) reads those.
TimedStep time_halves(TimedDevice& device, std::span<const TimedList> lists,
                      std::span<const Op::Kind> halves) {
  BLOCKSWAP_CHECK(!lists.empty(), "time_halves: no block list");
  for (const TimedList& list : lists) {
    BLOCKSWAP_CHECK(list.engine != nullptr && list.timing != nullptr &&
                        list.timing->forward_seconds.size() ==
                            static_cast<std::size_t>(list.engine->blocks()),
                    "time_halves: a list needs an engine and a timing with one entry per block");
    BLOCKSWAP_CHECK(!list.engine->forward_only(), "time_halves: the engines must be training");
  }
  struct MicroBatch {
    std::vector<std::vector<const Buffer*>> computed_in;
    std::unique_ptr<Activations> activations;
  };
  const Compute compute{.differentiable = true};
  for (const TimedList& list : lists) list.engine->prepare();
  device.finish();
  device.take_compute_log();
  const double start = device.now();
  const double link_before = device.link_busy_seconds();
  const double out_before = device.activations_out_busy_seconds();
  std::deque<MicroBatch> pending;
  for (const Op::Kind half : halves) {
    BLOCKSWAP_CHECK(half != Op::Kind::move, "time_halves: a step is made of halves");
    if (half == Op::Kind::forward) {
      MicroBatch& mb = pending.emplace_back();
      mb.computed_in.resize(lists.size());
      mb.activations = std::make_unique<Activations>(lists);
      forward_pass(device, lists, compute, mb.computed_in, mb.activations.get());
      continue;
    }
    BLOCKSWAP_CHECK(!pending.empty(), "time_halves: a backward with no forward before it");
    backward_pass(device, lists, pending.front().computed_in, *pending.front().activations);
    pending.pop_front();
  }
  TimedStep step;
  step.step_seconds = device.finish() - start;
  step.link_busy_seconds = device.link_busy_seconds() - link_before;
  step.activations_out_busy_seconds = device.activations_out_busy_seconds() - out_before;
  step.computations = device.take_compute_log();
  if (!step.computations.empty()) {
    ComputeRecord& first = step.computations.front(); // idle from the step's start only
    first.idle_before = std::max(0.0, first.start - start);
  }
  for (const ComputeRecord& c : step.computations) step.stall_seconds += c.idle_before;
  return step;
}

} // namespace blockswap
