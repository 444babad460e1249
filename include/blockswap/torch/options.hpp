// What a ModelOffloader is built with (Options), the optimizers of full fine-tuning, and devices
// that offloaders share. Part of the LibTorch front end, blockswap/torch.hpp (the usage example
// is there); this part needs only c10 and at::Tensor, not torch::nn.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/file_source.hpp"
#include "blockswap/core/schedule.hpp"
#include "blockswap/core/trace.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/model_io/name_map.hpp"

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
  // Training R >= 1, for a pipeline stage (docs/distributed.md, "Pipeline stages"):
  // K+R blocks rotate through R slots, so a forward after a forward, or a backward after a
  // backward (1F1B's warm-up and cool-down, GPipe), reloads R blocks instead of K; loads hide
  // behind less compute. 0, or R >= min(K, N-K): the seed's layout.
  int64_t training_rotating_slots = 0;
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
  // Compressed weights (docs/guide.md, "Compressed weights"): on keeps the blocks' frozen
  // weights in host memory losslessly compressed (bfloat16, float16, float32, float8 tensors; a
  // block that does not shrink stays raw) and decodes them on the device at each load: exact,
  // less host memory, fewer bytes over the link. Off the device their frozen tensors have no
  // elements, as with strict_residency (close() gives them their values back); frozen weights
  // the caller changes between passes are encoded again (Note [changed compressed weights] in
  // src/torch/block_binder.cpp). automatic: on or off for this offloader as compression pays
  // (Note [automatic compression] in core/compression_choice.cpp); compression() says which and
  // why. Blocks in the file tier stay raw; not with node_sharing nor the seed's replay.
  Compress compress = Compress::off;
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
  // every block's frozen tensors are found, with their shapes and dtypes. With a name map, the
  // prefix the map is given (below).
  std::string weights_prefix = {};
  // How the module's tensor names are found in weights_file (model_io/name_map.hpp): "" or
  // "auto" (the module's own names, else FLUX's original layout if the file is in it),
  // "diffusers" (the module's own names), "flux" (diffusers' FluxTransformer2DModel blocks over
  // Black Forest Labs' names: to_q, to_k, to_v and proj_mlp read as row slices of the fused qkv
  // and linear1). ComfyUI's "model.diffusion_model." is found before any name, and fp8 scales
  // as "scale_weight" or "weight_scale". Needs weights_file.
  std::string weights_layout = {};
  // The user's name map, in place of weights_layout: from `weights_prefix + b + "." + name` to
  // the file's tensor, or rows of it (FileSlice); called while the offloader is built. Needs
  // weights_file.
  NameMap weights_map = {};
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

} // namespace blockswap
