// `blockswap bench`: the sweep of K on the emulated device, blockswap against the seed's own
// schedule and the bound T* of DESIGN.md section 6, every figure from one run.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "bench_plot.hpp"
#include "blockswap/device/emulated.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/model_io/model_plan.hpp"
#include "blockswap/core/planner.hpp"
#include "commands.hpp"
#include "progress.hpp"
#include "validators.hpp"
#include "workload.hpp"

namespace blockswap::tool {
namespace {

using Clock = std::chrono::steady_clock;
using models::ReferenceTransformer;

struct Row {
  std::string mode;
  int64_t k = 0;
  double t_noswap = 0, t_swap = 0, t_seed = 0, t_bound = 0;
  uint64_t h2d_bytes = 0, peak_device_bytes = 0, planned_device_bytes = 0;
};

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

void write_csv(const std::string& path, const std::vector<Row>& rows) {
  std::ofstream file(path, std::ios::trunc);
  BLOCKSWAP_CHECK(file.is_open(), "cannot write '", path, "'");
  file << "mode,k,t_noswap,t_swap,t_seed,t_bound,h2d_bytes,peak_device_bytes\n";
  for (const Row& r : rows) {
    file << r.mode << ',' << r.k << ',' << r.t_noswap << ',' << r.t_swap << ',' << r.t_seed << ','
         << r.t_bound << ',' << r.h2d_bytes << ',' << r.peak_device_bytes << '\n';
  }
  BLOCKSWAP_CHECK(file.good(), "error while writing '", path, "'");
}

void write_plot(const std::string& path, const std::vector<Row>& rows, const std::string& title) {
  std::vector<PlotPanel> panels;
  for (const std::string mode : {"infer", "train"}) {
    PlotPanel panel{mode == "infer" ? "inference (per pass)" : "LoRA training (per step)", {}};
    PlotSeries noswap{"no swap", "#888888", {}, {}}, swap{"blockswap", "#1f77b4", {}, {}},
        seed{"seed schedule", "#d62728", {}, {}}, bound{"bound T*", "#2ca02c", {}, {}, true};
    for (const Row& r : rows) {
      if (r.mode != mode) continue;
      for (PlotSeries* s : {&noswap, &swap, &seed, &bound}) s->x.push_back(double(r.k));
      noswap.y.push_back(r.t_noswap * 1e3);
      swap.y.push_back(r.t_swap * 1e3);
      seed.y.push_back(r.t_seed * 1e3);
      bound.y.push_back(r.t_bound * 1e3);
    }
    panel.series = {noswap, seed, swap, bound};
    panels.push_back(panel);
  }
  write_svg_plot(path, title, "K (blocks swapped)", "ms", panels);
}

} // namespace

int bench_command(const BenchArgs& args) {
  BLOCKSWAP_CHECK(args.blocks >= 3, "--blocks must be at least 3, got ", args.blocks);
  const int64_t heads = std::max<int64_t>(1, args.hidden / 64);
  BLOCKSWAP_CHECK(args.hidden % heads == 0, "--hidden ", args.hidden,
                  ": bench uses hidden/64 = ", heads,
                  " heads, which do not divide it (a multiple of 64 works)");
  // The sweep takes minutes: output files that cannot be written fail now.
  if (!args.csv.empty()) check_writable("--csv", args.csv);
  if (!args.plot.empty()) check_writable("--plot", args.plot);
  at::set_num_threads(1);
  const int steps = args.steps > 0 ? args.steps : (args.quick ? 8 : 20);
  const int64_t n = args.blocks;

  models::TransformerConfig config{n, args.hidden, heads, 8, 0};
  ReferenceTransformer model(config), swapped(config), seeded(config);
  ReferenceTransformer& plain = model;
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

  std::vector<Row> rows;
  Progress progress;
  const int total = int(2 * n - 1);
  for (const std::string mode : {"infer", "train"}) {
    const bool train = mode == "train";
    const Mode m = train ? Mode::training : Mode::forward_only;
    for (int64_t k = 0; k <= Schedule::max_blocks_to_swap(n, m); ++k) {
      progress.update("blockswap bench: " + mode + " K=" + std::to_string(k) + ",",
                      int(rows.size()) + 1, total);
      Options options;
      options.blocks_to_swap = k;
      options.supports_backward = train;
      options.emulated_link_gbps = args.link_gbps;
      Row row{mode, k};
      // The three variants take turns, step by step, so that each ratio compares steps run
      // under the same machine conditions.
      ModelOffloader swap_offloader("blocks", swapped.modules(), options);
      options.algorithm = Algorithm::seed;
      ModelOffloader seed_offloader("blocks", seeded.modules(), options);
      StepRunner runners[] = {{plain, nullptr, input, train},
                              {swapped, &swap_offloader, input, train},
                              {seeded, &seed_offloader, input, train}};
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
      row.peak_device_bytes = stats.peak_device_bytes;
      row.planned_device_bytes = layout::slot_device_bytes(packed, k);
      row.t_bound = std::max(row.t_noswap, double(row.h2d_bytes) / (gbps * 1e9));
      rows.push_back(row);
    }
  }
  progress.done();

  // The targets of the performance issue, evaluated on this run.
  double worst_bound = 0, worst_seed = 1e9;
  bool peaks_exact = true;
  for (const Row& r : rows) {
    worst_bound = std::max(worst_bound, r.t_swap / r.t_bound);
    if (r.mode == "infer" && 4 * r.k >= n) worst_seed = std::min(worst_seed, r.t_seed / r.t_swap);
    peaks_exact = peaks_exact && r.peak_device_bytes == r.planned_device_bytes;
  }
  const std::string title =
      detail::concat("blockswap bench: ", n, " blocks of ", format_bytes(block_bytes), ", ", tokens,
                     " tokens, emulated link ", args.link_gbps, " GB/s");
  if (!args.csv.empty()) write_csv(args.csv, rows);
  if (!args.plot.empty()) write_plot(args.plot, rows, title);

  if (args.json) {
    nlohmann::json out_rows = nlohmann::json::array();
    for (const Row& r : rows) {
      out_rows.push_back({{"mode", r.mode},
                          {"k", r.k},
                          {"t_noswap", r.t_noswap},
                          {"t_swap", r.t_swap},
                          {"t_seed", r.t_seed},
                          {"t_bound", r.t_bound},
                          {"h2d_bytes", r.h2d_bytes},
                          {"peak_device_bytes", r.peak_device_bytes},
                          {"planned_device_bytes", r.planned_device_bytes}});
    }
    const nlohmann::json out{
        {"blocks", n},
        {"block_bytes", block_bytes},
        {"tokens", tokens},
        {"steps", steps},
        {"link_gbps", args.link_gbps},
        {"achieved_gbps", gbps},
        {"block_copy_seconds", copy_seconds},
        {"block_forward_seconds", compute_seconds},
        {"rows", out_rows},
        {"targets",
         {{"max_swap_over_bound", worst_bound},
          {"min_seed_over_swap_infer_k_ge_n_over_4", worst_seed},
          {"peak_device_bytes_as_planned", peaks_exact}}},
    };
    std::cout << out.dump(2) << '\n';
    return 0;
  }
  std::printf("%s\nachieved link %.1f GB/s; per block: copy %.2f ms, forward %.2f ms; median of %d "
              "steps\n\n",
              title.c_str(), gbps, copy_seconds * 1e3, compute_seconds * 1e3, steps);
  std::printf("%-6s %3s %10s %10s %10s %10s %9s %9s %12s\n", "mode", "K", "noswap", "blockswap",
              "seed", "bound T*", "swap/T*", "seed/swap", "h2d/step");
  for (const Row& r : rows) {
    std::printf("%-6s %3lld %10s %10s %10s %10s %9.3f %9.2f %12s\n", r.mode.c_str(),
                static_cast<long long>(r.k), milliseconds(r.t_noswap).c_str(),
                milliseconds(r.t_swap).c_str(), milliseconds(r.t_seed).c_str(),
                milliseconds(r.t_bound).c_str(), r.t_swap / r.t_bound, r.t_seed / r.t_swap,
                format_bytes(r.h2d_bytes).c_str());
  }
  std::printf("\ntargets: max T_swap/T* = %.3f (target <= 1.10); min T_seed/T_swap for inference "
              "with K >= N/4 = %.2f (target >= 1.5); peak device bytes as planned: %s\n",
              worst_bound, worst_seed, peaks_exact ? "yes" : "NO");
  return 0;
}

} // namespace blockswap::tool
