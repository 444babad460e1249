// `blockswap plan`: how many blocks of each group to swap to fit a device budget.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>

#include "blockswap/core/error.hpp"
#include "blockswap/model_io/model_plan.hpp"
#include "blockswap/model_io/safetensors.hpp"
#include "commands.hpp"

namespace blockswap::tool {

int plan_command(const PlanArgs& args) {
  BLOCKSWAP_CHECK(args.mode == "infer" || args.mode == "train",
                  "--mode must be infer or train, got '", args.mode, "'");
  const Mode mode = args.mode == "train" ? Mode::training : Mode::forward_only;
  const uint64_t budget = parse_size(args.budget);
  const SafetensorsHeader header = read_safetensors_header(args.model);
  const ModelLayout layout = group_blocks(header.tensors);
  const ModelPlan plan = plan_model(layout, budget, mode);

  if (args.json) {
    nlohmann::json groups = nlohmann::json::array();
    for (const GroupPlan& g : plan.groups) {
      groups.push_back({{"name", g.name},
                        {"blocks", g.blocks},
                        {"block_bytes", g.block_bytes},
                        {"total_bytes", g.total_bytes},
                        {"blocks_to_swap", g.blocks_to_swap},
                        {"device_bytes", g.device_bytes},
                        {"moved_bytes", g.moved_bytes}});
    }
    const nlohmann::json out{{"model", args.model},
                             {"mode", args.mode},
                             {"budget_bytes", plan.budget_bytes},
                             {"non_block_bytes", plan.non_block_bytes},
                             {"device_bytes", plan.device_bytes},
                             {"moved_bytes", plan.moved_bytes},
                             {"groups", groups}};
    std::cout << out.dump(2) << '\n';
    return 0;
  }
  uint64_t total = plan.non_block_bytes;
  for (const GroupPlan& g : plan.groups) total += g.total_bytes;
  std::printf("%s: %zu tensors, %s; budget %s for %s\n\n", args.model.c_str(),
              header.tensors.size(), format_bytes(total).c_str(), format_bytes(budget).c_str(),
              mode == Mode::training ? "training" : "inference");
  std::printf("%-24s %7s %12s %12s %6s %12s %14s\n", "group", "blocks", "block", "total", "swap",
              "on device", "moved/step");
  for (const GroupPlan& g : plan.groups) {
    std::printf("%-24s %7lld %12s %12s %6lld %12s %14s\n", g.name.c_str(),
                static_cast<long long>(g.blocks), format_bytes(g.block_bytes).c_str(),
                format_bytes(g.total_bytes).c_str(), static_cast<long long>(g.blocks_to_swap),
                format_bytes(g.device_bytes).c_str(), format_bytes(g.moved_bytes).c_str());
  }
  std::printf("%-24s %7s %12s %12s %6s %12s\n", "outside blocks", "", "",
              format_bytes(plan.non_block_bytes).c_str(), "",
              format_bytes(plan.non_block_bytes).c_str());
  std::printf("\ndevice weights: %s of the %s budget; %s moved per %s\n",
              format_bytes(plan.device_bytes).c_str(), format_bytes(budget).c_str(),
              format_bytes(plan.moved_bytes).c_str(), mode == Mode::training ? "step" : "pass");
  std::printf("(activations, gradients and optimizer state need device memory beyond this)\n");
  return 0;
}

} // namespace blockswap::tool
