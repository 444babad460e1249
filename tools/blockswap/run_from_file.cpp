// `blockswap run --weights FILE --host-budget BYTES`: the reference transformer with its frozen
// weights in three tiers (device slots, pinned host memory up to the budget, the file), against
// the model loaded whole, one after the other, so that the swapped run's host memory is its own.
#include <malloc.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "blockswap/core/error.hpp"
#include "blockswap/model_io/size.hpp"
#include "blockswap/torch.hpp"
#include "commands.hpp"
#include "reference_transformer.hpp"
#include "workload.hpp"

namespace blockswap::tool {
namespace {

using models::ReferenceTransformer;

// The process's resident memory high-water mark (VmHWM), in bytes; 0 where unknown.
uint64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// Starts the high-water mark again from the memory resident now (Linux 4.0 and later).
bool reset_peak_rss() {
  malloc_trim(0); // the baseline's freed memory goes back to the system first
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

} // namespace

int run_from_file(const RunArgs& args, c10::Device device, int64_t k) {
  const Work work = work_of(args.mode);
  BLOCKSWAP_CHECK(work != Work::finetune, "--host-budget with --mode finetune: full fine-tuning "
                                          "trains every block weight, and trained weights never "
                                          "live in the file; use --mode infer or train");
  BLOCKSWAP_CHECK(args.ranks == 0, "--host-budget with --ranks is not supported by the tool");
  const uint64_t host_budget = parse_size(args.host_budget);
  const int64_t lora_rank = work == Work::train ? args.lora_rank : 0;
  const uint64_t file_bytes = std::filesystem::file_size(args.weights);
  // Large buffers straight from the system and back to it when freed, so that a freed block is
  // not reused, already resident, by the next tensor built empty (glibc's adaptive threshold
  // would otherwise move up to 32 MiB allocations into its heap after the first large free).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);

  // The model loaded whole, alone; then freed.
  Phase baseline;
  torch::Tensor input;
  uint64_t frozen_bytes = 0;
  models::TransformerConfig config;
  {
    ReferenceTransformer model = ReferenceTransformer::load(args.weights, lora_rank);
    config = model.config();
    frozen_bytes = model.frozen_bytes();
    input = model.example_input(1, args.tokens).to(device);
    for (auto& block : model.blocks()) block->to(device);
    baseline = run_alone(model, nullptr, input, work, args.steps);
  }
  const bool reset = reset_peak_rss();

  // Built empty, its frozen weights read from the file: into pinned host memory up to the
  // budget, for each load beyond it.
  ReferenceTransformer model = ReferenceTransformer::load_frozen_empty(args.weights, lora_rank);
  Options options;
  options.blocks_to_swap = k;
  options.supports_backward = work == Work::train;
  use_device(args, device, options);
  options.weights_file = args.weights;
  options.weights_from_file = true;
  options.host_budget_bytes = host_budget;
  options.file_reads = args.file_reads == "drop" ? CacheBypass::drop : CacheBypass::direct;
  options.compress = parse_compress(args.compress); // the blocks in host memory; the file's raw
  Phase swapped;
  Stats stats;
  CompressionStats compression;
  int64_t in_file = 0;
  {
    ModelOffloader offloader("blocks", model.modules(), options);
    swapped = run_alone(model, &offloader, input, work, args.steps);
    stats = offloader.stats();
    compression = offloader.compression();
    for (int64_t b = 0; b < config.blocks; ++b) in_file += offloader.is_in_file(b) ? 1 : 0;
  }
  const uint64_t peak_rss = peak_rss_bytes();
  const double diff = max_abs_diff(baseline, swapped);
  const auto steps = static_cast<uint64_t>(args.steps);
  if (args.json) {
    nlohmann::json out{
        {"mode", args.mode},
        {"device", device.is_cpu() ? "emulated" : device.str()},
        {"link_gbps", args.link_gbps},
        {"blocks", config.blocks},
        {"hidden", config.hidden},
        {"tokens", args.tokens},
        {"steps", args.steps},
        {"blocks_to_swap", k},
        {"host_budget_bytes", host_budget},
        {"weights_file_bytes", file_bytes},
        {"file_reads", args.file_reads},
        {"baseline",
         {{"step_seconds", baseline.step_seconds}, {"peak_device_bytes", frozen_bytes}}},
        {"swapped",
         {{"step_seconds", swapped.step_seconds},
          {"peak_device_bytes", stats.peak_device_bytes},
          {"h2d_bytes", stats.h2d_bytes / steps},
          {"disk_read_bytes", stats.disk_bytes / steps},
          {"blocks_in_file", in_file},
          {"peak_rss_bytes", peak_rss},
          {"peak_rss_of_swapped_run_alone", reset},
          {"stall_seconds", stats.stall_seconds / double(steps)},
          {"staged_bytes", stats.staged_bytes / steps},
          {"compress", args.compress},
          {"compression_ratio", compression.ratio()},
          {"compressed_blocks", compression.blocks},
          {"host_bytes_saved", compression.raw_bytes - compression.compressed_bytes},
          {"link_bytes_saved", (stats.decoded_bytes - stats.compressed_bytes) / steps}}},
        {"max_abs_diff", diff},
    };
    std::cout << out.dump(2) << '\n';
  } else {
    std::printf("blockswap run: reference transformer from %s (%s), %lld blocks, hidden %lld, "
                "%lld tokens, %s\n",
                args.weights.c_str(), format_bytes(file_bytes).c_str(),
                static_cast<long long>(config.blocks), static_cast<long long>(config.hidden),
                static_cast<long long>(args.tokens),
                work == Work::train ? "LoRA training" : "inference");
    std::printf("%lld of %lld blocks swapped; host budget %s: %lld blocks read from the file\n\n",
                static_cast<long long>(k), static_cast<long long>(config.blocks),
                format_bytes(host_budget).c_str(), static_cast<long long>(in_file));
    std::printf("%-16s %12s %14s %14s %16s\n", "", "time/step", "host->device", "disk read",
                "peak host (RSS)");
    std::printf("%-16s %12s %14s %14s %16s\n", "loaded whole",
                milliseconds(baseline.step_seconds).c_str(), "0 B", "0 B", "-");
    std::printf("%-16s %12s %14s %14s %16s\n", "three tiers",
                milliseconds(swapped.step_seconds).c_str(),
                format_bytes(stats.h2d_bytes / steps).c_str(),
                format_bytes(stats.disk_bytes / steps).c_str(), format_bytes(peak_rss).c_str());
    std::printf("\n(bytes per step; peak host memory of the swapped run alone%s%s)\n",
                reset ? "" : ", NOT reset after the baseline: the process's",
                device.is_cpu() ? "; the emulated device's slots are host memory too" : "");
    std::printf("largest difference between the two results: %g%s\n", diff,
                diff == 0 ? " (identical)" : "  <-- MISMATCH");
  }
  if (diff != 0) {
    std::fprintf(stderr, "blockswap: error: the swapped run differs from the unswapped one by %g\n",
                 diff);
    return 1;
  }
  return 0;
}

} // namespace blockswap::tool
