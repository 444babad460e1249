// `blockswap plan --stages S`: the model's blocks cut into S pipeline stages, each stage's K per
// list for the budget (each stage its own device), and what each stage's micro-batches cost in
// the pipeline schedule's order: loads per step (Schedule::loads) and the stage's time on the
// simulator (simulate_halves) in the seed's training layout and with rotating slots (Note
// [training rotation] in src/core/schedule.cpp), against the stage without swapping.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "blockswap/core/error.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/model_io/model_plan.hpp"
#include "blockswap/model_io/size.hpp"
#include "commands.hpp"

namespace blockswap::tool {
namespace {

struct Choice {
  int64_t rotating = 0;       // training_rotating_slots: 0 the seed's layout
  int64_t loads = 0;          // per step
  double seconds = 0;         // the stage's step on the simulator
  std::vector<int64_t> slots; // per list, the R its schedule rotates through
};

struct StagePlan {
  std::vector<std::string> names;
  std::vector<BlockRange> ranges;
  std::vector<int64_t> ks;
  uint64_t device_bytes = 0;
  double noswap_seconds = 0;
  std::vector<Choice> choices; // the seed's layout first
  std::size_t best = 0;
};

// The stage's step on the simulator (simulate_halves, which the timed device running the engine
// matches: bench/pipeline_stage_bench).
Choice time_stage(const std::vector<std::vector<std::size_t>>& lists,
                  const std::vector<BlockTiming>& timings, const std::vector<int64_t>& ks,
                  int64_t rotating, const std::vector<Op::Kind>& halves, const LinkModel& link) {
  std::vector<Schedule> schedules;
  Choice choice;
  choice.rotating = rotating;
  for (std::size_t l = 0; l < lists.size(); ++l) {
    schedules.emplace_back(
        ScheduleOptions{static_cast<int64_t>(lists[l].size()), ks[l], Mode::training, rotating});
    choice.loads += schedules.back().loads(halves);
    choice.slots.push_back(schedules.back().rotating_slots());
  }
  std::vector<SimulatedList> simulated;
  for (std::size_t l = 0; l < lists.size(); ++l) simulated.push_back({&schedules[l], &timings[l]});
  choice.seconds = simulate_halves(simulated, halves, link).step_seconds;
  return choice;
}

} // namespace

int plan_pipeline(const PlanArgs& args, const ModelLayout& layout, uint64_t budget) {
  BLOCKSWAP_CHECK(args.mode == "train", "--stages plans pipeline training: use --mode train");
  BLOCKSWAP_CHECK(args.host_budget.empty() && args.activation_bytes.empty(),
                  "--stages does not predict the file tier or offloaded activations yet: leave "
                  "out --host-budget and --activation-bytes");
  BLOCKSWAP_CHECK(args.pipeline == "gpipe" || args.pipeline == "1f1b",
                  "--pipeline must be gpipe or 1f1b, got '", args.pipeline, "'");
  const PipelineSchedule kind =
      args.pipeline == "gpipe" ? PipelineSchedule::gpipe : PipelineSchedule::one_f_one_b;
  const std::vector<std::vector<std::size_t>> lists = block_lists(layout);
  LinkModel link{args.link_gbps * 1e9, 5e-6};
  uint64_t largest = 1;
  for (const BlockGroup& g : layout.groups) largest = std::max(largest, g.largest_bytes());
  std::vector<StagePlan> plans;
  const auto split = split_stages(lists, args.stages, layout.non_block_bytes);
  for (int64_t s = 0; s < args.stages; ++s) {
    StagePlan& p = plans.emplace_back();
    std::vector<std::vector<std::size_t>> sizes;
    std::vector<BlockTiming> timings;
    for (std::size_t g = 0; g < lists.size(); ++g) {
      const BlockRange r = split[static_cast<std::size_t>(s)][g];
      if (r.end == r.begin) continue;
      const BlockGroup& group = layout.groups[g];
      p.names.push_back(group.name);
      p.ranges.push_back(r);
      sizes.emplace_back(lists[g].begin() + r.begin, lists[g].begin() + r.end);
      BlockTiming& t = timings.emplace_back();
      for (int64_t b = r.begin; b < r.end; ++b) {
        const auto i = static_cast<std::size_t>(b);
        t.forward_seconds.push_back(args.block_ms > 0
                                        ? args.block_ms * 1e-3 * double(group.block_bytes[i]) /
                                              double(largest)
                                        : 2.0 * double(group.block_elements[i]) *
                                              double(args.tokens) / (args.tflops * 1e12));
        t.bytes.push_back(group.block_bytes[i]);
      }
    }
    // The bytes outside the groups (embedders, final layer) count on the first stage.
    const uint64_t fixed = s == 0 ? layout.non_block_bytes : 0;
    SwapPlan swap;
    try {
      swap = plan_swaps(sizes, budget, Mode::training, fixed);
    } catch (const Error& e) {
      throw Error(detail::concat("stage ", s, " of ", args.stages, ": ", e.what()));
    }
    for (const ListPlan& l : swap.lists) p.ks.push_back(l.blocks_to_swap);
    p.device_bytes = swap.device_bytes;
    const auto halves = pipeline_halves(kind, args.stages, s, args.micro_batches);
    const auto forwards = std::count(halves.begin(), halves.end(), Op::Kind::forward);
    for (const BlockTiming& t : timings) {
      for (double f : t.forward_seconds) p.noswap_seconds += double(forwards) * f * 3.0;
    }
    for (const int64_t rotating : {0, 2, 1}) {
      p.choices.push_back(time_stage(sizes, timings, p.ks, rotating, halves, link));
      // The fastest; within 0.1 % the one loading fewer blocks, then the seed's layout. A choice
      // no schedule takes up is the seed's again.
      const Choice& c = p.choices.back();
      const Choice& best = p.choices[p.best];
      if (c.slots == best.slots) continue;
      if (c.seconds < best.seconds * 0.999 ||
          (c.seconds <= best.seconds * 1.001 && c.loads < best.loads)) {
        p.best = p.choices.size() - 1;
      }
    }
  }

  if (args.json) {
    nlohmann::json stages = nlohmann::json::array();
    for (const StagePlan& p : plans) {
      nlohmann::json lists_json = nlohmann::json::array();
      for (std::size_t l = 0; l < p.names.size(); ++l) {
        lists_json.push_back({{"group", p.names[l]},
                              {"first_block", p.ranges[l].begin},
                              {"end_block", p.ranges[l].end},
                              {"blocks_to_swap", p.ks[l]}});
      }
      nlohmann::json choices = nlohmann::json::array();
      for (std::size_t i = 0; i < p.choices.size(); ++i) {
        const Choice& c = p.choices[i];
        if (i > 0 && c.slots == p.choices[0].slots) continue; // the seed's layout again
        choices.push_back({{"training_rotating_slots", c.rotating},
                           {"loads_per_step", c.loads},
                           {"predicted_step_seconds", c.seconds}});
      }
      stages.push_back({{"lists", lists_json},
                        {"device_bytes", p.device_bytes},
                        {"predicted_noswap_seconds", p.noswap_seconds},
                        {"choices", choices},
                        {"training_rotating_slots", p.choices[p.best].rotating}});
    }
    std::cout << nlohmann::json{{"model", args.model},
                                {"pipeline", args.pipeline},
                                {"micro_batches", args.micro_batches},
                                {"budget_bytes", budget},
                                {"link_gbps", args.link_gbps},
                                {"stages", stages}}
                     .dump(2)
              << "\n";
    return 0;
  }
  std::printf("%s: %lld %s pipeline stages, %lld micro-batch(es) per step, budget %s per "
              "stage\n\n",
              args.model.c_str(), static_cast<long long>(args.stages), to_string(kind),
              static_cast<long long>(args.micro_batches), format_bytes(budget).c_str());
  std::vector<std::string> blocks;
  int width = 16;
  for (const StagePlan& p : plans) {
    std::string b;
    for (std::size_t l = 0; l < p.names.size(); ++l) {
      b += detail::concat(l ? ", " : "", p.names[l], " ", p.ranges[l].begin, "-",
                          p.ranges[l].end - 1, " (", p.ks[l], ")");
    }
    width = std::max(width, static_cast<int>(b.size()));
    blocks.push_back(std::move(b));
  }
  std::printf("%-5s %-*s %18s %18s %18s  %s\n", "stage", width, "blocks (swapped)", "seed layout",
              "R=2", "R=1", "training_rotating_slots");
  for (std::size_t s = 0; s < plans.size(); ++s) {
    const StagePlan& p = plans[s];
    std::printf("%-5zu %-*s", s, width, blocks[s].c_str());
    for (std::size_t c = 0; c < p.choices.size(); ++c) {
      const Choice& choice = p.choices[c];
      if (c > 0 && choice.slots == p.choices[0].slots) {
        std::printf(" %18s", "(the seed's)");
        continue;
      }
      std::printf(" %6lld loads x%.3f", static_cast<long long>(choice.loads),
                  choice.seconds / p.noswap_seconds);
    }
    std::printf("  %lld\n", static_cast<long long>(p.choices[p.best].rotating));
  }
  std::printf("\nloads per step; xT: the stage's step (the schedule simulator) against the same "
              "stage without swapping\n(a stage alone: the pipeline adds its bubble either "
              "way). Set training_rotating_slots per stage\nas the last column says "
              "(docs/distributed.md, \"Pipeline stages\").\n");
  return 0;
}

} // namespace blockswap::tool
