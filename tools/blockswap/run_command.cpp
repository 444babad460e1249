// `blockswap run`: the reference transformer with and without block swapping, side by side.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "blockswap/error.hpp"
#include "blockswap/model_plan.hpp"
#include "blockswap/torch.hpp"
#include "commands.hpp"
#include "reference_transformer.hpp"
#include "workload.hpp"

namespace blockswap::tool {
namespace {

using Clock = std::chrono::steady_clock;
using models::ReferenceTransformer;
using torch::autograd::variable_list;

} // namespace

int run_command(const RunArgs& args) {
  BLOCKSWAP_CHECK(args.mode == "infer" || args.mode == "train",
                  "--mode must be infer or train, got '", args.mode, "'");
  BLOCKSWAP_CHECK(args.steps >= 1, "--steps must be at least 1, got ", args.steps);
  BLOCKSWAP_CHECK(args.tokens >= 1, "--tokens must be at least 1, got ", args.tokens);
  BLOCKSWAP_CHECK(args.threads >= 1, "--threads must be at least 1, got ", args.threads);
  const bool train = args.mode == "train";
  at::set_num_threads(args.threads);

  const std::string device_name =
      !args.device.empty() ? args.device : (cuda_available() ? "cuda" : "cpu");
  const c10::Device device(device_name);

  models::TransformerConfig config{args.blocks, args.hidden, args.heads, train ? args.lora_rank : 0,
                                   0};
  auto make_model = [&] {
    return args.weights.empty() ? ReferenceTransformer(config)
                                : ReferenceTransformer::load(args.weights);
  };
  ReferenceTransformer baseline_model = make_model();
  ReferenceTransformer swapped_model = make_model();
  config = baseline_model.config();
  if (!args.save_weights.empty()) baseline_model.save(args.save_weights);
  const torch::Tensor input = baseline_model.example_input(1, args.tokens).to(device);
  for (auto& block : baseline_model.blocks()) block->to(device); // the baseline holds it all

  Options options;
  options.blocks_to_swap = args.swap < 0 ? config.blocks / 2 : args.swap;
  options.supports_backward = train;
  options.device = device;
  options.emulated_link_gbps = args.link_gbps;
  if (!args.trace.empty()) options.trace = std::make_shared<Trace>();

  ModelOffloader offloader("blocks", swapped_model.modules(), options);
  const auto [baseline, swapped] =
      run_side_by_side(baseline_model, swapped_model, offloader, input, train, args.steps);
  const Stats stats = offloader.stats();
  const double diff = max_abs_diff(baseline, swapped);
  if (options.trace) options.trace->write_chrome_json(args.trace);

  const uint64_t steps = static_cast<uint64_t>(args.steps);
  const uint64_t baseline_peak = baseline_model.frozen_bytes();
  const std::string device_text =
      device.is_cpu() ? detail::concat("emulated device (host memory, link ", args.link_gbps,
                                       " GB/s, compute on ", args.threads, " thread",
                                       args.threads == 1 ? "" : "s", ")")
                      : device.str();
  if (args.json) {
    nlohmann::json out{
        {"mode", args.mode},
        {"device", device.is_cpu() ? "emulated" : device.str()},
        {"link_gbps", args.link_gbps},
        {"blocks", config.blocks},
        {"hidden", config.hidden},
        {"tokens", args.tokens},
        {"steps", args.steps},
        {"blocks_to_swap", offloader.blocks_to_swap()},
        {"baseline",
         {{"step_seconds", baseline.step_seconds}, {"peak_device_bytes", baseline_peak}}},
        {"swapped",
         {{"step_seconds", swapped.step_seconds},
          {"peak_device_bytes", stats.peak_device_bytes},
          {"h2d_bytes", stats.h2d_bytes / steps},
          {"d2h_bytes", stats.d2h_bytes / steps},
          {"stall_seconds", stats.stall_seconds / double(steps)}}},
        {"max_abs_diff", diff},
    };
    std::cout << out.dump(2) << '\n';
  } else {
    std::printf(
        "blockswap run: reference transformer, %lld blocks of %s, hidden %lld, %lld tokens, %s\n",
        static_cast<long long>(config.blocks),
        format_bytes(baseline_peak / uint64_t(config.blocks)).c_str(),
        static_cast<long long>(config.hidden), static_cast<long long>(args.tokens),
        train ? "LoRA training" : "inference");
    std::printf("device: %s; %lld of %lld blocks swapped; %d measured steps\n\n",
                device_text.c_str(), static_cast<long long>(offloader.blocks_to_swap()),
                static_cast<long long>(config.blocks), args.steps);
    std::printf("%-16s %12s %16s %14s %14s %10s\n", "", "time/step", "device weights",
                "host->device", "device->host", "stall");
    std::printf("%-16s %12s %16s %14s %14s %10s\n", "without swap",
                milliseconds(baseline.step_seconds).c_str(), format_bytes(baseline_peak).c_str(),
                "0 B", "0 B", "0.0 ms");
    std::printf("%-16s %12s %16s %14s %14s %10s\n", "with blockswap",
                milliseconds(swapped.step_seconds).c_str(),
                format_bytes(stats.peak_device_bytes).c_str(),
                format_bytes(stats.h2d_bytes / steps).c_str(),
                format_bytes(stats.d2h_bytes / steps).c_str(),
                milliseconds(stats.stall_seconds / double(steps)).c_str());
    std::printf("\n(bytes moved and stall are per step; device weights is the peak)\n");
    std::printf("largest difference between the two results: %g%s\n", diff,
                diff == 0 ? " (identical)" : "  <-- MISMATCH");
    if (options.trace) std::printf("trace written to %s\n", args.trace.c_str());
  }
  if (diff != 0) {
    std::fprintf(stderr, "blockswap: error: the swapped run differs from the unswapped one by %g\n",
                 diff);
    return 1;
  }
  return 0;
}

} // namespace blockswap::tool
