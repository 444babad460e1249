// ModelOffloader and the planning helpers for block lists. Part of the LibTorch front end: the
// usage example, and what happens to the blocks' tensors while they swap, are at the top of
// blockswap/torch.hpp, which includes this header and LibTorch's nn headers. This one names
// torch::nn::Module and ModuleList only through pointers and references, so it needs only c10
// and at::Tensor: a source that passes a torch::nn::ModuleList includes
// torch/nn/modules/container/modulelist.h (or blockswap/torch.hpp). A block's inputs and outputs
// are a std::vector<at::Tensor>, the same type as torch::autograd::variable_list.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/schedule.hpp"
#include "blockswap/torch/activation_scope.hpp"
#include "blockswap/torch/options.hpp"

namespace torch::nn {
class Module;
class ModuleList; // a ModuleHolder<ModuleListImpl> (TORCH_MODULE), defined in modulelist.h
} // namespace torch::nn

namespace blockswap {

using BlockList = std::vector<std::shared_ptr<torch::nn::Module>>;

// A block given as its tensors rather than a torch::nn::Module (the Python package's blocks are
// Python modules): every parameter and buffer with its name. A tensor listed twice (an
// adapter wrapper's `weight` that aliases its base layer's) is packed once.
struct TensorBlock {
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
};

// The packed bytes of each block as an offloader packs them: every frozen parameter at an
// aligned offset (core/layout.hpp). Validates the blocks as the constructor does.
std::vector<std::size_t> packed_block_bytes(const BlockList& blocks,
                                            c10::Device device = c10::kCPU);

// The same for blocks given as their tensors, which may be on the meta device (only shapes and
// dtypes count): planning a model before its weights are loaded.
std::vector<std::size_t> packed_block_bytes(const std::vector<TensorBlock>& blocks,
                                            c10::Device device = c10::kCPU);

// K for each of a model's block lists on one device (FLUX: double and single blocks), so that
// all their slots fit `budget_bytes` together and the fewest bytes move per step: the search
// `blockswap plan` runs on a file, here on the live modules. Pass plan.lists[i].blocks_to_swap
// to list i's offloader.
SwapPlan plan_block_lists(const std::vector<BlockList>& lists, std::size_t budget_bytes, Mode mode,
                          c10::Device device = c10::kCPU);

// Whether ModelOffloader can use device kCUDA here: blockswap built with its CUDA backend,
// LibTorch built with CUDA, and a GPU present.
bool cuda_available();

using BlockFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

class ModelOffloader {
public:
  // Validates every tensor first (meta, sparse, quantized, not contiguous, on another device,
  // shared between blocks, managed by another offloader) and throws blockswap::Error naming it;
  // also for an empty or null block list, K out of range, a budget too small for any K, or
  // device memory that cannot hold the slots. All or nothing: when it throws, every tensor is
  // as it was. Only blockswap::Error escapes.
  ModelOffloader(std::string block_type, BlockList blocks, Options options);
  ModelOffloader(std::string block_type, const torch::nn::ModuleList& blocks, Options options);
  ModelOffloader(std::string block_type, std::vector<TensorBlock> blocks, Options options);
  // Waits for copies in flight and leaves every packed parameter and buffer an ordinary host
  // tensor holding its current values. Never throws. A backward that needs the offloader
  // afterwards raises blockswap::Error; no memory is ever read after it is freed.
  ~ModelOffloader();

  // not copyable, not movable: blocks' tensors and autograd nodes refer to it
  ModelOffloader(const ModelOffloader&) = delete;
  ModelOffloader& operator=(const ModelOffloader&) = delete;

  // Places blocks as a pass starts (all of them while swapping is disabled). When it moves
  // blocks it waits until they are loaded; in the steady state it returns at once, and the
  // loads the last pass started are waited for by wait_for_block / run_block. Call it before
  // every forward pass.
  void prepare_block_devices_before_forward();
  // Makes compute wait for block i's load. Throws if block i is not on the device. During the
  // recompute pass of reentrant checkpointing (grad mode on, with that option) it loads block
  // i if it is not on the device and moves nothing else.
  void wait_for_block(int64_t block_idx);
  // After block i's forward: its moves (DESIGN.md section 1); nothing in the recompute pass.
  // With grad mode on (and K > 0) it throws: the plain verb cannot see backward, so a block
  // could be gone when its backward runs. Train with run_block or the overload below; run
  // inference under torch::NoGradGuard.
  void submit_move_blocks_forward(int64_t block_idx);
  // The same, for training by hand: pass block i's outputs and go on with the tensors it
  // returns (the same values). They bracket the block in autograd: before its backward runs,
  // its weights are brought back where its forward's saved tensors point.
  std::vector<at::Tensor> submit_move_blocks_forward(int64_t block_idx,
                                                     const std::vector<at::Tensor>& outputs);
  // For front ends that see a block's outputs apart from its end (the Python package's forward
  // hooks): brackets block i's outputs as the overload above does, without its moves; the
  // plain submit_move_blocks_forward(i) follows and makes them.
  std::vector<at::Tensor> bracket_outputs(int64_t block_idx,
                                          const std::vector<at::Tensor>& outputs);
  void disable_block_swap();
  void enable_block_swap();
  // Forward-only (inference) or training moves. Training needs supports_backward.
  void set_forward_only(bool forward_only);
  // wait → fn → submit, with the block bracketed in autograd when grad mode is on: exact
  // gradients whatever part of the model the backward covers, in whatever order, however many
  // times. `fn` receives the block's inputs (undefined ones stay undefined).
  std::vector<at::Tensor> run_block(int64_t block_idx, const std::vector<at::Tensor>& inputs,
                                    const BlockFn& fn);
  bool is_resident(int64_t block_idx) const;
  // With Options::compress: each frozen tensor of block i whose weights are stored compressed
  // (the module's own tensor, which has no elements off the device), with its true values decoded
  // into host memory of their own; empty when the block's frozen weights are not compressed. For
  // whatever must read every weight (a state_dict, a copy of the model): Note [compressed
  // frozen views] in src/torch/tier_views.cpp. Throws Error where the bytes are damaged.
  std::vector<std::pair<at::Tensor, at::Tensor>> frozen_values(int64_t block_idx) const;
  // Saves now what the caller wrote into block i's tensors since blockswap bound them, which its
  // next move would save: a compressed block's changed frozen weights are encoded again and its
  // tensors off the device have no elements again (Note [changed compressed weights] in
  // src/torch/block_binder.cpp). Throws Error for a change that cannot be kept (it is dropped).
  void take_changes(int64_t block_idx);
  // Whether block i is read from Options::weights_file for each load (the file tier).
  bool is_in_file(int64_t block_idx) const;
  // Blocks the host until every copy enqueued so far has completed (not the computations).
  // After a backward that raised part-way (fine-tuning), it first finishes the steps that
  // backward took, so weights read afterwards are the stepped ones (the next pass does too).
  void synchronize();
  int64_t blocks_to_swap() const; // K, as given or as the planner chose it
  Stats stats() const;
  // With Options::compress: the blocks stored compressed, their frozen bytes raw and compressed
  // (the host memory saved is the difference), the ratio, the decode buffer's device bytes.
  CompressionStats compression() const;
  // With Options::offload_activations: the device's saved activations (activation_stats).
  ActivationStats activation_stats() const;
  void reset_stats(); // activation_stats() too, with offload_activations
  // The Device it runs on (Options::shared_device, or its own): its memory account, its budget,
  // and the TransferStats of the activations this offloader's blocks offload.
  std::shared_ptr<Device> device() const;

  // Full fine-tuning (Options::optimizer). The learning rate of the steps from now on (a
  // schedule changes it between steps).
  void set_learning_rate(double lr);
  // New hyper-parameters for the steps from now on (a schedule of betas or momentum): the same
  // kind of optimizer with the same state (SGD's momentum cannot start or stop being 0).
  void set_optimizer(const FusedOptimizer& optimizer);
  // Where the steps run: Options::step_on, with automatic resolved (device or host; device
  // when there is no optimizer).
  StepOn step_on() const;
  // With Options::gradient_accumulation_steps n: the backward calls counted toward the next
  // step, 0 right after the n-th stepped (always 0 for n = 1). The step runs inside the n-th
  // backward call that reaches the blocks, so a trainer whose own step comes after n
  // micro-batches checks here that each of them had its backward: a micro-batch without one
  // would move every later step by one (docs/guide.md, "Fine-tuning").
  int64_t accumulated_backwards() const;
  // Steps taken so far (each in the n-th backward of its accumulation): more than one since
  // your own step means two backward calls per micro-batch (the Python optimizers check it).
  int64_t completed_steps() const;
  // torch.optim's zero_grad in the middle of an accumulation: drops the gradients summed so
  // far; the count of backwards goes on (the Python optimizers' zero_grad calls it).
  void discard_accumulated_gradients();
  // Block i's optimizer state, by name ("<parameter>.exp_avg", ".exp_avg_sq" for AdamW,
  // ".momentum_buffer" for SGD, ".state<j>" for a callback, ".grad_sum" while gradients are
  // being accumulated): tensors that read their true values wherever the block is, and that
  // take what is copied into them (copy_), like the block's parameters; for checkpoints.
  std::vector<std::pair<std::string, at::Tensor>> optimizer_state(int64_t block_idx) const;
  // How many steps block i's parameters took, by parameter name (AdamW's `step`).
  std::vector<std::pair<std::string, int64_t>> optimizer_steps(int64_t block_idx) const;
  void set_optimizer_steps(int64_t block_idx, const std::string& parameter, int64_t steps);

  class Impl;

private:
  std::shared_ptr<Impl> impl_;
};

} // namespace blockswap
