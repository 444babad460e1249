// `blockswap run`: the reference transformer with and without block swapping, side by side.
#include <torch/cuda.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <system_error>

#include "blockswap/core/error.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/model_io/model_plan.hpp"
#include "blockswap/model_io/size.hpp"
#include "blockswap/torch.hpp"
#include "commands.hpp"
#include "reference_transformer.hpp"
#include "validators.hpp"
#include "workload.hpp"

namespace blockswap::tool {
namespace {

using models::ReferenceTransformer;

// The device --device names (already one of cpu, cuda, cuda:N), or the best one present.
c10::Device checked_device(const std::string& name) {
  if (name.empty()) return cuda_available() ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  const c10::Device device(name);
  if (device.is_cuda()) {
    BLOCKSWAP_CHECK(cuda_available(), "--device ", name,
                    ": CUDA is not usable here (no GPU, or blockswap or LibTorch built without "
                    "CUDA); use --device cpu, the emulated device");
    const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
    BLOCKSWAP_CHECK(!device.has_index() || device.index() < count, "--device ", name,
                    ": this machine has ", count, " CUDA device", count == 1 ? "" : "s");
  }
  return device;
}

} // namespace

void check_shape_agrees_with_weights(const RunArgs& args) {
  if (args.weights.empty()) return;
  const models::TransformerConfig file = ReferenceTransformer::config_of(args.weights);
  auto agree = [&](bool given, const char* option, int64_t value, int64_t in_file,
                   const char* what) {
    BLOCKSWAP_CHECK(!given || value == in_file, option, " ", value, " disagrees with --weights ",
                    args.weights, ", which has ", in_file, " ", what, ": leave ", option,
                    " out (the file says the model's shape) or give ", in_file);
  };
  agree(args.blocks_given, "--blocks", args.blocks, file.blocks, "blocks");
  agree(args.hidden_given, "--hidden", args.hidden, file.hidden, "as its hidden size");
  agree(args.heads_given, "--heads", args.heads, file.heads, "attention heads");
}

int64_t blocks_to_swap(const RunArgs& args, int64_t blocks, Mode mode) {
  const int64_t max_k = Schedule::max_blocks_to_swap(blocks, mode);
  if (!args.swap) return std::min(blocks / 2, max_k);
  const int64_t k = *args.swap;
  const int64_t kept = 1; // blocks that stay on the device (one slot), in either mode
  const std::string model =
      args.weights.empty() ? detail::concat("--blocks ", blocks)
                           : detail::concat("the ", blocks, " blocks of --weights ", args.weights);
  BLOCKSWAP_CHECK(k >= 0 && k <= max_k, "--swap ", k, " is out of range for ", model, " in ",
                  args.mode, " mode: expected 0 <= --swap <= ", max_k,
                  k < 0 ? std::string()
                        : detail::concat(" (", mode == Mode::training ? "training" : "inference",
                                         " keeps ", kept, " block", kept == 1 ? "" : "s",
                                         " on the device: swapping ", k, " needs at least ",
                                         k + kept, " blocks)"));
  return k;
}

namespace {

// The host memory a run needs, roughly: the two copies of the model (the baseline and the
// swapped one) and one step's activations. A run that cannot fit fails now, with the sizes,
// rather than being killed by the operating system halfway.
void check_host_memory(const RunArgs& args, bool train, bool emulated, bool finetune) {
  const double h = double(args.hidden), t = double(args.tokens);
  double model_bytes = 0;
  std::string what;
  if (args.weights.empty()) {
    const double block_floats = 12 * h * h + 13 * h + (train ? 16 * double(args.lora_rank) * h : 0);
    // Fine-tuning: weights, AdamW's two moments, and the baseline's gradients.
    model_bytes = (finetune ? 7 : 2) * double(args.blocks) * block_floats * 4;
    what = detail::concat("--blocks ", args.blocks, " --hidden ", args.hidden);
  } else {
    std::error_code ignored; // a missing file is reported when it is read
    model_bytes = 2 * double(std::filesystem::file_size(args.weights, ignored));
    what = detail::concat("--weights ", args.weights);
  }
  const double step_floats = 2 * double(args.heads) * t * t + 17 * t * h; // one block's
  const double activation_bytes = emulated && args.weights.empty()
                                      ? (train ? double(args.blocks) : 1) * step_floats * 4 * 2
                                      : 0;
  const double needed = model_bytes + activation_bytes;
  const double available = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  BLOCKSWAP_CHECK(available <= 0 || needed <= available, what, " --tokens ", args.tokens,
                  ": the run needs about ", format_bytes(uint64_t(std::min(needed, 1e19))),
                  " of host memory (two copies of the model and a step's activations), more "
                  "than this machine's ",
                  format_bytes(uint64_t(available)));
}

} // namespace

int run_command(const RunArgs& args) {
  const Work work = work_of(args.mode);
  // The option validators in main.cpp checked each number; here the combinations, all before
  // any work (a trace path that cannot be written must not cost a whole run).
  BLOCKSWAP_CHECK(args.steps >= 1, "--steps must be at least 1, got ", args.steps);
  BLOCKSWAP_CHECK(args.tokens >= 1, "--tokens must be at least 1, got ", args.tokens);
  BLOCKSWAP_CHECK(args.threads >= 1, "--threads must be at least 1, got ", args.threads);
  const StepOn step_on = step_on_of(args.step_on);
  BLOCKSWAP_CHECK(work == Work::finetune || step_on == StepOn::automatic,
                  "--step-on applies to --mode finetune only");
  const bool train = work != Work::infer;
  const Mode mode = train ? Mode::training : Mode::forward_only;
  BLOCKSWAP_CHECK(train || !args.offload_activations,
                  "--offload-activations applies to --mode train or finetune: inference saves "
                  "no activations");
  BLOCKSWAP_CHECK(!args.offload_activations || args.host_budget.empty(),
                  "--offload-activations with --host-budget: the file-tier run is inference or "
                  "training without it; leave one of them out");
  if (args.weights.empty()) {
    BLOCKSWAP_CHECK(args.hidden % args.heads == 0, "--hidden ", args.hidden,
                    " is not divisible by --heads ", args.heads);
  }
  check_shape_agrees_with_weights(args);
  const c10::Device device = checked_device(args.device);
  if (!args.host_budget.empty()) {
    BLOCKSWAP_CHECK(!args.weights.empty(), "--host-budget needs --weights FILE.safetensors: the "
                                           "blocks beyond the budget are read from that file");
    BLOCKSWAP_CHECK(args.trace.empty() && args.save_weights.empty(),
                    "--host-budget runs without --trace and --save-weights");
    at::set_num_threads(args.threads);
    const int64_t blocks = ReferenceTransformer::config_of(args.weights).blocks;
    return run_from_file(args, device, blocks_to_swap(args, blocks, mode));
  }
  if (!args.trace.empty()) check_writable("--trace", args.trace);
  check_host_memory(args, train, device.is_cpu(), work == Work::finetune);
  at::set_num_threads(args.threads);

  // LoRA training needs adapters: a --weights file without them gets fresh ones of
  // --lora-rank. Fine-tuning trains every block weight, and has no adapters.
  const int64_t lora_rank = work == Work::train ? args.lora_rank : 0;
  models::TransformerConfig config{args.blocks, args.hidden, args.heads, lora_rank, 0};
  auto make_model = [&] {
    ReferenceTransformer model = args.weights.empty()
                                     ? ReferenceTransformer(config)
                                     : ReferenceTransformer::load(args.weights, lora_rank);
    if (work == Work::finetune) make_trainable(model);
    return model;
  };
  const bool bf16 = args.dtype == "bfloat16";
  BLOCKSWAP_CHECK(!bf16 || work != Work::finetune,
                  "--dtype bfloat16 runs --mode infer or train: the fused AdamW of finetune keeps "
                  "float32 weights");
  auto make_model_in_dtype = [&] {
    ReferenceTransformer model = make_model();
    if (bf16) {
      for (auto& block : model.blocks()) block->to(torch::kBFloat16);
    }
    return model;
  };
  ReferenceTransformer baseline_model = make_model_in_dtype();
  config = baseline_model.config();
  const int64_t k = blocks_to_swap(args, config.blocks, mode);
  ReferenceTransformer swapped_model = make_model_in_dtype();
  if (!args.save_weights.empty()) baseline_model.save(args.save_weights);
  const torch::Tensor input = baseline_model.example_input(1, args.tokens)
                                  .to(bf16 ? torch::kBFloat16 : torch::kFloat)
                                  .to(device);
  for (auto& block : baseline_model.blocks()) block->to(device); // the baseline holds it all

  Options options;
  options.blocks_to_swap = k;
  options.supports_backward = train;
  if (work == Work::finetune) options.optimizer = finetune_adamw();
  options.step_on = step_on;
  options.compress = parse_compress(args.compress);
  use_device(args, device, options);
  if (!args.trace.empty()) options.trace = std::make_shared<Trace>();
  if (args.offload_activations) {
    options.offload_activations = true;
    // The reference transformer's saved tensors are small at the tool's sizes (a hidden state of
    // 256 tokens is 384 KiB): the default 64 KiB moves all but the per-token statistics and the
    // adapters' narrow products.
    options.activation_threshold_bytes = parse_size(args.activation_threshold);
  }

  ModelOffloader offloader("blocks", swapped_model.modules(), options);
  const auto [baseline, swapped] = run_side_by_side(baseline_model, swapped_model, offloader, input,
                                                    work, args.steps, {}, args.offload_activations);
  const ActivationStats activations = offloader.activation_stats();
  const Stats stats = offloader.stats();
  const CompressionStats compression = offloader.compression();
  const HostMemoryStats host = offloader.device()->host_memory();
  const double diff = max_abs_diff(baseline, swapped);
  if (options.trace) options.trace->write_chrome_json(args.trace);

  const uint64_t steps = static_cast<uint64_t>(args.steps);
  // What the device holds without swapping: the frozen weights; fine-tuning, every weight and
  // AdamW's two moments for it.
  const uint64_t baseline_peak =
      work == Work::finetune ? 3 * baseline_model.weight_bytes() : baseline_model.frozen_bytes();
  const std::string device_text =
      device.is_cpu() ? detail::concat("emulated device (host memory, link ",
                                       args.link_gbps > 0 ? detail::concat(args.link_gbps, " GB/s")
                                                          : std::string("unlimited"),
                                       ", compute on ", args.threads, " thread",
                                       args.threads == 1 ? "" : "s", ")")
                      : device.str();
  // The simulator's prediction of the swapped step from the baseline's: every block's forward
  // the same, backward twice the forward (an assumption), the link at --link-gbps.
  double predicted = 0;
  // (Not for fine-tuning: the simulator does not model write-backs.)
  if (work != Work::finetune && args.link_gbps > 0 && std::isfinite(args.link_gbps * 1e9)) {
    const int64_t n = config.blocks;
    const double forward = baseline.step_seconds / (double(n) * (train ? 3.0 : 1.0));
    const Schedule schedule({n, k, mode});
    predicted = simulate(schedule, uniform_timing(n, forward, baseline_peak / uint64_t(n), 2.0),
                         LinkModel{args.link_gbps * 1e9, 5e-6})
                    .step_seconds;
  }
  if (args.json) {
    nlohmann::json out{
        {"mode", args.mode},
        {"device", device.is_cpu() ? "emulated" : device.str()},
        {"link_gbps", args.link_gbps},
        {"blocks", config.blocks},
        {"hidden", config.hidden},
        {"tokens", args.tokens},
        {"dtype", args.dtype},
        {"steps", args.steps},
        {"blocks_to_swap", offloader.blocks_to_swap()},
        {"baseline",
         {{"step_seconds", baseline.step_seconds}, {"peak_device_bytes", baseline_peak}}},
        {"swapped",
         {{"step_seconds", swapped.step_seconds},
          {"peak_device_bytes", stats.peak_device_bytes},
          {"h2d_bytes", stats.h2d_bytes / steps},
          {"d2h_bytes", stats.d2h_bytes / steps},
          {"stall_seconds", stats.stall_seconds / double(steps)},
          {"staged_bytes", stats.staged_bytes / steps},
          {"peak_pinned_host_bytes", host.peak_pinned_bytes},
          {"peak_kept_host_bytes", host.peak_kept_bytes},
          {"kept_host_bytes", host.kept_bytes},
          {"pinned_per_kept", host.pinned_per_kept()},
          {"predicted_step_seconds", predicted},
          {"compress", args.compress},
          {"compression", compression.on ? "on" : "off"}, // what auto chose
          {"compression_reason", compression.reason},
          {"compression_ratio", compression.ratio()},
          {"compressed_blocks", compression.blocks},
          {"host_bytes_saved", compression.raw_bytes - compression.compressed_bytes},
          {"link_bytes_saved", (stats.decoded_bytes - stats.compressed_bytes) / steps}}},
        {"max_abs_diff", diff},
    };
    if (args.offload_activations) {
      out["baseline"]["peak_activation_bytes"] = baseline.peak_activation_bytes;
      out["swapped"]["peak_activation_bytes"] = swapped.peak_activation_bytes;
      out["swapped"]["activation_offloaded_bytes"] = activations.offloaded_bytes / steps;
      out["swapped"]["activation_restored_bytes"] = activations.restored_bytes / steps;
    }
    std::cout << out.dump(2) << '\n';
  } else {
    std::printf(
        "blockswap run: reference transformer, %lld blocks of %s%s, hidden %lld, %lld tokens, %s\n",
        static_cast<long long>(config.blocks),
        format_bytes(baseline_peak / uint64_t(config.blocks)).c_str(),
        work == Work::finetune ? " (weights and AdamW's moments)" : "",
        static_cast<long long>(config.hidden), static_cast<long long>(args.tokens),
        work != Work::finetune ? (train ? "LoRA training" : "inference")
        : offloader.step_on() == StepOn::host
            ? "full fine-tuning (AdamW, fused step on the host)"
            : "full fine-tuning (AdamW, fused step on the device)");
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
    if (args.offload_activations) {
      std::printf("saved activations on the device at their peak: %s without blockswap, %s with "
                  "them offloaded (%s to host memory and back per step)\n",
                  format_bytes(baseline.peak_activation_bytes).c_str(),
                  format_bytes(swapped.peak_activation_bytes).c_str(),
                  format_bytes(activations.offloaded_bytes / steps).c_str());
    }
    std::printf("host memory page-locked at its peak: %s for %s kept there (%.3f per byte)\n",
                format_bytes(host.peak_pinned_bytes).c_str(),
                format_bytes(host.peak_kept_bytes).c_str(), host.pinned_per_kept());
    if (compression.blocks > 0) {
      std::printf("compressed weights: %lld blocks' frozen weights in %s instead of %s (ratio "
                  "%.3f; %s of host memory saved, %s fewer over the link per step)\n",
                  static_cast<long long>(compression.blocks),
                  format_bytes(compression.compressed_bytes).c_str(),
                  format_bytes(compression.raw_bytes).c_str(), compression.ratio(),
                  format_bytes(compression.raw_bytes - compression.compressed_bytes).c_str(),
                  format_bytes((stats.decoded_bytes - stats.compressed_bytes) / steps).c_str());
    } else if (args.compress != "off") {
      std::printf("compressed weights: none (%s)\n",
                  compression.on ? "no block shrank" : compression.reason.c_str());
    }
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
