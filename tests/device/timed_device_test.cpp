// The timed device: its streams, events and clocks; and the real engine on it against the
// schedule simulator, for every shape.
#include "blockswap/device/timed.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <thread>

#include <time.h>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/device/device.hpp"

namespace blockswap {
namespace {

constexpr double kTolerance = 1e-3; // seconds: the host's own work between calls

TEST(TimedDevice, ComputationsOccupyTheComputeStreamInOrder) {
  TimedDevice device;
  const double start = device.now();
  device.compute(0.5, 1);
  device.compute(0.25, 2);
  EXPECT_NEAR(device.finish() - start, 0.75, kTolerance);
  const auto log = device.take_compute_log();
  ASSERT_EQ(log.size(), 2u);
  EXPECT_EQ(log[0].tag, 1);
  EXPECT_NEAR(log[1].start, log[0].end, 1e-12);
  EXPECT_NEAR(log[1].end - log[1].start, 0.25, 1e-12);
  EXPECT_TRUE(device.take_compute_log().empty());
}

TEST(TimedDevice, CopiesTakeLatencyPlusBytesOverBandwidth) {
  TimedDevice device({.link = {1e9, 0.001}});
  Buffer host = device.allocate_host(1 << 20), dev = device.allocate_device(1 << 20);
  std::vector<CopyRecord> copies;
  device.set_copy_observer([&](const CopyRecord& c) { copies.push_back(c); });
  const double start = device.now();
  device.copy_to_device(dev.data(), host.data(), 500'000'000, 7);
  device.copy_to_host(host.data(), dev.data(), 250'000'000, 8);
  EXPECT_NEAR(device.finish() - start, 0.501 + 0.251, kTolerance);
  EXPECT_NEAR(device.link_busy_seconds(), 0.752, 1e-9);
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_TRUE(copies[0].to_device);
  EXPECT_FALSE(copies[1].to_device);
  EXPECT_EQ(copies[1].tag, 8);
  EXPECT_NEAR(std::chrono::duration<double>(copies[0].end - copies[0].start).count(), 0.501, 1e-6);
}

TEST(TimedDevice, EventsOrderTheStreams) {
  TimedDevice device({.link = {1e9}});
  Buffer host = device.allocate_host(64), dev = device.allocate_device(64);
  auto loaded = device.make_timed_event(), computed = device.make_timed_event();
  const double start = device.now();
  // A load of 1 s, a computation that waits for it, a copy that waits for the computation.
  device.copy_to_device(dev.data(), host.data(), 1'000'000'000, 0);
  device.record(*loaded, Stream::copy);
  device.wait(Stream::compute, *loaded);
  device.compute(0.5);
  device.record(*computed, Stream::compute);
  device.wait(Stream::copy, *computed);
  device.copy_to_host(host.data(), dev.data(), 250'000'000, 0);
  const auto log = device.take_compute_log(); // may be empty yet: the streams run on
  (void)log;
  EXPECT_NEAR(device.finish() - start, 1.0 + 0.5 + 0.25, kTolerance);
  const std::optional<double> gap = device.elapsed_seconds(*loaded, *computed);
  ASSERT_TRUE(gap.has_value());
  EXPECT_NEAR(*gap, 0.5, 1e-9);
  EXPECT_TRUE(device.times_events());
}

TEST(TimedDevice, TheHostWaitsInDeviceTimeAndItsWorkCounts) {
  TimedDevice device;
  auto done = device.make_event();
  const double start = device.now();
  device.compute(2.0);
  device.record(*done, Stream::compute);
  const auto real = std::chrono::steady_clock::now();
  device.synchronize(*done);
  // Two seconds of device time, almost no real time.
  EXPECT_NEAR(device.now() - start, 2.0, kTolerance);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - real).count(), 1.0);
  // Host work between calls (CPU time) is on the host's clock: a computation enqueued after it
  // starts no earlier. Sleeping is not work.
  auto cpu_seconds = [] {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
  };
  const double before_work = device.now();
  const double cpu_start = cpu_seconds();
  volatile uint64_t spin = 0;
  while (cpu_seconds() - cpu_start < 0.03) spin = spin + 1; // 30 ms of this thread's CPU
  EXPECT_GE(device.now() - before_work, 0.03);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const double after_sleep = device.now();
  EXPECT_LT(after_sleep - before_work, 0.045); // the sleep added (almost) nothing
  device.compute(0.1);
  EXPECT_GE(device.finish() - start, 2.0 + 0.03 + 0.1 - 1e-9);
}

TEST(TimedDevice, MemoryIsAccountedAndHoldsNoData) {
  TimedDevice device({.link = {}, .capacity_bytes = 1000});
  Buffer a = device.allocate_device(500);
  EXPECT_EQ(device.memory().device_bytes, 512u);
  EXPECT_THROW(device.allocate_device(600), OutOfMemory);
  a.reset();
  EXPECT_EQ(device.memory().device_bytes, 0u);
  EXPECT_EQ(device.memory().peak_device_bytes, 512u);
  // Host memory is address space only: far more than this machine has costs nothing.
  std::vector<Buffer> huge;
  for (int i = 0; i < 8; ++i) huge.push_back(device.allocate_host(std::size_t{16} << 30));
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(huge[0].data()) = 1, "");
}

TEST(TimedDevice, RejectsABadLinkAndAForeignEvent) {
  EXPECT_THROW(TimedDevice({.link = {0}}), Error);
  EXPECT_THROW(TimedDevice({.link = {1e9, -1}}), Error);
  TimedDevice device;
  EXPECT_THROW(device.compute(-1), Error);
  class Foreign final : public Event {};
  Foreign foreign;
  EXPECT_THROW(device.record(foreign, Stream::copy), Error);
  // An event of another timed device would carry that device's clock: refused too.
  TimedDevice other;
  auto theirs = other.make_event();
  EXPECT_THROW(device.wait(Stream::compute, *theirs), Error);
  EXPECT_THROW(device.compute(std::numeric_limits<double>::infinity()), Error);
  EXPECT_THROW(TimedDevice({.link = {std::numeric_limits<double>::infinity()}}), Error);
}

TEST(TimedDevice, TimeStepRefusesEnginesInDifferentModes) {
  auto device = std::make_shared<TimedDevice>();
  Engine infer(device, std::vector<std::size_t>(3, 1000), {.blocks_to_swap = 1});
  Engine train(device, std::vector<std::size_t>(4, 1000),
               {.blocks_to_swap = 1, .supports_backward = true});
  const BlockTiming t3 = uniform_timing(3, 0.01, 1000), t4 = uniform_timing(4, 0.01, 1000);
  const TimedList lists[] = {{&infer, &t3}, {&train, &t4}};
  EXPECT_THROW(time_step(*device, lists), Error);
}

// The link's busy time per pass is the simulator's, whatever the warm-up.
TEST(TimedDevice, LinkBusyPerPassIsTheSimulators) {
  const LinkModel link{1e9, 0};
  const BlockTiming timing = uniform_timing(8, 0.01, 10'000'000);
  for (int warmup : {0, 6, 60}) {
    auto device = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
    Engine engine(device, timing.bytes, {.blocks_to_swap = 1});
    const TimedList list{&engine, &timing};
    const TimedStep step = time_step(*device, std::span(&list, 1), warmup);
    EXPECT_NEAR(step.link_busy_seconds, simulate(engine.schedule(), timing, link).link_busy_seconds,
                1e-9)
        << "warm-up " << warmup;
  }
}

// The engine's stall, measured with events on the device, is the simulator's.
TEST(TimedDevice, EngineStallIsMeasuredOnTheDevice) {
  auto device = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = {1e3}});
  Engine engine(device, std::vector<std::size_t>(4, 1000), {.blocks_to_swap = 3});
  const BlockTiming timing = uniform_timing(4, 1.0, 1000);
  const TimedList list{&engine, &timing};
  engine.reset_stats();
  const TimedStep step = time_step(*device, std::span(&list, 1));
  // One slot: every block waits one load of 1 s.
  EXPECT_NEAR(step.step_seconds, 8.0, kTolerance);
  EXPECT_NEAR(step.stall_seconds, 4.0, kTolerance);
  engine.synchronize();
  EXPECT_NEAR(engine.stats().stall_seconds, 4.0 * (2 * kPassesPerChunk) - 1.0, kTolerance * 8);
}

// The real engine on the timed device takes the time the simulator predicts, within 2 %, for
// every N in 1..48, every K, both modes, blockswap and the seed replay.
TEST(TimedDevice, AgreesWithTheSimulatorForEveryShape) {
  constexpr double kForward = 0.05;          // seconds of device time: the host's work is noise
  constexpr std::size_t kBytes = 50'000'000; // at 1 GB/s, one block's copy is its forward
  for (double ratio : {1.0}) {
    const LinkModel link{1e9 / ratio, 1e-4};
    for (int64_t n = 1; n <= 48; ++n) {
      const BlockTiming timing = uniform_timing(n, kForward, kBytes, 2.0);
      for (Mode mode : {Mode::forward_only, Mode::training}) {
        for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, mode); ++k) {
          for (Algorithm algorithm : {Algorithm::blockswap, Algorithm::seed}) {
            if (k > Schedule::max_blocks_to_swap(n, mode, algorithm)) continue;
            auto device = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
            Engine engine(device, std::vector<std::size_t>(n, kBytes),
                          {.blocks_to_swap = k,
                           .supports_backward = mode == Mode::training,
                           .algorithm = algorithm});
            const TimedList list{&engine, &timing};
            const Simulation predicted = simulate(engine.schedule(), timing, link);
            const TimedStep measured =
                time_step(*device, std::span(&list, 1), predicted.warmup_passes);
            ASSERT_NEAR(measured.step_seconds / predicted.step_seconds, 1.0, 0.02)
                << engine.schedule().describe() << ": measured " << measured.step_seconds
                << " s, simulated " << predicted.step_seconds << " s";
            ASSERT_NEAR(measured.stall_seconds, predicted.stall_seconds,
                        0.02 * predicted.step_seconds)
                << engine.schedule().describe();
          }
        }
      }
    }
  }
}

// Blocks that differ in compute and size, every R, a latency, both algorithms: random shapes.
TEST(TimedDevice, AgreesWithTheSimulatorForUnevenBlocks) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 40; ++trial) {
    const Mode mode = trial % 2 == 0 ? Mode::forward_only : Mode::training;
    const Algorithm algorithm = trial % 4 < 2 ? Algorithm::blockswap : Algorithm::seed;
    const int64_t n = std::uniform_int_distribution<int64_t>(2, 20)(rng);
    const int64_t k = std::uniform_int_distribution<int64_t>(
        0, Schedule::max_blocks_to_swap(n, mode, algorithm))(rng);
    const int64_t r = mode == Mode::forward_only && k > 0 && algorithm == Algorithm::blockswap
                          ? std::uniform_int_distribution<int64_t>(1, n - k)(rng)
                          : 0;
    BlockTiming timing;
    for (int64_t b = 0; b < n; ++b) {
      timing.forward_seconds.push_back(std::uniform_real_distribution<double>(0.01, 0.1)(rng));
      timing.bytes.push_back(std::uniform_int_distribution<std::size_t>(1, 100)(rng) * 1'000'000);
    }
    const LinkModel link{1e9, 2e-4};
    auto device = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
    Engine engine(device, timing.bytes,
                  {.blocks_to_swap = k,
                   .supports_backward = mode == Mode::training,
                   .rotating_slots = r,
                   .algorithm = algorithm});
    const Simulation predicted = simulate(engine.schedule(), timing, link);
    const TimedList list{&engine, &timing};
    const TimedStep measured = time_step(*device, std::span(&list, 1), predicted.warmup_passes);
    ASSERT_NEAR(measured.step_seconds / predicted.step_seconds, 1.0, 0.02)
        << "trial " << trial << ": " << engine.schedule().describe();
  }
}

// Two block lists of different sizes on one device (a FLUX-shaped model): one copy stream for
// both, as the simulator plays them.
TEST(TimedDevice, TwoListsOnOneDeviceAgreeWithTheSimulator) {
  const LinkModel link{1e9, 1e-4};
  for (Mode mode : {Mode::forward_only, Mode::training}) {
    auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
    Device device(timed);
    const bool train = mode == Mode::training;
    Engine doubles(device.attach("double"), std::vector<std::size_t>(6, 80'000'000),
                   {.blocks_to_swap = 3, .supports_backward = train}, "double");
    Engine singles(device.attach("single"), std::vector<std::size_t>(12, 40'000'000),
                   {.blocks_to_swap = 7, .supports_backward = train}, "single");
    const BlockTiming td = uniform_timing(6, 0.08, 80'000'000),
                      ts = uniform_timing(12, 0.04, 40'000'000);
    const TimedList lists[] = {{&doubles, &td}, {&singles, &ts}};
    const SimulatedList simulated[] = {{&doubles.schedule(), &td}, {&singles.schedule(), &ts}};
    const Simulation predicted = simulate(simulated, link);
    const TimedStep measured = time_step(*timed, lists, predicted.warmup_passes);
    EXPECT_NEAR(measured.step_seconds / predicted.step_seconds, 1.0, 0.02) << to_string(mode);
    EXPECT_GE(measured.step_seconds, step_bound(simulated, link) * (1 - 1e-9));
  }
}

// The file tier on the timed device: the disk in series with the link, as the simulator plays
// it, for disks faster than, as fast as and slower than the link, every host budget (the copy
// waits for the read on the copy stream, the host only where the block is computed: neither
// the engine nor the simulator lets a read hold back the host's enqueueing). Training is a step
// of a sequence (Note [training steps in sequence]): when both played the first step alone, the
// engine's prepare() had read ahead for it and the simulator was up to 2.6 % slower.
TEST(TimedDevice, TheFileTierAgreesWithTheSimulator) {
  constexpr int64_t n = 12;
  constexpr std::size_t kBytes = 50'000'000;
  const BlockTiming base = uniform_timing(n, 0.05, kBytes, 2.0);
  for (double disk : {4e9, 1e9, 0.5e9}) {
    const LinkModel link{1e9, 1e-4, disk, 2};
    for (Mode mode : {Mode::forward_only, Mode::training}) {
      for (int64_t k : {2, 6, 10}) {
        for (std::size_t budget_blocks : {0, 3}) {
          auto device = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
          EngineOptions options{.blocks_to_swap = k, .supports_backward = mode == Mode::training};
          options.trainable_bytes.assign(n, 0);
          options.file = FileTier{{},
                                  std::vector<FileBlock>(n, FileBlock{{}, kBytes, nullptr}),
                                  budget_blocks * kBytes,
                                  2,
                                  CacheBypass::direct};
          Engine engine(device, std::vector<std::size_t>(n, kBytes), options);
          BlockTiming timing = base;
          for (int64_t b = 0; b < n; ++b) timing.from_file.push_back(engine.in_file(b));
          const Simulation predicted = simulate(engine.schedule(), timing, link);
          const TimedList list{&engine, &timing};
          const TimedStep measured =
              time_step(*device, std::span(&list, 1), predicted.warmup_passes);
          const std::string what = engine.schedule().describe() + ", disk " +
                                   std::to_string(disk / 1e9) + " GB/s, budget " +
                                   std::to_string(budget_blocks);
          const double ratio = measured.step_seconds / predicted.step_seconds;
          EXPECT_LE(ratio, 1.02) << what;
          EXPECT_GE(ratio, 0.98) << what << ": measured " << measured.step_seconds
                                 << " s, simulated " << predicted.step_seconds << " s";
          EXPECT_GE(measured.step_seconds, step_bound(engine.schedule(), timing, link) * (1 - 1e-6))
              << what;
        }
      }
    }
  }
}

} // namespace
} // namespace blockswap

namespace blockswap {
namespace {

// A pipeline stage's micro-batches (Note [halves in the simulator]): the engine's turns, a
// forward after a forward and a backward after a backward, played on the timed device as the
// simulator plays them, two lists, GPipe and 1F1B, the seed's layout and rotating slots, links
// slower and faster than the compute.
TEST(TimedDevice, PipelineHalvesAgreeWithTheSimulator) {
  for (const double gbps : {0.5, 2.0}) {
    const LinkModel link{gbps * 1e9, 1e-4};
    for (const int64_t rotating : {0, 1, 2}) {
      for (const PipelineSchedule kind : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
        auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
        Device device(timed);
        Engine doubles(
            device.attach("double"), std::vector<std::size_t>(6, 80'000'000),
            {.blocks_to_swap = 3, .supports_backward = true, .training_rotating_slots = rotating},
            "double");
        Engine singles(
            device.attach("single"), std::vector<std::size_t>(12, 40'000'000),
            {.blocks_to_swap = 7, .supports_backward = true, .training_rotating_slots = rotating},
            "single");
        const BlockTiming td = uniform_timing(6, 0.08, 80'000'000),
                          ts = uniform_timing(12, 0.04, 40'000'000);
        const TimedList lists[] = {{&doubles, &td}, {&singles, &ts}};
        const SimulatedList simulated[] = {{&doubles.schedule(), &td}, {&singles.schedule(), &ts}};
        const auto halves = pipeline_halves(kind, 3, 0, 5);
        const Simulation predicted = simulate_halves(simulated, halves, link);
        doubles.prepare();
        singles.prepare();
        doubles.reset_stats();
        singles.reset_stats();
        const TimedStep measured = time_halves(*timed, lists, halves);
        const std::string what =
            detail::concat(to_string(kind), " R=", rotating, " ", gbps, " GB/s");
        EXPECT_NEAR(measured.step_seconds / predicted.step_seconds, 1.0, 0.02) << what;
        EXPECT_NEAR(measured.link_busy_seconds / predicted.link_busy_seconds, 1.0, 0.01) << what;
        EXPECT_EQ(doubles.stats().h2d_bytes, doubles.schedule().loads(halves) * 80'000'000) << what;
        EXPECT_EQ(singles.stats().h2d_bytes, singles.schedule().loads(halves) * 40'000'000) << what;
      }
    }
  }
}

} // namespace
} // namespace blockswap
