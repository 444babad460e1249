// `blockswap bench` on the timed device: blockswap, the seed replay and the bound T* for model
// geometries at several copy/compute ratios, every figure in device time (the same on any
// machine). The emulated-device sweep is bench_command.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "blockswap/core/simulator.hpp"

namespace blockswap::tool {

// One row of `blockswap bench`, from either device.
struct BenchRow {
  std::string device; // timed | emulated
  std::string model;  // reference | flux | wan14b
  double copy_compute_ratio = 0;
  std::string mode; // infer | train | finetune (emulated device only)
  int64_t k = 0;    // flux: double blocks swapped (single blocks: 2k)
  double t_noswap = 0, t_swap = 0, t_seed = 0, t_bound = 0;
  double t_predicted = 0;     // the simulator's t_swap (timed device only)
  int64_t rotating_slots = 0; // blockswap's R per list (inference; the first list's)
  uint64_t h2d_bytes = 0, d2h_bytes = 0, peak_device_bytes = 0, planned_device_bytes = 0;
};

// A model's block lists, by geometry: lists[i] blocks of bytes[i] each.
struct ModelShape {
  std::string name;
  std::vector<int64_t> blocks;
  std::vector<std::size_t> bytes;
};

// The reference transformer (hidden 768, 8 blocks), FLUX.1 (19 double blocks of 340 M and 38
// single blocks of 142 M parameters, bf16) and Wan 2.1 14B (40 blocks of 351 M, bf16).
std::vector<ModelShape> bench_shapes(int64_t reference_blocks, std::size_t reference_block_bytes);

struct TimedBenchOptions {
  LinkModel link{25e9, 5e-6}; // PCIe 4, pinned; a copy's launch cost
  std::vector<double> ratios{0.5, 0.8, 1.0, 1.5};
  double backward_factor = 2.0;
  bool quick = false; // five K per model and mode instead of every one
};

// Every row: each model × ratio × mode × K, measured on the timed device. A block's forward
// takes its copy time divided by the ratio (compute in proportion to bytes).
std::vector<BenchRow>
timed_bench(const std::vector<ModelShape>& shapes, const TimedBenchOptions& options,
            const std::function<void(const std::string&, int, int)>& progress);

} // namespace blockswap::tool
