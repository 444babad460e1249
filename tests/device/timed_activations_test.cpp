// Offloaded activations on the timed device (TimedDevice::copy_out_after_compute, copy_in_after,
// and time_step with BlockTiming::activation_bytes): the device->host channel beside the link
// when it is duplex, and the real engine's step against the schedule simulator and T*.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/device/timed.hpp"

namespace blockswap {
namespace {

constexpr double kTolerance = 1e-3; // seconds: the host's own work between calls

TEST(TimedActivations, CopiesOutRunBesideTheLinkOnlyWhenDuplex) {
  for (bool duplex : {true, false}) {
    LinkModel link{1e9};
    link.duplex = duplex;
    TimedDevice device({.link = link});
    Buffer host = device.allocate_host(64), dev = device.allocate_device(64);
    std::vector<CopyRecord> observed;
    device.set_copy_observer([&](const CopyRecord& c) { observed.push_back(c); });
    const double start = device.now();
    device.compute(0.25);
    const auto out = device.copy_out_after_compute(500'000'000); // after the computation
    device.copy_to_device(dev.data(), host.data(), 500'000'000, 1);
    const auto in = device.copy_in_after(250'000'000, *out);
    device.wait(Stream::compute, *in);
    device.compute(0.1);
    // Duplex: the load runs under the computation and the copy out; the copy back follows both.
    // One channel: the copy out, enqueued first, waits for the computation; then the load, then
    // the copy back.
    const double expected = duplex ? 0.25 + 0.5 + 0.25 + 0.1 : 0.25 + 0.5 + 0.5 + 0.25 + 0.1;
    EXPECT_NEAR(device.finish() - start, expected, kTolerance) << duplex;
    EXPECT_NEAR(device.activations_out_busy_seconds(), duplex ? 0.5 : 0.0, 1e-9);
    EXPECT_NEAR(device.link_busy_seconds(), duplex ? 0.75 : 1.25, 1e-9);
    ASSERT_EQ(observed.size(), 1u); // the engine's copies only
    EXPECT_EQ(observed[0].tag, 1);
  }
}

// Every activation size against a block's compute, every K, both kinds of link: within 2 % of
// the simulator, never under T*.
TEST(TimedActivations, TheEngineAgreesWithTheSimulator) {
  constexpr std::size_t kBytes = 50'000'000;
  for (bool duplex : {true, false}) {
    LinkModel link{1e9, 1e-4};
    link.duplex = duplex;
    for (int64_t n : {6, 12}) {
      for (int64_t k : {int64_t{0}, n / 2, n - 2}) {
        for (double share : {0.25, 1.0, 2.0}) { // activations' copy against a block's forward
          auto device = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
          Engine engine(device, std::vector<std::size_t>(n, kBytes),
                        {.blocks_to_swap = k, .supports_backward = true});
          BlockTiming timing = uniform_timing(n, 0.05, kBytes, 2.0);
          timing.activation_bytes.assign(static_cast<std::size_t>(n),
                                         static_cast<std::size_t>(share * 0.05 * 1e9));
          const Simulation predicted = simulate(engine.schedule(), timing, link);
          const TimedList list{&engine, &timing};
          const TimedStep measured = time_step(*device, std::span(&list, 1));
          const std::string what = engine.schedule().describe() + ", share " +
                                   std::to_string(share) + (duplex ? ", duplex" : ", one channel");
          EXPECT_NEAR(measured.step_seconds / predicted.step_seconds, 1.0, 0.02)
              << what << ": measured " << measured.step_seconds << " s, simulated "
              << predicted.step_seconds << " s";
          EXPECT_GE(measured.step_seconds, step_bound(engine.schedule(), timing, link) * (1 - 1e-6))
              << what;
          EXPECT_NEAR(measured.activations_out_busy_seconds,
                      duplex ? predicted.d2h_busy_seconds : 0.0, 1e-6)
              << what;
        }
      }
    }
  }
}

TEST(TimedActivations, TwoListsHandOverAsTheSimulatorSays) {
  const LinkModel link{1e9, 1e-4};
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
  Device device(timed);
  Engine doubles(device.attach("double"), std::vector<std::size_t>(6, 80'000'000),
                 {.blocks_to_swap = 3, .supports_backward = true}, "double");
  Engine singles(device.attach("single"), std::vector<std::size_t>(12, 40'000'000),
                 {.blocks_to_swap = 7, .supports_backward = true}, "single");
  BlockTiming td = uniform_timing(6, 0.08, 80'000'000), ts = uniform_timing(12, 0.04, 40'000'000);
  td.activation_bytes.assign(6, 60'000'000);
  ts.activation_bytes.assign(12, 30'000'000);
  const TimedList lists[] = {{&doubles, &td}, {&singles, &ts}};
  const SimulatedList simulated[] = {{&doubles.schedule(), &td}, {&singles.schedule(), &ts}};
  const Simulation predicted = simulate(simulated, link);
  const TimedStep measured = time_step(*timed, lists);
  EXPECT_NEAR(measured.step_seconds / predicted.step_seconds, 1.0, 0.02);
  EXPECT_GE(measured.step_seconds, step_bound(simulated, link) * (1 - 1e-9));
  // Every block's activations but the last single block's go out.
  EXPECT_NEAR(measured.activations_out_busy_seconds,
              6 * link.seconds(60'000'000) + 11 * link.seconds(30'000'000), 1e-9);
}

} // namespace
} // namespace blockswap
