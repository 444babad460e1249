#include "timed_bench.hpp"

#include <algorithm>
#include <limits>
#include <memory>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/device/timed.hpp"

namespace blockswap::tool {
namespace {

// One configuration of a model: K and R per list.
struct Config {
  std::vector<int64_t> ks, rs;
};

struct Measured {
  double seconds = 0;
  double predicted = 0;
  uint64_t peak_device_bytes = 0;
};

// The model's lists as engines on one timed device (attached through a Device, as two
// offloaders of one model are), one step measured after the simulator's warm-up.
Measured measure(const ModelShape& shape, const std::vector<BlockTiming>& timings,
                 const Config& config, Mode mode, Algorithm algorithm, const LinkModel& link) {
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
  Device device(timed);
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<TimedList> lists;
  std::vector<SimulatedList> simulated;
  for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
    engines.push_back(std::make_unique<Engine>(
        device.attach(shape.name), std::vector<std::size_t>(shape.blocks[l], shape.bytes[l]),
        EngineOptions{.blocks_to_swap = config.ks[l],
                      .supports_backward = mode == Mode::training,
                      .rotating_slots = config.rs[l],
                      .algorithm = algorithm},
        shape.name));
  }
  for (std::size_t l = 0; l < engines.size(); ++l) {
    lists.push_back({engines[l].get(), &timings[l]});
    simulated.push_back({&engines[l]->schedule(), &timings[l]});
  }
  const Simulation predicted = simulate(simulated, link);
  const TimedStep step = time_step(*timed, lists, predicted.warmup_passes);
  return {step.step_seconds, predicted.step_seconds, device.memory().peak_device_bytes};
}

std::vector<Schedule> schedules(const ModelShape& shape, const Config& config, Mode mode) {
  std::vector<Schedule> out;
  for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
    out.emplace_back(ScheduleOptions{shape.blocks[l], config.ks[l], mode, config.rs[l]});
  }
  return out;
}

double simulated_seconds(const ModelShape& shape, const std::vector<BlockTiming>& timings,
                         const Config& config, Mode mode, const LinkModel& link, bool bound) {
  const std::vector<Schedule> s = schedules(shape, config, mode);
  std::vector<SimulatedList> lists;
  for (std::size_t l = 0; l < s.size(); ++l) lists.push_back({&s[l], &timings[l]});
  return bound ? step_bound(lists, link) : simulate(lists, link).step_seconds;
}

// T* for these K: the smallest bound over every choice of R per list (forward-only), the one
// schedule's bound in training.
double bound_for(const ModelShape& shape, const std::vector<BlockTiming>& timings,
                 const std::vector<int64_t>& ks, Mode mode, const LinkModel& link) {
  Config config{ks, std::vector<int64_t>(ks.size(), 0)};
  if (mode == Mode::training) return simulated_seconds(shape, timings, config, mode, link, true);
  double best = std::numeric_limits<double>::infinity();
  auto search = [&](auto&& self, std::size_t l) -> void {
    if (l == ks.size()) {
      best = std::min(best, simulated_seconds(shape, timings, config, mode, link, true));
      return;
    }
    if (ks[l] == 0) {
      config.rs[l] = 0;
      self(self, l + 1);
      return;
    }
    for (config.rs[l] = 1; config.rs[l] <= shape.blocks[l] - ks[l]; ++config.rs[l])
      self(self, l + 1);
  };
  search(search, 0);
  return best;
}

// The K of every list for sweep point k: the first list's k, the others in proportion.
std::vector<int64_t> ks_for(const ModelShape& shape, int64_t k) {
  std::vector<int64_t> ks;
  for (int64_t blocks : shape.blocks) ks.push_back(k * blocks / shape.blocks[0]);
  return ks;
}

// The largest K both schedules run: each row sets blockswap beside the seed's replay, which
// trains to N-2 (blockswap's N-1 trains through one slot, where nothing can overlap).
int64_t max_k(const ModelShape& shape, Mode mode) {
  int64_t k = Schedule::max_blocks_to_swap(shape.blocks[0], mode, Algorithm::seed);
  while (k > 0) {
    const std::vector<int64_t> ks = ks_for(shape, k);
    bool valid = true;
    for (std::size_t l = 0; l < ks.size(); ++l) {
      valid =
          valid && ks[l] <= Schedule::max_blocks_to_swap(shape.blocks[l], mode, Algorithm::seed);
    }
    if (valid) break;
    --k;
  }
  return k;
}

std::vector<int64_t> sweep(const ModelShape& shape, Mode mode, bool quick) {
  const int64_t top = max_k(shape, mode);
  std::vector<int64_t> ks;
  if (!quick) {
    for (int64_t k = 1; k <= top; ++k) ks.push_back(k);
    return ks;
  }
  const int64_t n = shape.blocks[0];
  for (int64_t k : {n / 4, n / 2, 3 * n / 4, top}) {
    k = std::clamp<int64_t>(k, 1, top);
    if (ks.empty() || ks.back() < k) ks.push_back(k);
  }
  return ks;
}

} // namespace

std::vector<ModelShape> bench_shapes(int64_t reference_blocks, std::size_t reference_block_bytes) {
  return {
      {"reference", {reference_blocks}, {reference_block_bytes}},
      {"flux", {19, 38}, {339'600'000 * 2, 141'600'000 * 2}},
      {"wan14b", {40}, {351'000'000 * 2}},
  };
}

std::vector<BenchRow>
timed_bench(const std::vector<ModelShape>& shapes, const TimedBenchOptions& options,
            const std::function<void(const std::string&, int, int)>& progress) {
  struct Point {
    const ModelShape* shape;
    double ratio;
    Mode mode;
    int64_t k;
  };
  std::vector<Point> points;
  for (const ModelShape& shape : shapes) {
    for (double ratio : options.ratios) {
      BLOCKSWAP_CHECK(ratio > 0, "a copy/compute ratio must be > 0, got ", ratio);
      for (Mode mode : {Mode::forward_only, Mode::training}) {
        for (int64_t k : sweep(shape, mode, options.quick))
          points.push_back({&shape, ratio, mode, k});
      }
    }
  }
  std::vector<BenchRow> rows;
  const ModelShape* last_shape = nullptr;
  double last_ratio = 0, noswap = 0;
  Mode last_mode = Mode::forward_only;
  for (const Point& p : points) {
    if (progress) {
      progress(p.shape->name + " " + (p.mode == Mode::training ? "train" : "infer") +
                   " K=" + std::to_string(p.k) + ",",
               static_cast<int>(rows.size()) + 1, static_cast<int>(points.size()));
    }
    const ModelShape& shape = *p.shape;
    std::vector<BlockTiming> timings;
    for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
      timings.push_back(uniform_timing(shape.blocks[l],
                                       options.link.seconds(shape.bytes[l]) / p.ratio,
                                       shape.bytes[l], options.backward_factor));
    }
    const Config none{std::vector<int64_t>(shape.blocks.size(), 0),
                      std::vector<int64_t>(shape.blocks.size(), 0)};
    if (&shape != last_shape || p.ratio != last_ratio || p.mode != last_mode) {
      noswap = measure(shape, timings, none, p.mode, Algorithm::blockswap, options.link).seconds;
      last_shape = &shape;
      last_ratio = p.ratio;
      last_mode = p.mode;
    }
    const std::vector<int64_t> ks = ks_for(shape, p.k);
    Config config{ks, std::vector<int64_t>(ks.size(), 0)};
    if (p.mode == Mode::forward_only) config.rs = best_rotating_slots(ks, timings, options.link);
    const Measured swap =
        measure(shape, timings, config, p.mode, Algorithm::blockswap, options.link);
    const Measured seed =
        measure(shape, timings, Config{ks, config.rs}, p.mode, Algorithm::seed, options.link);

    BenchRow row;
    row.device = "timed";
    row.model = shape.name;
    row.copy_compute_ratio = p.ratio;
    row.mode = p.mode == Mode::training ? "train" : "infer";
    row.k = p.k;
    row.t_noswap = noswap;
    row.t_swap = swap.seconds;
    row.t_predicted = swap.predicted;
    row.t_seed = seed.seconds;
    row.t_bound = bound_for(shape, timings, ks, p.mode, options.link);
    row.rotating_slots = config.rs[0];
    row.peak_device_bytes = swap.peak_device_bytes;
    const std::vector<Schedule> s = schedules(shape, config, p.mode);
    for (std::size_t l = 0; l < s.size(); ++l) {
      row.h2d_bytes += static_cast<uint64_t>(s[l].loads_per_pass()) * shape.bytes[l];
      const std::vector<std::size_t> sizes(shape.blocks[l], shape.bytes[l]);
      row.planned_device_bytes += layout::slot_device_bytes(sizes, ks[l]);
    }
    rows.push_back(row);
  }
  return rows;
}

} // namespace blockswap::tool
