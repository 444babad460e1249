// Block swapping inside pipeline stages on the timed device: FLUX.1's 57 blocks split into 2 or
// 4 stages (split_stages), each stage's blocks swapped by its own engines (K per list from the
// planner for a device budget of half the stage's bytes), its
// micro-batches' halves played in GPipe's and 1F1B's order (time_halves), in the seed's training
// layout and with R = 2 rotating slots (Note [training rotation] in src/core/schedule.cpp).
// Per stage: loads per step measured against Schedule::loads, the stage's time against its bound
// T* = max(compute, link: its loads' copies one after another) and against the same stage
// without swapping (its compute); last, the slowest stage against the slowest without swapping.
// A stage's own time: it never waits for its neighbours, so the pipeline's step is about the
// slowest stage's plus the schedule's bubble, swapped or not. Last, the simulator's prediction
// (simulate_halves): its largest error over the stages. Device
// time: the same on any machine.
//
//   build/bench/pipeline_stage_bench   # a table (docs/distributed.md, "Pipeline stages")
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/schedule.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/device/timed.hpp"

namespace {

using namespace blockswap;

constexpr std::size_t kDouble = std::size_t{340'000'000} * 2; // bf16 bytes of a double block
constexpr std::size_t kSingle = std::size_t{142'000'000} * 2; // of a single block

// A stage's lists: its share of the double blocks, then of the single blocks.
struct Stage {
  std::vector<int64_t> blocks;
  std::vector<std::size_t> bytes;
  std::vector<int64_t> ks; // the planner's, for half the stage's bytes on the device
};

// FLUX.1's 19 double and 38 single blocks in `stages` contiguous stages of about equal bytes.
std::vector<Stage> split_flux(int64_t stages) {
  const std::vector<std::vector<std::size_t>> lists{std::vector<std::size_t>(19, kDouble),
                                                    std::vector<std::size_t>(38, kSingle)};
  std::vector<Stage> out;
  for (const std::vector<BlockRange>& ranges : split_stages(lists, stages)) {
    Stage& stage = out.emplace_back();
    for (std::size_t l = 0; l < ranges.size(); ++l) {
      if (ranges[l].end == ranges[l].begin) continue;
      stage.blocks.push_back(ranges[l].end - ranges[l].begin);
      stage.bytes.push_back(lists[l][0]);
    }
    std::vector<std::vector<std::size_t>> sizes;
    std::size_t total = 0;
    for (std::size_t l = 0; l < stage.blocks.size(); ++l) {
      sizes.emplace_back(static_cast<std::size_t>(stage.blocks[l]), stage.bytes[l]);
      total += sizes.back().size() * stage.bytes[l];
    }
    for (const ListPlan& list : plan_swaps(sizes, total / 2, Mode::training).lists) {
      stage.ks.push_back(list.blocks_to_swap);
    }
  }
  return out;
}

struct Result {
  double seconds = 0, bound = 0, noswap = 0, predicted_seconds = 0; // simulate_halves'
  int64_t loads = 0, predicted = 0;
};

Result run_stage(const Stage& stage, const std::vector<Op::Kind>& halves, double ratio,
                 int64_t rotating, const LinkModel& link) {
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
  Device device(timed);
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<BlockTiming> timings;
  Result r;
  double link_seconds = 0;
  for (std::size_t l = 0; l < stage.blocks.size(); ++l) {
    const int64_t n = stage.blocks[l];
    const std::string label = "list " + std::to_string(l);
    engines.push_back(std::make_unique<Engine>(
        device.attach(label), std::vector<std::size_t>(static_cast<std::size_t>(n), stage.bytes[l]),
        EngineOptions{.blocks_to_swap = stage.ks[l],
                      .supports_backward = true,
                      .training_rotating_slots = rotating},
        label));
    const double forward = link.seconds(stage.bytes[l]) / ratio;
    timings.push_back(uniform_timing(n, forward, stage.bytes[l], 2.0));
    const int64_t loads = engines.back()->schedule().loads(halves);
    r.predicted += loads;
    link_seconds += static_cast<double>(loads) * link.seconds(stage.bytes[l]);
    const auto forwards = std::count(halves.begin(), halves.end(), Op::Kind::forward);
    r.noswap += static_cast<double>(forwards) * static_cast<double>(n) * forward * 3.0;
  }
  std::vector<TimedList> lists;
  std::vector<SimulatedList> simulated;
  for (std::size_t l = 0; l < engines.size(); ++l) {
    lists.push_back({engines[l].get(), &timings[l]});
    simulated.push_back({&engines[l]->schedule(), &timings[l]});
  }
  r.predicted_seconds = simulate_halves(simulated, halves, link).step_seconds;
  for (auto& engine : engines) { // from the steady state: the blocks a pass starts with loaded
    engine->prepare();
    engine->reset_stats();
  }
  r.seconds = time_halves(*timed, lists, halves).step_seconds;
  for (std::size_t l = 0; l < engines.size(); ++l) {
    r.loads += static_cast<int64_t>(engines[l]->stats().h2d_bytes / stage.bytes[l]);
  }
  r.bound = std::max(r.noswap, link_seconds);
  return r;
}

} // namespace

int main() {
  const LinkModel link{25e9, 5e-6}; // PCIe 4, pinned; a copy's launch cost
  std::printf(
      "FLUX.1 in pipeline stages, half of each stage's bytes on the device, link 25 GB/s\n");
  for (const int64_t stages : {2, 4}) {
    std::printf("%lld stages, blocks (K) per list:", static_cast<long long>(stages));
    for (const Stage& stage : split_flux(stages)) {
      std::printf(" [");
      for (std::size_t l = 0; l < stage.blocks.size(); ++l) {
        std::printf("%s%lld (%lld) %s", l ? ", " : "", static_cast<long long>(stage.blocks[l]),
                    static_cast<long long>(stage.ks[l]),
                    stage.bytes[l] == kDouble ? "double" : "single");
      }
      std::printf("]");
    }
    std::printf("\n");
  }
  std::printf("%-7s %-6s %3s %5s %-5s | per stage: loads measured/predicted, t/T*, t/t_noswap\n",
              "stages", "sched", "M", "ratio", "R");
  for (const int64_t stages : {2, 4}) {
    const std::vector<Stage> split = split_flux(stages);
    for (const PipelineSchedule kind : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
      for (const int64_t micro_batches : {4, 8}) {
        for (const double ratio : {0.5, 1.0, 2.0}) {
          for (const int64_t rotating : {0, 2}) {
            std::printf("%-7lld %-6s %3lld %5.1f %-5s |", static_cast<long long>(stages),
                        to_string(kind), static_cast<long long>(micro_batches), ratio,
                        rotating == 0 ? "seed" : std::to_string(rotating).c_str());
            double slowest = 0, slowest_noswap = 0, worst_prediction = 0;
            for (int64_t s = 0; s < stages; ++s) {
              const auto halves = pipeline_halves(kind, stages, s, micro_batches);
              const Result r =
                  run_stage(split[static_cast<std::size_t>(s)], halves, ratio, rotating, link);
              slowest = std::max(slowest, r.seconds);
              worst_prediction =
                  std::max(worst_prediction, std::abs(r.seconds / r.predicted_seconds - 1));
              slowest_noswap = std::max(slowest_noswap, r.noswap);
              std::printf(" %lld/%lld %.3f %.3f%s", static_cast<long long>(r.loads),
                          static_cast<long long>(r.predicted), r.seconds / r.bound,
                          r.seconds / r.noswap, s + 1 < stages ? " ;" : "");
            }
            std::printf(" | slowest stage / without swapping %.3f | simulator off by %.2f %%\n",
                        slowest / slowest_noswap, 100 * worst_prediction);
          }
        }
      }
    }
  }
  return 0;
}
