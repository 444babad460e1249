// The blockswap tool's commands.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "blockswap/core/schedule.hpp"

namespace blockswap {
struct ModelLayout; // model_io/model_plan.hpp
} // namespace blockswap

namespace blockswap::tool {

struct RunArgs {
  std::string mode = "infer";   // infer | train | finetune
  std::string step_on = "auto"; // finetune: auto | device | host
  int64_t blocks = 8;
  std::optional<int64_t> swap; // none: half the blocks, within the valid range
  int64_t hidden = 384;
  int64_t heads = 6;
  // Which of the three were given: with --weights, the file says the shape, and a given value
  // must agree with it.
  bool blocks_given = false, hidden_given = false, heads_given = false;
  int64_t tokens = 256;
  int64_t lora_rank = 8;
  int steps = 5;
  std::string device; // empty: the best device present
  double link_gbps = 25;
  int threads = 1;
  std::string weights;      // load the model from this safetensors file
  std::string save_weights; // write the model's initial weights here
  std::string trace;
  bool json = false;
  // Options::compress: off | on | auto (the blocks' frozen weights compressed in host memory).
  std::string compress = "off";
  // The reference transformer's blocks in float32 or bfloat16 (its weights and the input).
  std::string dtype = "float32";
  // The file tier: host memory for the swapped blocks' weights; the rest are read from --weights
  // for each load (empty: the model loaded whole, side by side with the baseline).
  std::string host_budget;
  std::string file_reads = "direct"; // direct | drop (Options::file_reads)
  // The emulated device pins at most this much host memory (empty: no cap), as a low
  // `ulimit -l` or WSL does: past it, the host copies are pageable and their loads staged.
  std::string pinnable_bytes;
  // Training: what each block saves for backward goes to host memory (Options::
  // offload_activations); both runs count the device bytes saved activations hold.
  bool offload_activations = false;
  std::string activation_threshold = "64KiB"; // saved storages under it stay on the device
  // Data-parallel LoRA training over this many processes (0: one process, no c10d).
  int ranks = 0;
  // The ranks as this many nodes of ranks/nodes each (on this machine): node sharing within a
  // node, one host copy each, as that many machines would hold.
  int nodes = 1;
  double timeout_seconds = 60; // how long a rank waits for the others
  int kill_rank = -1;          // fault injection: that rank dies in its second step
};

struct PlanArgs {
  std::string model;
  std::string budget;
  std::string mode = "train";
  bool json = false;
  // The prediction: the link, and a block's forward either given (the largest block's, others
  // in proportion to their bytes) or from the device's throughput and the tokens per step.
  double link_gbps = 25;
  double block_ms = 0; // 0: from --tflops and --tokens
  double tflops = 100;
  int64_t tokens = 4096;
  // The file tier: host memory for the swapped blocks' weights (empty: all of them), the rest
  // read from the model's file for each load, at --disk-gbps.
  std::string host_budget;
  double disk_gbps = 7;
  // Training: the bytes each block's forward saves for backward (empty: not predicted); the
  // step and the device memory for activations with and without offloading them.
  std::string activation_bytes;
  // Pipeline training (plan_pipeline.cpp): the blocks cut into `stages` stages (0: none), each
  // on its own device of the budget, `micro_batches` per step in `pipeline`'s order.
  int64_t stages = 0;
  std::string pipeline = "1f1b";
  int64_t micro_batches = 8;
  // Compressed weights (Options::compress): the ratio (0: modelled from the checkpoint's dtypes,
  // plan_compression.hpp) and the device's decode GB/s.
  double compress_ratio = 0;
  double decode_gbps = 200;
};

struct BenchArgs {
  std::string device = "both"; // timed | emulated | both
  bool quick = false;
  bool json = false;
  std::string csv;
  std::string plot; // SVG
  double link_gbps = 25;
  int64_t blocks = 8;
  int64_t hidden = 768;
  int steps = 0;      // 0: 8 with --quick, else 20
  int64_t tokens = 0; // 0: calibrated so that a block's compute takes about its copy time
};

// K from --swap, or half the blocks, within 0 <= K <= Schedule::max_blocks_to_swap(N, mode).
int64_t blocks_to_swap(const RunArgs& args, int64_t blocks, Mode mode);

// With --weights: --blocks, --hidden and --heads, where given, agree with the file.
void check_shape_agrees_with_weights(const RunArgs& args);

int run_command(const RunArgs& args);
// `run --ranks R`: launches R processes of this executable (`argv`), one rank each, and reports
// them; in a rank (BLOCKSWAP_JOB_DIR set by the launcher) runs that rank.
int ranks_command(const RunArgs& args, char** argv);
int bench_command(const BenchArgs& args);
int plan_command(const PlanArgs& args);
int plan_pipeline(const PlanArgs& args, const ModelLayout& layout, uint64_t budget);

} // namespace blockswap::tool
