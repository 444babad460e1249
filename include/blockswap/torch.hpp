// blockswap's LibTorch front end: the seed's ModelOffloader for torch::nn::Module blocks.
//
//   #include <blockswap/torch.hpp>
//
//   std::vector<std::shared_ptr<torch::nn::Module>> blocks = ...;  // frozen base + LoRA
//   blockswap::Options options;
//   options.blocks_to_swap = 6;
//   options.supports_backward = true;
//   blockswap::ModelOffloader offloader("blocks", blocks, options);
//
//   for (int step = 0; step < steps; ++step) {
//     offloader.prepare_block_devices_before_forward();
//     torch::Tensor h = x;
//     for (int64_t i = 0; i < (int64_t)blocks.size(); ++i) {
//       h = offloader.run_block(i, {h}, [&, i](const torch::autograd::variable_list& in) {
//         return torch::autograd::variable_list{blocks[i]->as<Block>()->forward(in[0])};
//       })[0];
//     }
//     loss(h).backward();  // blocks move back in during backward, as the seed's hooks do
//     optimizer.step();
//   }
//
// Each block's frozen parameters and buffers are packed into one aligned host buffer (pinned
// on a GPU). While a block is on the device its tensors are views of its device slot; while it
// is not, they are empty tensors, so using one fails loudly. Parameters that require grad
// (adapters being trained) are never packed and never move.
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/schedule.hpp"
#include "blockswap/trace.hpp"

namespace blockswap {

struct Options {
  int64_t blocks_to_swap = 0; // K; -1 = let the planner choose from device_budget_bytes
  bool supports_backward = false;
  c10::Device device = c10::kCPU; // kCUDA: the GPU; kCPU: the emulated device
  bool reentrant_activation_checkpointing = false;
  bool debug = false;
  std::size_t device_budget_bytes = 0; // weights budget for the planner
  double emulated_link_gbps = 0;       // emulated device: copy bandwidth limit, 0 = unlimited
  // Forward-only: slots that swapped blocks rotate through (1 <= R <= N-K); K+R blocks load per
  // pass. 0 = min(2, N-K). N-K reproduces the seed's cyclic scheme (every block, every pass).
  int64_t rotating_slots = 0;
  // Emulated device only: its memory in bytes (over it is an out-of-memory error); 0 = no limit.
  std::size_t emulated_capacity_bytes = 0;
  // When set, records every block's compute (run_block) and every copy, for a Chrome trace.
  std::shared_ptr<Trace> trace = nullptr;
  // Algorithm::seed replays the seed's own moves (copy back on every eviction, every block
  // every inference pass, host-blocking waits): the baseline the benchmarks measure against.
  Algorithm algorithm = Algorithm::blockswap;
};

struct Stats {
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  uint64_t moves = 0;
  double stall_seconds = 0;
  uint64_t device_bytes = 0;
  uint64_t peak_device_bytes = 0;
};

// Whether ModelOffloader can use device kCUDA here: blockswap built with its CUDA backend,
// LibTorch built with CUDA, and a GPU present.
bool cuda_available();

using BlockFn =
    std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)>;

class ModelOffloader {
public:
  // Throws blockswap::Error for an empty or null block list, a parameter shared between blocks,
  // K out of range, a budget too small for any K, or device memory that cannot hold the slots.
  ModelOffloader(std::string block_type, std::vector<std::shared_ptr<torch::nn::Module>> blocks,
                 Options options);
  ModelOffloader(std::string block_type, const torch::nn::ModuleList& blocks, Options options);
  // Waits for copies in flight and leaves every packed parameter and buffer an ordinary host
  // tensor holding its original values. Never throws.
  ~ModelOffloader();

  // not copyable, not movable: blocks' tensors and autograd nodes refer to it
  ModelOffloader(const ModelOffloader&) = delete;
  ModelOffloader& operator=(const ModelOffloader&) = delete;

  // Places blocks as a pass starts (all of them while swapping is disabled). When it moves
  // blocks it waits until they are loaded; in the steady state it returns at once, and the
  // loads the last pass started are waited for by wait_for_block / run_block. Call it before
  // every forward pass.
  void prepare_block_devices_before_forward();
  // Makes compute wait for block i's load. Throws if block i is not on the device. Does nothing
  // during the recompute pass of reentrant checkpointing (grad mode on, with that option).
  void wait_for_block(int64_t block_idx);
  // After block i's forward: its moves (DESIGN.md section 1). Same reentrant rule.
  void submit_move_blocks_forward(int64_t block_idx);
  void disable_block_swap();
  void enable_block_swap();
  // Forward-only (inference) or training moves. Training needs supports_backward.
  void set_forward_only(bool forward_only);
  // wait → fn → submit. In training with grad mode on, the backward moves are wired into
  // autograd, and a block whose slot is reused between its forward and its backward is
  // recomputed in backward (autograd's saved views of its weights would read another block).
  // `fn` must stay callable until that backward has run.
  torch::autograd::variable_list
  run_block(int64_t block_idx, const torch::autograd::variable_list& inputs, const BlockFn& fn);
  bool is_resident(int64_t block_idx) const;
  // Blocks the host until every copy enqueued so far has completed (not the computations).
  void synchronize();
  int64_t blocks_to_swap() const; // K, as given or as the planner chose it
  Stats stats() const;
  void reset_stats();

  class Impl;

private:
  std::shared_ptr<Impl> impl_;
};

} // namespace blockswap
