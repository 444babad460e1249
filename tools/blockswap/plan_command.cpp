// `blockswap plan`: how many blocks of each group to swap to fit a device budget, and what that
// costs: the step time the schedule simulator predicts against no swapping.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/load_pipeline.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/model_io/checkpoint.hpp"
#include "blockswap/model_io/model_plan.hpp"
#include "blockswap/model_io/safetensors.hpp"
#include "commands.hpp"
#include "plan_compression.hpp"

namespace blockswap::tool {

namespace {

struct Prediction {
  double step_seconds = 0, noswap_seconds = 0;
  double in_memory_seconds = 0; // every swapped block in host memory (no file tier)
  // The file tier, per group: swapped blocks kept in pinned host memory and read from the file;
  // bytes the disk reads per step (or pass).
  std::vector<int64_t> pinned_blocks, file_blocks;
  std::vector<uint64_t> disk_read_bytes;
  uint64_t host_bytes = 0;
  std::vector<int64_t> rotating_slots;       // per group (inference), 0 in training
  std::vector<double> block_forward_seconds; // per group: its largest block's forward
  double offloaded_activations_seconds = 0;  // --activation-bytes: the step with them offloaded
  double compressed_seconds = 0;             // the step with compressed weights (ratio > 1)
};

// The plan's step on the schedule simulator: each group a block list on one device, a block's
// forward from --block-ms or --tflops/--tokens, backward twice the forward; in inference the
// rotating slots the simulator finds fastest.
Prediction predict(const ModelPlan& plan, const ModelLayout& layout, const PlanArgs& args,
                   std::optional<uint64_t> host_budget, uint64_t activation_bytes,
                   double compression_ratio) {
  LinkModel link{args.link_gbps * 1e9, 5e-6};
  link.disk_bytes_per_second = args.disk_gbps * 1e9;
  link.decode_bytes_per_second = args.decode_gbps * 1e9;
  uint64_t largest = 1;
  for (const BlockGroup& g : layout.groups) largest = std::max(largest, g.largest_bytes());
  std::vector<BlockTiming> timings;
  std::vector<int64_t> ks, none;
  Prediction p;
  for (std::size_t i = 0; i < layout.groups.size(); ++i) {
    const BlockGroup& g = layout.groups[i];
    BlockTiming t;
    for (std::size_t b = 0; b < g.block_bytes.size(); ++b) {
      t.forward_seconds.push_back(
          args.block_ms > 0
              ? args.block_ms * 1e-3 * double(g.block_bytes[b]) / double(largest)
              : 2.0 * double(g.block_elements[b]) * double(args.tokens) / (args.tflops * 1e12));
      t.bytes.push_back(g.block_bytes[b]);
    }
    p.block_forward_seconds.push_back(
        *std::max_element(t.forward_seconds.begin(), t.forward_seconds.end()));
    timings.push_back(std::move(t));
    ks.push_back(plan.groups[i].blocks_to_swap);
    none.push_back(0);
  }
  p.rotating_slots = plan.mode == Mode::forward_only ? best_rotating_slots(ks, timings, link)
                                                     : std::vector<int64_t>(ks.size(), 0);
  // The three tiers: the host budget holds the swapped blocks (those a step loads), group by
  // group in block order; the rest are read from the file for each load.
  auto place_tiers = [&](const std::vector<Schedule>& schedules) {
    std::size_t left = host_budget.value_or(0);
    for (std::size_t i = 0; i < schedules.size(); ++i) {
      const std::size_t before = left;
      const Schedule* schedule = &schedules[i];
      timings[i].from_file = file_tier(
          timings[i].bytes,
          host_priority(static_cast<int64_t>(timings[i].bytes.size()), {&schedule, 1}), left);
      p.host_bytes += before - left;
      std::vector<int64_t> loads(timings[i].bytes.size(), 0);
      for (const Op& op : schedule->pass()) {
        if (op.kind == Op::Kind::move) ++loads[static_cast<std::size_t>(op.move.in)];
      }
      int64_t pinned = 0, file = 0;
      uint64_t read = 0;
      for (std::size_t b = 0; b < loads.size(); ++b) {
        if (loads[b] == 0) continue; // never moves: placed once
        if (!timings[i].from_file[b]) {
          ++pinned;
          continue;
        }
        read += static_cast<uint64_t>(loads[b]) * timings[i].bytes[b];
        ++file;
      }
      p.pinned_blocks.push_back(pinned);
      p.file_blocks.push_back(file);
      p.disk_read_bytes.push_back(read);
    }
  };
  auto step = [&](const std::vector<int64_t>& k, const std::vector<int64_t>& r, bool tiers) {
    std::vector<Schedule> schedules;
    for (std::size_t i = 0; i < k.size(); ++i) {
      schedules.emplace_back(
          ScheduleOptions{static_cast<int64_t>(timings[i].bytes.size()), k[i], plan.mode, r[i]});
    }
    for (BlockTiming& t : timings) t.from_file.clear();
    if (tiers) place_tiers(schedules);
    std::vector<SimulatedList> lists;
    for (std::size_t i = 0; i < k.size(); ++i) lists.push_back({&schedules[i], &timings[i]});
    return simulate(lists, link).step_seconds;
  };
  p.in_memory_seconds = step(ks, p.rotating_slots, false);
  p.step_seconds = host_budget ? step(ks, p.rotating_slots, true) : p.in_memory_seconds;
  p.noswap_seconds = step(none, none, false);
  if (compression_ratio > 1) { // the blocks in host memory compressed; the file's stay raw
    for (BlockTiming& t : timings) {
      for (std::size_t bytes : t.bytes) {
        t.compressed_bytes.push_back(static_cast<std::size_t>(double(bytes) / compression_ratio));
      }
    }
    const Prediction tiers = p; // place_tiers records the tiers again: the first record stays
    p.compressed_seconds = step(ks, p.rotating_slots, host_budget.has_value());
    p.host_bytes = tiers.host_bytes;
    p.pinned_blocks = tiers.pinned_blocks;
    p.file_blocks = tiers.file_blocks;
    p.disk_read_bytes = tiers.disk_read_bytes;
    for (BlockTiming& t : timings) t.compressed_bytes.clear();
  }
  if (activation_bytes > 0 && plan.mode == Mode::training) {
    for (BlockTiming& t : timings) t.activation_bytes.assign(t.bytes.size(), activation_bytes);
    p.offloaded_activations_seconds = step(ks, p.rotating_slots, host_budget.has_value());
  }
  return p;
}

} // namespace

int plan_command(const PlanArgs& args) {
  BLOCKSWAP_CHECK(args.mode == "infer" || args.mode == "train",
                  "--mode must be infer or train, got '", args.mode, "'");
  const Mode mode = args.mode == "train" ? Mode::training : Mode::forward_only;
  const uint64_t budget = parse_size(args.budget);
  // One file, or a sharded set (its index or folder): a block's bytes across its shards.
  const std::vector<TensorInfo> tensors = open_checkpoint(args.model).tensor_infos();
  const ModelLayout layout = group_blocks(tensors);
  if (args.stages > 0) return plan_pipeline(args, layout, budget);
  ModelPlan plan = plan_model(layout, budget, mode);
  std::optional<uint64_t> host_budget;
  if (!args.host_budget.empty()) host_budget = parse_size(args.host_budget);
  const uint64_t activation_bytes =
      args.activation_bytes.empty() ? 0 : parse_size(args.activation_bytes);
  BLOCKSWAP_CHECK(activation_bytes == 0 || mode == Mode::training,
                  "--activation-bytes applies to --mode train: inference saves no activations");
  const double ratio =
      args.compress_ratio > 0 ? args.compress_ratio : modelled_compression_ratio(tensors);
  Prediction prediction = predict(plan, layout, args, host_budget, activation_bytes, ratio);
  // One or two groups: of the plans that fit, the one the simulator finds fastest (the fewest
  // bytes moved is not always the fastest: a group left with one slot cannot overlap its loads).
  if (layout.groups.size() <= 2) {
    for (const std::vector<int64_t>& ks :
         budget_frontier(block_lists(layout), budget, mode, layout.non_block_bytes)) {
      ModelPlan candidate = plan_model(layout, budget, mode, ks);
      Prediction p = predict(candidate, layout, args, host_budget, activation_bytes, ratio);
      if (p.step_seconds < prediction.step_seconds * (1 - 1e-9) ||
          (p.step_seconds <= prediction.step_seconds * (1 + 1e-9) &&
           candidate.moved_bytes < plan.moved_bytes)) {
        plan = std::move(candidate);
        prediction = std::move(p);
      }
    }
  }
  // Compressed weights need two decode buffers on the device beside each group's slots (each
  // its largest block's frozen bytes compressed, at most the raw ones: what the offloaders
  // reserve and the Python planner counts; one is copied into while the other is decoded
  // from), so the plan with compression fits the budget less those buffers, and its step is
  // that plan's.
  uint64_t decode_bytes = 0;
  std::optional<ModelPlan> compressed_plan;
  if (ratio > 1) {
    for (const BlockGroup& g : layout.groups) {
      decode_bytes +=
          blockswap::LoadPipeline::kDecodeBuffers * blockswap::layout::align_up(g.largest_bytes());
    }
    if (plan.device_bytes + decode_bytes <= budget) {
      compressed_plan = plan; // the same blocks swapped: prediction.compressed_seconds is its
    } else {
      // The fastest compressed plan that fits beside them, as for the raw plan above.
      const uint64_t left = budget - std::min(budget, decode_bytes);
      try {
        compressed_plan = plan_model(layout, left, mode);
        double best = predict(*compressed_plan, layout, args, host_budget, activation_bytes, ratio)
                          .compressed_seconds;
        if (layout.groups.size() <= 2) {
          for (const std::vector<int64_t>& ks :
               budget_frontier(block_lists(layout), left, mode, layout.non_block_bytes)) {
            ModelPlan candidate = plan_model(layout, left, mode, ks);
            const double seconds =
                predict(candidate, layout, args, host_budget, activation_bytes, ratio)
                    .compressed_seconds;
            if (seconds < best * (1 - 1e-9)) {
              best = seconds;
              compressed_plan = std::move(candidate);
            }
          }
        }
        prediction.compressed_seconds = best;
      } catch (const Error&) {
        compressed_plan.reset(); // nothing fits beside the decode buffers
      }
    }
  }
  const std::string verdict =
      ratio <= 1 ? std::string("changes nothing")
      : compressed_plan
          ? compression_verdict(prediction.step_seconds, prediction.compressed_seconds)
          : std::string("does not fit the budget beside its decode buffers");
  const double overhead = prediction.step_seconds / prediction.noswap_seconds - 1;
  // Device memory for saved activations: every block's without offloading; with it, the last
  // block's (never offloaded) and the one coming back under it (Note [offloaded activations] in
  // core/activation_rule.hpp).
  int64_t all_blocks = 0;
  for (const GroupPlan& g : plan.groups) all_blocks += g.blocks;
  const uint64_t activations_kept = activation_bytes * static_cast<uint64_t>(all_blocks);
  const uint64_t activations_offloaded = activation_bytes * std::min<uint64_t>(2, all_blocks);

  if (args.json) {
    nlohmann::json groups = nlohmann::json::array();
    for (const GroupPlan& g : plan.groups) {
      groups.push_back(
          {{"name", g.name},
           {"blocks", g.blocks},
           {"block_bytes", g.block_bytes},
           {"total_bytes", g.total_bytes},
           {"blocks_to_swap", g.blocks_to_swap},
           {"device_bytes", g.device_bytes},
           {"moved_bytes", g.moved_bytes},
           {"rotating_slots", prediction.rotating_slots[groups.size()]},
           {"block_forward_seconds", prediction.block_forward_seconds[groups.size()]}});
      if (host_budget) {
        const std::size_t i = groups.size() - 1;
        groups.back()["pinned_blocks"] = prediction.pinned_blocks[i];
        groups.back()["file_blocks"] = prediction.file_blocks[i];
        groups.back()["disk_read_bytes"] = prediction.disk_read_bytes[i];
      }
    }
    nlohmann::json compute = {{"backward_factor", 2.0}};
    if (args.block_ms > 0) {
      compute["block_ms"] = args.block_ms;
    } else {
      compute["tflops"] = args.tflops;
      compute["tokens"] = args.tokens;
    }
    nlohmann::json out{{"model", args.model},
                       {"mode", args.mode},
                       {"budget_bytes", plan.budget_bytes},
                       {"non_block_bytes", plan.non_block_bytes},
                       {"device_bytes", plan.device_bytes},
                       {"moved_bytes", plan.moved_bytes},
                       {"link_gbps", args.link_gbps},
                       {"compute", compute},
                       {"predicted_step_seconds", prediction.step_seconds},
                       {"predicted_noswap_seconds", prediction.noswap_seconds},
                       {"predicted_overhead", overhead},
                       {"rotating_slots", prediction.rotating_slots},
                       {"groups", groups}};
    if (host_budget) {
      out["host_budget_bytes"] = *host_budget;
      out["host_bytes"] = prediction.host_bytes;
      out["disk_gbps"] = args.disk_gbps;
      out["predicted_in_memory_step_seconds"] = prediction.in_memory_seconds;
    }
    if (activation_bytes > 0) {
      out["activations"] = {
          {"bytes_per_block", activation_bytes},
          {"device_bytes", activations_kept},
          {"offloaded_device_bytes", activations_offloaded},
          {"offloaded_bytes_per_step", activation_bytes * static_cast<uint64_t>(all_blocks - 1)},
          {"predicted_offloaded_step_seconds", prediction.offloaded_activations_seconds}};
    }
    out["compression"] = {{"ratio", ratio},
                          {"ratio_from", args.compress_ratio > 0 ? "--compress-ratio" : "dtypes"},
                          {"decode_gbps", args.decode_gbps},
                          {"predicted_step_seconds",
                           ratio > 1 ? prediction.compressed_seconds : prediction.step_seconds},
                          {"verdict", verdict},
                          {"decode_buffer_bytes", decode_bytes}};
    if (compressed_plan) {
      nlohmann::json ks = nlohmann::json::array();
      for (const GroupPlan& g : compressed_plan->groups) ks.push_back(g.blocks_to_swap);
      out["compression"]["blocks_to_swap"] = ks;
      out["compression"]["device_bytes"] = compressed_plan->device_bytes + decode_bytes;
    }
    std::cout << out.dump(2) << '\n';
    return 0;
  }
  uint64_t total = plan.non_block_bytes;
  for (const GroupPlan& g : plan.groups) total += g.total_bytes;
  std::printf("%s: %zu tensors, %s; budget %s for %s\n\n", args.model.c_str(), tensors.size(),
              format_bytes(total).c_str(), format_bytes(budget).c_str(),
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
  const std::string compute =
      args.block_ms > 0 ? detail::concat("the largest block's forward ", args.block_ms, " ms")
                        : detail::concat(args.tflops, " TFLOP/s, ", args.tokens, " tokens");
  const std::string change = prediction.noswap_seconds > 0
                                 ? detail::concat(overhead >= 0 ? "+" : "", overhead * 100, " %")
                                 : std::string("no compute to compare with");
  std::printf("\npredicted %s (schedule simulator; link %g GB/s and 5 us per copy, %s%s): %.4g s "
              "against %.4g s without swapping, %s\n",
              mode == Mode::training ? "step" : "pass", args.link_gbps, compute.c_str(),
              mode == Mode::training ? ", backward 2x forward" : "", prediction.step_seconds,
              prediction.noswap_seconds, change.c_str());
  if (host_budget) {
    std::printf("\nthe file tier (host budget %s, disk %g GB/s):",
                format_bytes(*host_budget).c_str(), args.disk_gbps);
    uint64_t read = 0;
    for (std::size_t i = 0; i < plan.groups.size(); ++i) {
      std::printf(" %s %lld in host memory, %lld from the file;", plan.groups[i].name.c_str(),
                  static_cast<long long>(prediction.pinned_blocks[i]),
                  static_cast<long long>(prediction.file_blocks[i]));
      read += prediction.disk_read_bytes[i];
    }
    std::printf("\n  %s in host memory, %s read from the file per %s: %.4g s against %.4g s with "
                "every swapped block in host memory\n",
                format_bytes(prediction.host_bytes).c_str(), format_bytes(read).c_str(),
                mode == Mode::training ? "step" : "pass", prediction.step_seconds,
                prediction.in_memory_seconds);
  }
  if (activation_bytes > 0) {
    std::printf("\nactivations (%s a block): %s on the device kept, about %s offloaded, %s to "
                "host memory and back per step: %.4g s a step offloaded against %.4g s kept\n",
                format_bytes(activation_bytes).c_str(), format_bytes(activations_kept).c_str(),
                format_bytes(activations_offloaded).c_str(),
                format_bytes(activation_bytes * static_cast<uint64_t>(all_blocks - 1)).c_str(),
                prediction.offloaded_activations_seconds, prediction.step_seconds);
  }
  if (ratio > 1) {
    std::printf("\ncompressed weights (Options::compress; ratio %.2f %s, decode %g GB/s; decode "
                "buffers %s on the device, %s in all): %.4g s against %.4g s: it %s\n",
                ratio, args.compress_ratio > 0 ? "given" : "modelled from the checkpoint's dtypes",
                args.decode_gbps, format_bytes(decode_bytes).c_str(),
                compressed_plan ? format_bytes(compressed_plan->device_bytes + decode_bytes).c_str()
                                : "over the budget",
                prediction.compressed_seconds, prediction.step_seconds, verdict.c_str());
  }
  if (mode == Mode::forward_only) {
    std::printf("rotating slots (Options::rotating_slots):");
    for (std::size_t i = 0; i < plan.groups.size(); ++i) {
      std::printf(" %s %lld", plan.groups[i].name.c_str(),
                  static_cast<long long>(prediction.rotating_slots[i]));
    }
    std::printf("\n");
  }
  return 0;
}

} // namespace blockswap::tool
