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
// is not, they are views of its host copy, so reading them (sum(), torch::save) gives their
// true values, and on a GPU computing with them fails on the device check. Parameters that
// require grad (adapters being trained) are never packed and never move unless
// Options::optimizer is set (full fine-tuning, below); buffers (running statistics) never are.
// Weights the caller changes through the tensor (copy_, torch::load) are written back to the host
// copy, never dropped; writes through .data() or data_ptr() are not seen.
//
// Training is exact in any order: before a block's backward runs, its weights are put back
// where its forward's saved tensors point (loading them if another block took the slot). With
// grad mode on, the plain submit_move_blocks_forward(i) cannot see backward and raises; use
// run_block, or the overload that takes and returns the block's outputs. docs/guide.md lists
// which call patterns are exact and which raise.
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/schedule.hpp"
#include "blockswap/core/trace.hpp"
#include "blockswap/device/device.hpp"

namespace blockswap {

// Which of torch's implementations of an optimizer the fused step reproduces bit for bit.
// They compute the same formula; their kernels round differently in the last bits.
enum class OptimizerKernel {
  libtorch,    // torch::optim's C++ SGD / AdamW (the C++ default)
  for_loop,    // torch.optim's single-tensor path (foreach=False)
  foreach,     // torch.optim's foreach path (foreach=True)
  fused,       // torch.optim's fused=True
  torch_optim, // torch.optim's own default for the device: foreach on CUDA, for_loop elsewhere
};

// Full fine-tuning (docs/guide.md, "Fine-tuning"): with an optimizer in Options, the blocks'
// parameters that require grad swap with their blocks (packed after the frozen ones, with the
// optimizer's state for them) and are stepped during backward, each as soon as its gradient is
// complete (the "fused backward pass"); a block changed on the device is written back to host
// memory when it leaves. The steps are bitwise those of the implementation `kernel` names on
// the same device: LibTorch's torch::optim::SGD and AdamW by default in C++, torch.optim's
// default for the device in Python; a parameter that got no gradient is not stepped, as there.
struct FusedSGD {
  double lr = 0;
  double momentum = 0; // 0: no state; else one momentum buffer per parameter
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  OptimizerKernel kernel = OptimizerKernel::libtorch;
};
struct FusedAdamW {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2; // decoupled: p *= 1 - lr * weight_decay
  OptimizerKernel kernel = OptimizerKernel::libtorch;
};
// One parameter's step, for a callback (FusedCustom). `param` and `state` are views of the
// block's memory on the device (StepOn::host: of its host copy, on the step's own thread, one
// parameter at a time): change them in place (under no grad, which is on). `state`
// holds FusedCustom::state_tensors tensors shaped like the parameter, zeros before the first
// step; `step` counts this parameter's steps, this one included (1 on the first).
struct ParamStep {
  std::string name; // the parameter's name in its block
  int64_t block = 0;
  at::Tensor param;
  at::Tensor grad;
  std::vector<at::Tensor> state;
  int64_t step = 0;
};
struct FusedCustom {
  int64_t state_tensors = 0;
  std::function<void(const ParamStep&)> step;
};
// std::monostate: no optimizer; parameters that require grad (adapters) stay on the device and
// are the trainer's (LoRA).
using FusedOptimizer = std::variant<std::monostate, FusedSGD, FusedAdamW, FusedCustom>;

// Where the fused step runs. device: the block's optimizer state swaps with it and the step
// runs where the block is; changed blocks are written back. host: each gradient is copied to
// host memory on the copy stream, the CPU steps the block's host copy (the optimizer state
// stays there and never moves) while the device goes on, and the new weights are loaded next
// time (a block still on the device at the end of backward is reloaded then). automatic: the
// one measured faster for the device (docs/performance.md, "Full fine-tuning"): host on the
// emulated device (a CPU), device on a GPU.
enum class StepOn { automatic, device, host };

// Data-parallel ranks of one node reading one host copy of the swapped weights
// (docs/distributed.md). Every local rank builds its offloaders with the same blocks in the same
// order; the constructor is collective over the node's ranks. Local rank 0 packs the frozen
// weights into node-shared memory (core/node_memory.hpp) and publishes it through the job's
// store; the others map it and never copy it (their own frozen tensors, which may be on the
// meta device, are only read for their shapes and dtypes, and then released): every rank's
// frozen weights are local rank 0's, as DistributedDataParallel makes every rank's parameters
// rank 0's. Those weights may not change while the offloader lives (a write raises
// blockswap::Error), nor may anything train in the blocks' packed memory (no `optimizer`).
// Device slots, the copy stream, adapters and their gradients stay per rank.
struct NodeSharing {
  // The job's rendezvous, in practice the c10d store of its process group
  // (blockswap/distributed.hpp makes one from a c10d::Store): `set` publishes a value under a
  // key; `get` returns it, waiting until it is set, and throws when that takes longer than the
  // store's timeout (a rank that died, a rank that never builds the offloader).
  std::function<void(const std::string& key, const std::string& value)> set;
  std::function<std::string(const std::string& key)> get;
  int64_t local_rank = 0;       // this process's rank among the node's ranks
  int64_t local_world_size = 1; // the node's ranks
  // Tells apart groups of ranks that meet through one store (process subgroups, each with its
  // own offloaders): the same for every rank of a group, different between groups. Empty: the
  // store's ranks are one group.
  std::string group = {};
  explicit operator bool() const { return static_cast<bool>(set) || static_cast<bool>(get); }
};

// What a ModelOffloader is built with. Options::check throws blockswap::InvalidArgument for
// one out of range or two that contradict each other; the constructor calls it first, so a
// mistake is found before anything is packed or allocated.
struct Options {
  int64_t blocks_to_swap = 0;     // K; -1 lets the planner choose it from device_budget_bytes
  bool supports_backward = false; // training possible; starts in training mode when true
  // Forward-only R, 1 <= R <= N-K: the slots blocks rotate through; K+R blocks load per pass.
  // 0 = layout::default_rotating_slots; N-K is the seed's cyclic scheme.
  int64_t rotating_slots = 0;
  // Algorithm::seed replays the seed's own moves: the benchmarks' baseline.
  Algorithm algorithm = Algorithm::blockswap;
  bool debug = false; // the seed's lines, one per move and wait, to `log` or stderr
  std::function<void(const std::string&)> log = {};
  // Every copy and wait, and each block's compute in run_block, for a Chrome trace.
  std::shared_ptr<Trace> trace = {};
  c10::Device device = c10::kCPU; // kCUDA: the GPU; kCPU: the emulated device
  bool reentrant_activation_checkpointing = false;
  // blocks_to_swap = -1: the weights budget the planner chooses K for. It binds nothing else.
  std::size_t device_budget_bytes = 0;
  double emulated_link_gbps = 0; // emulated device: copy bandwidth limit, 0 = unlimited
  // Emulated device only: its memory in bytes (over it is an out-of-memory error); 0 = no limit.
  std::size_t emulated_capacity_bytes = 0;
  // Tests and debugging on the emulated device: a block's tensors have no elements while it is
  // not ready, so computing with a block that is not on the device fails at once instead of
  // reading its host copy. Reading such tensors gives empty data: not for saving checkpoints.
  bool strict_residency = false;
  // A device shared with other offloaders (a model's other block lists): one copy stream, one
  // memory account, one budget (open_device below). When set, the device is this one: leave
  // `device`, `device_budget_bytes` and the emulated_* fields at their defaults; with
  // blocks_to_swap = -1 the planner fits what the device's budget has left.
  std::shared_ptr<Device> shared_device = nullptr;
  // Full fine-tuning (above): the optimizer that steps the blocks' trainable parameters during
  // backward. Needs supports_backward.
  FusedOptimizer optimizer = {};
  // Gradient accumulation: every parameter steps in every n-th backward call that reaches the
  // blocks (one per micro-batch), whichever of them reached it; the gradients of the backwards
  // before it are summed in the block's memory (and swap with it), as LibTorch sums them in
  // .grad (accumulated_backwards() below).
  int64_t gradient_accumulation_steps = 1;
  StepOn step_on = StepOn::automatic;
  // Gradient clipping by norm, for each parameter alone (its gradient scaled as
  // torch::nn::utils::clip_grad_norm_ would scale it in a list of its own); 0 = none. A fused
  // step cannot see the whole model's gradient (docs/guide.md, "Fine-tuning").
  double max_grad_norm_per_parameter = 0;
  // Clip as torch.nn.utils.clip_grad_norm_ (Python) computes it, which takes the norm of the
  // one-element stack of norms and differs from LibTorch's in the last bit; the Python package
  // sets it.
  bool clip_as_python = false;
  // Several ranks of a node share the frozen weights' host copy (above); empty: this process
  // holds its own.
  NodeSharing node_sharing = {};
  // The model's safetensors file, which holds the blocks' frozen weights (docs/guide.md, "When
  // the model does not fit in host memory"): block b's tensor `name` is
  // weights_prefix + b + "." + name in it (peft's ".base_layer" left out). The blocks the file
  // tier reads from it (host_budget_bytes) must hold the file's values: checked, once, here.
  // Empty: none.
  std::string weights_file = {};
  // The frozen parameters' values are read from weights_file, whatever the tensors hold: blocks
  // built empty (torch::empty, whose memory is never touched) are loaded without a second copy
  // of the model in host memory. Needs weights_file.
  bool weights_from_file = false;
  // The blocks' names in weights_file ("transformer_blocks."); empty: the one prefix under which
  // every block's frozen tensors are found, with their shapes and dtypes.
  std::string weights_prefix = {};
  // The file tier: this offloader's pinned host memory for the blocks that move (training's
  // first, then inference's), in block order while it lasts;
  // the others are read from weights_file for each load (the blocks that never move once), and
  // their tensors off the device are views of the file, read on demand. Unset: every block in
  // host memory. Needs weights_file; their trainable parameters (full fine-tuning) must fit.
  std::optional<std::size_t> host_budget_bytes = std::nullopt;
  int64_t staging_buffers = 2; // the file tier's ring of pinned buffers, each a slot's size
  // How the file tier keeps out of the page cache: O_DIRECT (`direct`), or buffered reads each
  // dropped from the cache after (`drop`), faster on some disks (docs/performance.md).
  CacheBypass file_reads = CacheBypass::direct;
  // Activation offloading (docs/guide.md, "Offloading activations"): what each block's forward
  // in run_block saves for backward goes to host memory (pinned, on a device->host stream of its
  // own) when the next block starts, and comes back one block ahead of its backward. With
  // blocks_to_swap = 0 too. Saved storages under activation_threshold_bytes, and the block's own
  // weights, buffers and adapters, stay where they are. Training only (grad mode on); throws at
  // construction in a process whose autograd engine is not LibTorch's own (Python: use the
  // package's offload_activations argument).
  bool offload_activations = false;
  std::size_t activation_threshold_bytes = std::size_t{1} << 20;

  // Throws blockswap::InvalidArgument, naming the option and `label`, for an option out of
  // range for `blocks` blocks or options that contradict each other. The one place options are
  // checked, for C++ and Python alike.
  void check(const std::string& label, int64_t blocks) const;
};

// A Device for offloaders to share (Options::shared_device): kCPU is the emulated device,
// kCUDA (or kCUDA with an index) the GPU, computing on torch's current stream. Throws
// blockswap::Error when this build or this LibTorch cannot use it (LibTorch 1.x with CUDA, a
// LibTorch without CUDA, no GPU), before anything runs.
std::shared_ptr<Device> open_device(c10::Device device, DeviceOptions options = {});

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

// K for each of a model's block lists on one device (FLUX: double and single blocks), so that
// all their slots fit `budget_bytes` together and the fewest bytes move per step: the search
// `blockswap plan` runs on a file, here on the live modules. Pass plan.lists[i].blocks_to_swap
// to list i's offloader.
SwapPlan plan_block_lists(const std::vector<BlockList>& lists, std::size_t budget_bytes, Mode mode,
                          c10::Device device = c10::kCPU);

// Whether ModelOffloader can use device kCUDA here: blockswap built with its CUDA backend,
// LibTorch built with CUDA, and a GPU present.
bool cuda_available();

using BlockFn =
    std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)>;

// The bytes of a torch device held by saved activations (Options::offload_activations,
// ActivationScope), shared by every offloader and scope of that device.
struct ActivationStats {
  uint64_t offloaded_bytes = 0;   // copied to host memory
  uint64_t restored_bytes = 0;    // copied back for a backward
  uint64_t device_bytes = 0;      // on the device now
  uint64_t peak_device_bytes = 0; // on the device at the peak
};
ActivationStats activation_stats(c10::Device device);
// Sets the counters to zero; the peak to the bytes on the device now.
void reset_activation_stats(c10::Device device);

// While it lives, what autograd saves on this thread for backward is block `label`'s
// activations on `device` (kCPU: the emulated device, or kCUDA): saved storages of at least
// `threshold_bytes` go to host memory when the next scope opens and come back one scope ahead
// of their backward (Note [offloaded activations] in activation_offload.cpp); the others, and
// the storages of `weights` (the block's parameters and buffers), stay and are counted (weights
// are not). run_block opens one for each block with Options::offload_activations; open one
// yourself around code outside run_block that saves for a block's backward, or, with the
// default threshold, to count a model's saved activations without moving them. Does nothing
// under no grad and inside a backward (a recompute reads what it saves at once). Throws
// blockswap::Error when copying the earlier scopes' activations to host memory fails (they stay
// on the device), or in a process whose autograd engine is not LibTorch's own.
class ActivationScope {
public:
  ActivationScope(c10::Device device, std::string label, const std::vector<at::Tensor>& weights,
                  std::size_t threshold_bytes = SIZE_MAX);
  ~ActivationScope();
  // not copyable, not movable: it stands for a stretch of this thread's code
  ActivationScope(const ActivationScope&) = delete;
  ActivationScope& operator=(const ActivationScope&) = delete;
  ActivationScope(ActivationScope&&) = delete;
  ActivationScope& operator=(ActivationScope&&) = delete;

  struct State;

private:
  std::shared_ptr<State> state_;
  std::shared_ptr<State> previous_;
};

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
  torch::autograd::variable_list
  submit_move_blocks_forward(int64_t block_idx, const torch::autograd::variable_list& outputs);
  // For front ends that see a block's outputs apart from its end (the Python package's forward
  // hooks): brackets block i's outputs as the overload above does, without its moves; the
  // plain submit_move_blocks_forward(i) follows and makes them.
  torch::autograd::variable_list bracket_outputs(int64_t block_idx,
                                                 const torch::autograd::variable_list& outputs);
  void disable_block_swap();
  void enable_block_swap();
  // Forward-only (inference) or training moves. Training needs supports_backward.
  void set_forward_only(bool forward_only);
  // wait → fn → submit, with the block bracketed in autograd when grad mode is on: exact
  // gradients whatever part of the model the backward covers, in whatever order, however many
  // times. `fn` receives the block's inputs (undefined ones stay undefined).
  torch::autograd::variable_list
  run_block(int64_t block_idx, const torch::autograd::variable_list& inputs, const BlockFn& fn);
  bool is_resident(int64_t block_idx) const;
  // Whether block i is read from Options::weights_file for each load (the file tier).
  bool is_in_file(int64_t block_idx) const;
  // Blocks the host until every copy enqueued so far has completed (not the computations).
  // After a backward that raised part-way (fine-tuning), it first finishes the steps that
  // backward took, so weights read afterwards are the stepped ones (the next pass does too).
  void synchronize();
  int64_t blocks_to_swap() const; // K, as given or as the planner chose it
  Stats stats() const;
  // With Options::offload_activations: the device's saved activations (activation_stats).
  ActivationStats activation_stats() const;
  void reset_stats(); // activation_stats() too, with offload_activations

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
