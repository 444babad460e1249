// The three tiers on the timed device (device slots, pinned host memory, the file): the real
// engine's step against the bound T* and the simulator's prediction (what `blockswap plan`
// predicts), for the FLUX and Wan 14B shapes, a disk of 7 GB/s (PCIe 4 NVMe) and 3 GB/s, the
// link at 25 GB/s, at copy/compute ratios 0.5 and 1.0, and several host budgets, with the
// engine's own placement of the blocks held (host_priority) and the one the planner chooses
// with the simulator (file_priority). Device time: the same figures on any machine.
//
//   build/bench/three_tier_bench            # a table (docs/performance.md, "Three tiers")
//   build/bench/three_tier_bench 4          # a staging ring of 4 buffers (2 by default)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/device/timed.hpp"

namespace {

using namespace blockswap;

struct Shape {
  std::string name;
  std::vector<int64_t> blocks;
  std::vector<std::size_t> bytes;
};

struct Row {
  double measured = 0, predicted = 0, bound = 0, disk = 0;
  int64_t in_file = 0, blocks = 0;
};

// Where each list's host budget goes: the engine's own order (host_priority), or, `planned`,
// the order the planner chooses with the simulator for these costs (file_priority).
std::vector<std::vector<int64_t>> priorities(const Shape& shape, const std::vector<int64_t>& ks,
                                             Mode mode, double ratio,
                                             const std::vector<std::size_t>& budgets,
                                             const LinkModel& link, bool planned) {
  std::vector<std::vector<int64_t>> order;
  if (!planned) return order;
  std::vector<Schedule> schedules;
  std::vector<BlockTiming> timings;
  for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
    const int64_t n = shape.blocks[l];
    schedules.emplace_back(ScheduleOptions{n, ks[l], mode});
    timings.push_back(uniform_timing(n, link.seconds(shape.bytes[l]) / ratio, shape.bytes[l]));
    // As the engine orders its blocks (engine.cpp): training's moves first when it trains.
    std::vector<Schedule> modes;
    if (mode == Mode::training) modes.emplace_back(ScheduleOptions{n, ks[l], Mode::training});
    modes.emplace_back(ScheduleOptions{n, ks[l], Mode::forward_only});
    std::vector<const Schedule*> pointers;
    for (const Schedule& schedule : modes) pointers.push_back(&schedule);
    order.push_back(host_priority(n, pointers));
  }
  std::vector<SimulatedList> lists;
  for (std::size_t l = 0; l < schedules.size(); ++l) lists.push_back({&schedules[l], &timings[l]});
  return file_priority(lists, link, budgets, std::move(order));
}

// One step of `shape` with K per list and a host budget of `held` of each list's moved blocks
// (the rest of them read from the file for each load).
Row run(const Shape& shape, const std::vector<int64_t>& ks, Mode mode, double ratio, double held,
        const LinkModel& link, bool planned) {
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
  Device device(timed);
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<BlockTiming> timings;
  Row row;
  std::vector<std::size_t> budgets;
  for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
    const Schedule probe({shape.blocks[l], ks[l], mode});
    int64_t moved = 0;
    std::vector<bool> seen(static_cast<std::size_t>(shape.blocks[l]), false);
    for (const Op& op : probe.pass()) {
      if (op.kind == Op::Kind::move && !seen[op.move.in]) {
        seen[op.move.in] = true;
        ++moved;
      }
    }
    budgets.push_back(static_cast<std::size_t>(held * double(moved)) * shape.bytes[l]);
  }
  const std::vector<std::vector<int64_t>> order =
      priorities(shape, ks, mode, ratio, budgets, link, planned);
  for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
    const int64_t n = shape.blocks[l];
    const std::size_t bytes = shape.bytes[l];
    EngineOptions options{.blocks_to_swap = ks[l], .supports_backward = mode == Mode::training};
    options.trainable_bytes.assign(static_cast<std::size_t>(n), 0);
    options.file = FileTier{{},
                            std::vector<FileBlock>(n, FileBlock{{}, bytes, nullptr}),
                            budgets[l],
                            link.staging_buffers,
                            CacheBypass::direct,
                            planned ? order[l] : std::vector<int64_t>{}};
    engines.push_back(std::make_unique<Engine>(
        device.attach(shape.name), std::vector<std::size_t>(n, bytes), options, shape.name));
    BlockTiming timing = uniform_timing(n, link.seconds(bytes) / ratio, bytes, 2.0);
    for (int64_t b = 0; b < n; ++b) {
      timing.from_file.push_back(engines.back()->in_file(b));
      row.in_file += engines.back()->in_file(b) ? 1 : 0;
    }
    row.blocks += n;
    timings.push_back(std::move(timing));
  }
  std::vector<TimedList> lists;
  std::vector<SimulatedList> simulated;
  for (std::size_t l = 0; l < engines.size(); ++l) {
    lists.push_back({engines[l].get(), &timings[l]});
    simulated.push_back({&engines[l]->schedule(), &timings[l]});
  }
  const Simulation predicted = simulate(simulated, link);
  const TimedStep step = time_step(*timed, lists, predicted.warmup_passes);
  row.measured = step.step_seconds;
  row.predicted = predicted.step_seconds;
  row.bound = step_bound(simulated, link);
  row.disk = predicted.disk_busy_seconds;
  return row;
}

} // namespace

int main(int argc, char** argv) {
  const int ring = argc > 1 ? std::atoi(argv[1]) : 2; // staging buffers
  const std::vector<Shape> shapes = {
      {"flux", {19, 38}, {339'600'000 * 2, 141'600'000 * 2}},
      {"wan14b", {40}, {351'000'000 * 2}},
  };
  std::printf("| model | mode | K | disk GB/s | copy/compute | moved blocks in host memory | "
              "blocks in the file | step (s) | T* (s) | step / T* | disk / T* | predicted / "
              "step | step / T*, placement planned | predicted / step, planned |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& shape : shapes) {
    for (Mode mode : {Mode::forward_only, Mode::training}) {
      const int64_t n = shape.blocks[0];
      const int64_t k = mode == Mode::training ? n / 2 : n / 2;
      std::vector<int64_t> ks;
      for (int64_t blocks : shape.blocks) ks.push_back(k * blocks / n);
      for (double disk : {7e9, 3e9}) {
        const LinkModel link{25e9, 5e-6, disk, ring};
        for (double ratio : {0.5, 1.0}) {
          for (double held : {0.0, 0.5, 0.75, 1.0}) {
            const Row r = run(shape, ks, mode, ratio, held, link, false);
            const Row p = run(shape, ks, mode, ratio, held, link, true);
            std::printf("| %s | %s | %lld | %g | %g | %.0f %% | %lld of %lld | %.3f | %.3f | "
                        "%.3f | %.2f | %.3f | %.3f | %.3f |\n",
                        shape.name.c_str(), mode == Mode::training ? "train" : "infer",
                        static_cast<long long>(k), disk / 1e9, ratio, held * 100,
                        static_cast<long long>(r.in_file), static_cast<long long>(r.blocks),
                        r.measured, r.bound, r.measured / r.bound, r.disk / r.bound,
                        r.predicted / r.measured, p.measured / p.bound, p.predicted / p.measured);
            std::fflush(stdout);
          }
        }
      }
    }
  }
}
