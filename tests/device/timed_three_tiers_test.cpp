// The three tiers (device slots, pinned host memory, the file) on the timed device, at the real
// shapes where the disk is close to the bound: the training step within 2 % of T* (issue 27's
// target), which the host budget's spread over the step's loads in time makes (host_priority),
// and the inference pass within 2 % with the placement the planner chooses (file_priority).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/device/timed.hpp"

namespace blockswap {
namespace {

// The modelled disk's reads are timed on a thread against the host clock (TimedDevice): a step
// may end a few microseconds either side of the model, more under a sanitizer (measured:
// 0.999999 of T* under the thread sanitizer, 1e-5 of jitter per step without).
constexpr double kClockSlack = 1e-4;

struct Shape {
  std::vector<int64_t> blocks;
  std::vector<std::size_t> bytes;
};

// step / T* and disk / T* for a training step with `held` of each list's moved blocks in host
// memory, K half of each list, a staging ring of `ring` buffers.
std::pair<double, double> train(const Shape& shape, double ratio, double held, double disk,
                                int ring = 2) {
  const LinkModel link{25e9, 5e-6, disk, ring};
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
  Device device(timed);
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<BlockTiming> timings;
  for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
    const int64_t n = shape.blocks[l], k = n / 2;
    const std::size_t bytes = shape.bytes[l];
    EngineOptions options{.blocks_to_swap = k, .supports_backward = true};
    options.trainable_bytes.assign(static_cast<std::size_t>(n), 0);
    // Training moves 2K blocks a step.
    options.file = FileTier{{},
                            std::vector<FileBlock>(n, FileBlock{{}, bytes, nullptr}),
                            static_cast<std::size_t>(held * double(2 * k)) * bytes,
                            ring,
                            CacheBypass::direct};
    engines.push_back(std::make_unique<Engine>(device.attach("list " + std::to_string(l)),
                                               std::vector<std::size_t>(n, bytes), options));
    BlockTiming timing = uniform_timing(n, link.seconds(bytes) / ratio, bytes, 2.0);
    for (int64_t b = 0; b < n; ++b) timing.from_file.push_back(engines.back()->in_file(b));
    timings.push_back(std::move(timing));
  }
  std::vector<TimedList> lists;
  std::vector<SimulatedList> simulated;
  for (std::size_t l = 0; l < engines.size(); ++l) {
    lists.push_back({engines[l].get(), &timings[l]});
    simulated.push_back({&engines[l]->schedule(), &timings[l]});
  }
  const double bound = step_bound(simulated, link);
  const Simulation predicted = simulate(simulated, link);
  return {time_step(*timed, lists, predicted.warmup_passes).step_seconds / bound,
          predicted.disk_busy_seconds / bound};
}

TEST(TimedThreeTiers, TrainingWithASlowDiskThatIsNotTheBoundStaysWithinTwoPercentOfTheBound) {
  const Shape flux{{19, 38}, {679'200'000, 283'200'000}}, wan{{40}, {702'000'000}};
  // The rows that were 1.022-1.092 of T* with the budget spread in block order.
  for (const auto& [shape, ratio, held] : std::vector<std::tuple<Shape, double, double>>{
           {flux, 0.5, 0.5}, {flux, 1.0, 0.75}, {wan, 0.5, 0.5}, {wan, 1.0, 0.75}}) {
    const auto [step, disk] = train(shape, ratio, held, 3e9);
    const std::string what = std::to_string(shape.blocks.size()) + " lists, copy/compute " +
                             std::to_string(ratio) + ", held " + std::to_string(held);
    EXPECT_LT(disk, 1.0) << what; // the disk is not the bound
    EXPECT_LE(step, 1.02) << what;
    EXPECT_GE(step, 1.0 - kClockSlack) << what;
  }
}

// Every block in the file, a 7 GB/s disk, copy = compute: the disk is the bound (the forward's
// reads take 1.8 times its compute, the backward's 0.9 times its own). A training run is a
// sequence of steps, and the reader reads the next step's first loads in the backward's spare
// time, as far as the ring holds: with 4 buffers the disk never waits, with 2 the forward waits
// for what the ring could not hold, which the bound counts (Note [the disk in each half]). The
// first step, which nothing read ahead for, was 1.067 (Wan) and 1.095 (FLUX) of the old T*.
TEST(TimedThreeTiers, TrainingWhereTheDiskIsTheBoundReachesTheBound) {
  const Shape flux{{19, 38}, {679'200'000, 283'200'000}}, wan{{40}, {702'000'000}};
  for (const Shape& shape : {flux, wan}) {
    for (int ring : {2, 4}) {
      const auto [step, disk] = train(shape, 1.0, 0.0, 7e9, ring);
      const std::string what =
          std::to_string(shape.blocks.size()) + " lists, ring " + std::to_string(ring);
      EXPECT_LE(step, 1.02) << what;
      EXPECT_GE(step, 1.0 - kClockSlack) << what;
      if (ring == 4) {
        EXPECT_NEAR(disk, 1.0, 1e-9) << what; // T* is the disk's time
      }
    }
  }
}

// step / T* for an inference pass of FLUX's two lists (K = 9 and 18, copy = compute) with
// `held` of each list's moved blocks in host memory, placed by the engine (host_priority) or by
// the planner for these costs (file_priority).
double infer_flux(double held, double disk, bool planned) {
  const Shape flux{{19, 38}, {679'200'000, 283'200'000}};
  const LinkModel link{25e9, 5e-6, disk, 2};
  std::vector<Schedule> schedules;
  std::vector<BlockTiming> timings;
  std::vector<std::vector<int64_t>> priority;
  std::vector<std::size_t> budgets;
  for (std::size_t l = 0; l < 2; ++l) {
    const int64_t n = flux.blocks[l], k = n / 2 - (l == 0 ? 0 : 1); // 9 and 18
    schedules.emplace_back(ScheduleOptions{n, k, Mode::forward_only});
    timings.push_back(uniform_timing(n, link.seconds(flux.bytes[l]), flux.bytes[l]));
    const Schedule* s = &schedules.back();
    priority.push_back(host_priority(n, std::span(&s, 1)));
    budgets.push_back(static_cast<std::size_t>(held * double(k + 2)) * flux.bytes[l]);
  }
  if (planned) {
    std::vector<SimulatedList> lists;
    for (std::size_t l = 0; l < 2; ++l) lists.push_back({&schedules[l], &timings[l]});
    priority = file_priority(lists, link, budgets, priority);
  }
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
  Device device(timed);
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<TimedList> lists;
  std::vector<SimulatedList> simulated;
  for (std::size_t l = 0; l < 2; ++l) {
    const int64_t n = flux.blocks[l];
    EngineOptions options{.blocks_to_swap = schedules[l].blocks_to_swap()};
    options.file = FileTier{{},
                            std::vector<FileBlock>(n, FileBlock{{}, flux.bytes[l], nullptr}),
                            budgets[l],
                            2,
                            CacheBypass::direct,
                            planned ? priority[l] : std::vector<int64_t>{}};
    engines.push_back(std::make_unique<Engine>(device.attach("list " + std::to_string(l)),
                                               std::vector<std::size_t>(n, flux.bytes[l]),
                                               options));
    timings[l].from_file.clear();
    for (int64_t b = 0; b < n; ++b) timings[l].from_file.push_back(engines.back()->in_file(b));
  }
  for (std::size_t l = 0; l < 2; ++l) {
    lists.push_back({engines[l].get(), &timings[l]});
    simulated.push_back({&engines[l]->schedule(), &timings[l]});
  }
  const Simulation predicted = simulate(simulated, link);
  return time_step(*timed, lists, predicted.warmup_passes).step_seconds /
         step_bound(simulated, link);
}

// The two FLUX rows where the engine's spread leaves the disk idle: 1.015 and 1.023 of T*.
TEST(TimedThreeTiers, InferenceWithThePlannersPlacementStaysWithinTwoPercentOfTheBound) {
  EXPECT_GT(infer_flux(0.75, 3e9, false), 1.02);
  for (const auto& [held, disk] : std::vector<std::pair<double, double>>{{0.5, 7e9}, {0.75, 3e9}}) {
    const double step = infer_flux(held, disk, true);
    EXPECT_LE(step, 1.02) << "held " << held << ", disk " << disk;
    EXPECT_GE(step, 1.0 - kClockSlack) << "held " << held << ", disk " << disk;
  }
}

} // namespace
} // namespace blockswap
