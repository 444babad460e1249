// The sweep of K on the emulated device for `blockswap bench`: the reference transformer computed
// on this machine's CPU, its copies on the emulated copy engine, for every mode and K, with the
// seed's schedule and no swapping measured beside blockswap step by step.
#include "emulated_bench.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/device/emulated.hpp"
#include "blockswap/model_io/size.hpp"
#include "progress.hpp"
#include "workload.hpp"

namespace blockswap::tool {
namespace {

using Clock = std::chrono::steady_clock;
using models::ReferenceTransformer;

// The bandwidth the emulated link achieves here for copies of `bytes`: the throttle, or the
// machine's own copy speed when that is lower (DESIGN.md section 6: a faster link is fiction).
double achieved_gbps(double link_gbps, std::size_t bytes) {
  EmulatedDevice device({.link_gbps = link_gbps});
  Buffer host = device.allocate_host(bytes), dev = device.allocate_device(bytes);
  std::memset(host.data(), 1, bytes);
  auto done = device.make_event();
  constexpr int kCopies = 20;
  const auto start = Clock::now();
  for (int i = 0; i < kCopies; ++i) device.copy_to_device(dev.data(), host.data(), bytes, i);
  device.record(*done, Stream::copy);
  device.synchronize(*done);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return double(bytes) * kCopies / seconds / 1e9;
}

double forward_seconds(ReferenceTransformer& model, int64_t tokens) {
  torch::NoGradGuard no_grad;
  const torch::Tensor x = model.example_input(1, tokens);
  model.forward(x); // warm-up
  std::vector<double> times;
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    model.forward(x);
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[1];
}

} // namespace

// The sweep of K on the emulated device: the reference transformer computed on this machine's
// CPU, its copies on the emulated copy engine. Adds its facts to `info`; prints its table
// unless --json.
std::vector<BenchRow> emulated_bench(const BenchArgs& args, nlohmann::json& info) {
  const int64_t heads = std::max<int64_t>(1, args.hidden / 64);
  at::set_num_threads(1);
  const int steps = args.steps > 0 ? args.steps : (args.quick ? 8 : 20);
  const int64_t n = args.blocks;

  models::TransformerConfig config{n, args.hidden, heads, 8, 0};
  ReferenceTransformer model(config), swapped(config), seeded(config);
  const uint64_t block_bytes = model.frozen_bytes() / uint64_t(n);
  const double gbps = achieved_gbps(args.link_gbps, block_bytes);
  const double copy_seconds = double(block_bytes) / (gbps * 1e9);

  // A size where one block's forward takes about its copy time.
  int64_t tokens = args.tokens;
  if (tokens == 0) {
    for (tokens = 8; tokens < 4096; tokens *= 2) {
      if (forward_seconds(model, tokens) / double(n) >= copy_seconds) break;
    }
  }
  const torch::Tensor input = model.example_input(1, tokens);
  const double compute_seconds = forward_seconds(model, tokens) / double(n);
  std::fprintf(stderr,
               "blockswap bench: %lld blocks of %s, %lld tokens; link %.1f GB/s (achieved %.1f); "
               "per block: copy %.2f ms, forward %.2f ms\n",
               static_cast<long long>(n), format_bytes(block_bytes).c_str(),
               static_cast<long long>(tokens), args.link_gbps, gbps, copy_seconds * 1e3,
               compute_seconds * 1e3);

  // The packed size of a block (its tensors at aligned offsets), as the engine's slots hold it:
  // with K=0 the device holds N slots.
  std::vector<std::size_t> packed;
  {
    const ModelOffloader probe("blocks", model.modules(), Options{});
    packed.assign(n, probe.stats().device_bytes / uint64_t(n));
  }

  // Fine-tuning: the same blocks with every weight training (AdamW; no adapters), whose
  // packed blocks hold the weights and both moments.
  models::TransformerConfig finetune_config = config;
  finetune_config.lora_rank = 0;
  ReferenceTransformer ft_plain(finetune_config), ft_swapped(finetune_config),
      ft_seeded(finetune_config);
  for (ReferenceTransformer* m : {&ft_plain, &ft_swapped, &ft_seeded}) make_trainable(*m);
  // With the step on the host, the packed blocks hold the weights only.
  std::vector<std::size_t> ft_packed, ft_host_packed;
  for (const StepOn where : {StepOn::device, StepOn::host}) {
    Options probe_options;
    probe_options.supports_backward = true;
    probe_options.optimizer = finetune_adamw();
    probe_options.step_on = where;
    const ModelOffloader probe("blocks", ft_swapped.modules(), probe_options);
    (where == StepOn::host ? ft_host_packed : ft_packed)
        .assign(n, probe.stats().device_bytes / uint64_t(n));
  }

  std::vector<BenchRow> rows;
  Progress progress;
  const int total = int(4 * n - 3);
  for (const std::string mode : {"infer", "train", "finetune", "finetune-host"}) {
    const bool on_host = mode == "finetune-host";
    const Work work = on_host ? Work::finetune : work_of(mode);
    const bool train = work != Work::infer;
    const Mode m = train ? Mode::training : Mode::forward_only;
    const bool finetune = work == Work::finetune;
    ReferenceTransformer& plain = finetune ? ft_plain : model;
    ReferenceTransformer& swapped_model = finetune ? ft_swapped : swapped;
    ReferenceTransformer& seeded_model = finetune ? ft_seeded : seeded;
    // Up to the largest K the seed's replay runs too (training: N-2), for its column.
    for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, m, Algorithm::seed); ++k) {
      progress.update("blockswap bench: " + mode + " K=" + std::to_string(k) + ",",
                      int(rows.size()) + 1, total);
      Options options;
      options.blocks_to_swap = k;
      options.supports_backward = train;
      options.emulated_link_gbps = args.link_gbps;
      if (finetune) options.optimizer = finetune_adamw();
      options.step_on = on_host ? StepOn::host : StepOn::device;
      BenchRow row;
      row.device = "emulated";
      row.model = "reference";
      row.copy_compute_ratio = copy_seconds / compute_seconds;
      row.mode = mode;
      row.k = k;
      if (!train && k > 0) row.rotating_slots = layout::default_rotating_slots(n, k);
      // The three variants take turns, step by step, so that each ratio compares steps run
      // under the same machine conditions.
      ModelOffloader swap_offloader("blocks", swapped_model.modules(), options);
      options.algorithm = Algorithm::seed;
      ModelOffloader seed_offloader("blocks", seeded_model.modules(), options);
      StepRunner runners[] = {{plain, nullptr, input, work},
                              {swapped_model, &swap_offloader, input, work},
                              {seeded_model, &seed_offloader, input, work}};
      std::vector<double> times[3];
      for (int step = 0; step <= steps; ++step) {
        if (step == 1) swap_offloader.reset_stats();
        for (int v = 0; v < 3; ++v) {
          const double seconds = runners[v].step(nullptr);
          if (step > 0) times[v].push_back(seconds);
        }
      }
      row.t_noswap = median(times[0]);
      row.t_swap = median(times[1]);
      row.t_seed = median(times[2]);
      const Stats stats = swap_offloader.stats();
      row.h2d_bytes = stats.h2d_bytes / uint64_t(steps);
      row.d2h_bytes = stats.d2h_bytes / uint64_t(steps);
      row.peak_device_bytes = stats.peak_device_bytes;
      row.planned_device_bytes = layout::slot_device_bytes(on_host    ? ft_host_packed
                                                           : finetune ? ft_packed
                                                                      : packed,
                                                           k);
      // The link carries the loads and, fine-tuning, the write-backs of changed blocks (or,
      // with the step on the host, the gradients).
      row.t_bound = std::max(row.t_noswap, double(row.h2d_bytes + row.d2h_bytes) / (gbps * 1e9));
      rows.push_back(row);
    }
  }
  progress.done();

  // The emulated sweep in a few figures.
  double worst_bound = 0, worst_seed = 1e9, finetune_bound = 0, finetune_noswap = 0;
  double host_bound = 0, host_noswap = 0;
  // Where the fused step is faster: for each K, the host's t_swap/t_noswap over the device's
  // (each against the no-swap steps measured beside it, so machine drift between the two
  // sweeps cancels).
  std::vector<double> host_over_device;
  bool peaks_exact = true;
  for (const BenchRow& r : rows) {
    if (r.mode == "finetune") {
      finetune_bound = std::max(finetune_bound, r.t_swap / r.t_bound);
      finetune_noswap = std::max(finetune_noswap, r.t_swap / r.t_noswap);
      for (const BenchRow& h : rows) {
        if (h.mode == "finetune-host" && h.k == r.k) {
          host_over_device.push_back((h.t_swap / h.t_noswap) / (r.t_swap / r.t_noswap));
        }
      }
    } else if (r.mode == "finetune-host") {
      host_bound = std::max(host_bound, r.t_swap / r.t_bound);
      host_noswap = std::max(host_noswap, r.t_swap / r.t_noswap);
    } else {
      worst_bound = std::max(worst_bound, r.t_swap / r.t_bound);
    }
    if (r.mode == "infer" && 4 * r.k >= n) worst_seed = std::min(worst_seed, r.t_seed / r.t_swap);
    peaks_exact = peaks_exact && r.peak_device_bytes == r.planned_device_bytes;
  }
  const std::string title =
      detail::concat("blockswap bench: ", n, " blocks of ", format_bytes(block_bytes), ", ", tokens,
                     " tokens, emulated link ", args.link_gbps, " GB/s");
  info = {{"blocks", n},
          {"block_bytes", block_bytes},
          {"tokens", tokens},
          {"steps", steps},
          {"link_gbps", args.link_gbps},
          {"achieved_gbps", gbps},
          {"block_copy_seconds", copy_seconds},
          {"block_forward_seconds", compute_seconds},
          {"title", title},
          {"summary",
           {{"max_swap_over_bound", worst_bound},
            {"min_seed_over_swap_infer_k_ge_n_over_4", worst_seed},
            {"finetune_max_swap_over_bound", finetune_bound},
            {"finetune_max_swap_over_noswap", finetune_noswap},
            {"finetune_host_max_swap_over_bound", host_bound},
            {"finetune_host_max_swap_over_noswap", host_noswap},
            {"finetune_host_over_device_median", median(host_over_device)},
            {"peak_device_bytes_as_planned", peaks_exact}}}};
  if (args.json) return rows;
  std::printf("Emulated device (real compute on this CPU, real copies): %s\nachieved link %.1f "
              "GB/s; per block: copy %.2f ms, forward %.2f ms; median of %d steps\n\n",
              title.c_str(), gbps, copy_seconds * 1e3, compute_seconds * 1e3, steps);
  std::printf("%-13s %3s %10s %10s %10s %10s %9s %9s %11s %12s %12s\n", "mode", "K", "noswap",
              "blockswap", "seed", "bound T*", "swap/T*", "seed/swap", "swap/noswap", "h2d/step",
              "d2h/step");
  for (const BenchRow& r : rows) {
    std::printf("%-13s %3lld %10s %10s %10s %10s %9.3f %9.2f %11.3f %12s %12s\n", r.mode.c_str(),
                static_cast<long long>(r.k), milliseconds(r.t_noswap).c_str(),
                milliseconds(r.t_swap).c_str(), milliseconds(r.t_seed).c_str(),
                milliseconds(r.t_bound).c_str(), r.t_swap / r.t_bound, r.t_seed / r.t_swap,
                r.t_swap / r.t_noswap, format_bytes(r.h2d_bytes).c_str(),
                format_bytes(r.d2h_bytes).c_str());
  }
  std::printf("\nsummary: max T_swap/T* = %.3f; min T_seed/T_swap for inference with K >= N/4 = "
              "%.2f; peak device bytes as planned: %s\n",
              worst_bound, worst_seed, peaks_exact ? "yes" : "NO");
  std::printf("fine-tuning (T* counts the loads and the write-backs on the one link): max "
              "T_swap/T* = %.3f, max T_swap/T_noswap = %.3f\n",
              finetune_bound, finetune_noswap);
  std::printf("fine-tuning with the step on the host: max T_swap/T* = %.3f, max "
              "T_swap/T_noswap = %.3f; the host's step time over the device's (each against "
              "its no-swap steps), median over K = %.3f\n",
              host_bound, host_noswap, median(host_over_device));
  return rows;
}

} // namespace blockswap::tool
