// Offloaded activations on the timed device: the real engine's training step with every block's
// saved activations offloaded (time_step with BlockTiming::activation_bytes) against the bound
// T* (step_bound, which counts them), against the same step without offloading, and against
// the simulator's prediction (what `blockswap plan --activation-bytes` predicts), for the FLUX
// and Wan 14B shapes, the link at 25 GB/s, weights at copy/compute ratios 0.5 and 1.0, and
// activations whose copy takes 0.25 to 1.0 of a block's forward; on a duplex link (PCIe: a copy
// engine each way) and on one channel for both ways. Device time: the same on any machine.
//
//   build/bench/activation_bench        # a table (docs/performance.md, "Offloaded activations")
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
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

struct Step {
  double measured = 0, predicted = 0, bound = 0;
};

// One training step of `shape`, K = half of each list, activations of `activation_ratio` of a
// block's forward each way (0: none).
Step step(const Shape& shape, double ratio, double activation_ratio, bool duplex) {
  LinkModel link{25e9, 5e-6};
  link.duplex = duplex;
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
  Device device(timed);
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<BlockTiming> timings;
  for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
    const int64_t n = shape.blocks[l];
    const std::string label = "list " + std::to_string(l);
    engines.push_back(std::make_unique<Engine>(
        device.attach(label), std::vector<std::size_t>(static_cast<std::size_t>(n), shape.bytes[l]),
        EngineOptions{.blocks_to_swap = n / 2, .supports_backward = true}, label));
    const double forward = link.seconds(shape.bytes[l]) / ratio;
    timings.push_back(uniform_timing(n, forward, shape.bytes[l], 2.0));
    if (activation_ratio > 0) {
      timings.back().activation_bytes.assign(
          static_cast<std::size_t>(n),
          static_cast<std::size_t>(activation_ratio * forward * link.bytes_per_second));
    }
  }
  std::vector<TimedList> lists;
  std::vector<SimulatedList> simulated;
  for (std::size_t l = 0; l < engines.size(); ++l) {
    lists.push_back({engines[l].get(), &timings[l]});
    simulated.push_back({&engines[l]->schedule(), &timings[l]});
  }
  return {time_step(*timed, lists).step_seconds, simulate(simulated, link).step_seconds,
          step_bound(simulated, link)};
}

} // namespace

int main() {
  const std::vector<Shape> shapes = {
      {"flux", {19, 38}, {339'600'000 * 2, 141'600'000 * 2}},
      {"wan14b", {40}, {351'000'000 * 2}},
  };
  std::printf(
      "| model | weights copy/compute | activations copy/compute | link | step (s) | T* (s) "
      "| step / T* | step / step without offloading | predicted / step |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& shape : shapes) {
    for (double ratio : {0.5, 1.0}) {
      const Step none = step(shape, ratio, 0, true);
      for (double activations : {0.25, 0.5, 1.0}) {
        for (bool duplex : {true, false}) {
          const Step s = step(shape, ratio, activations, duplex);
          std::printf("| %s | %.2f | %.2f | %s | %.3f | %.3f | %.3f | %.3f | %.3f |\n",
                      shape.name.c_str(), ratio, activations, duplex ? "duplex" : "one channel",
                      s.measured, s.bound, s.measured / s.bound, s.measured / none.measured,
                      s.predicted / s.measured);
        }
      }
    }
  }
  return 0;
}
