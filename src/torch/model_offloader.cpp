#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <unordered_set>
#include <utility>

#include "activation_store.hpp"
#include "block_autograd.hpp"
#include "block_binder.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/log.hpp"
#include "blockswap/torch.hpp"
#include "file_weights.hpp"
#include "fine_tune.hpp"
#include "node_sharing.hpp"
#include "torch_compat.hpp"

namespace blockswap {

using torch_frontend::BlockBinder;
using torch_frontend::BlockLayout;

namespace {

// The torch device a blockswap Device computes on: kCPU for the emulated device.
c10::Device torch_device(const Device& device) {
  if (!device.is_cuda()) return c10::kCPU;
  const std::string name = device.name(); // "cuda:N"
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(name.substr(5))));
}

// The offloader's device: the shared one, else one of its own made from the options.
std::shared_ptr<Device> device_for(const Options& options) {
  if (!options.shared_device) {
    DeviceOptions own;
    own.emulated_link_gbps = options.emulated_link_gbps;
    own.emulated_capacity_bytes = options.emulated_capacity_bytes;
    return open_device(options.device, own);
  }
  return options.shared_device; // Options::check saw that the options agree with it
}

// Adapters being trained and buffers stay on the compute device for good: their device copies,
// made before anything is changed (the constructor is all or nothing).
std::vector<std::pair<at::Tensor, at::Tensor>>
resident_on(const std::vector<TensorBlock>& blocks, c10::Device device, bool trainable_packed) {
  std::vector<std::pair<at::Tensor, at::Tensor>> moves;
  if (device.is_cpu()) return moves;
  std::unordered_set<const void*> seen; // an aliased tensor moves once
  auto move = [&](const at::Tensor& t) {
    if (t.defined() && t.device() != device && seen.insert(t.unsafeGetTensorImpl()).second) {
      moves.emplace_back(t, t.data().to(device));
    }
  };
  for (const auto& block : blocks) {
    for (const auto& [name, p] : block.parameters) {
      if (p.defined() && p.requires_grad() && !trainable_packed) move(p);
    }
    for (const auto& [name, t] : block.buffers) move(t);
  }
  return moves;
}

int64_t choose_blocks_to_swap(const std::string& label, const Options& options,
                              const Device& device, const std::vector<BlockLayout>& layouts) {
  if (options.blocks_to_swap != -1) return options.blocks_to_swap;
  std::vector<std::size_t> bytes;
  for (const auto& layout : layouts) bytes.push_back(layout.bytes);
  const Mode mode = options.supports_backward ? Mode::training : Mode::forward_only;
  if (options.shared_device && device.budget_bytes() > 0) {
    // What the offloaders made before this one left of the device's budget.
    const std::size_t left = device.available_bytes();
    try {
      return plan_blocks_to_swap(bytes, left, mode);
    } catch (const Error& e) {
      throw OutOfMemory(detail::concat("[", label, "] the shared device ", device.name(), " has ",
                                       left, " bytes left of its budget of ", device.budget_bytes(),
                                       ": ", e.what(),
                                       ". Plan every block list together (plan_block_lists)"));
    }
  }
  try {
    return plan_blocks_to_swap(bytes, options.device_budget_bytes, mode);
  } catch (const Error& e) {
    throw OutOfMemory(detail::concat("[", label, "] ", e.what()));
  }
}

} // namespace

class ModelOffloader::Impl final : public torch_frontend::BackwardEvents {
public:
  Impl(std::string block_type, std::vector<TensorBlock> blocks, Options options)
      : options_(std::move(options)), label_(std::move(block_type)), device_(device_for(options_)),
        torch_device_(torch_device(*device_)), fine_tuner_(options_, label_, torch_device_),
        blocks_(std::move(blocks)),
        binder_(
            torch_frontend::layout_blocks(blocks_, label_, torch_device_, fine_tuner_.packing()),
            label_, torch_device_, options_.strict_residency) {
    try {
      if (options_.offload_activations) torch_frontend::install_saved_tensor_hooks();
      build();
    } catch (const std::exception& e) {
      if (share_) share_->fail(e.what()); // the node's other ranks wait for nothing
      throw;
    }
  }

  void build() {
    EngineOptions engine_options;
    if (!options_.weights_file.empty()) {
      file_ = torch_frontend::locate_weights(options_.weights_file, options_.weights_prefix,
                                             binder_.layouts_to_locate(), label_);
      if (options_.host_budget_bytes) {
        engine_options.file = FileTier{file_->path, file_->blocks, *options_.host_budget_bytes,
                                       options_.staging_buffers, options_.file_reads};
      }
    }
    engine_options.supports_backward = options_.supports_backward;
    engine_options.rotating_slots = options_.rotating_slots;
    engine_options.algorithm = options_.algorithm;
    engine_options.debug = options_.debug;
    engine_options.log = options_.log;
    engine_options.trace = options_.trace;
    if (share_) {
      share_->open(binder_.layouts()); // local rank 0's memory, or a new one on local rank 0
      engine_options.host_memory = share_->host_memory();
    }
    if (fine_tuner_.enabled()) {
      engine_options.trainable_bytes.clear();
      for (const auto& layout : binder_.layouts()) {
        engine_options.trainable_bytes.push_back(layout.trainable_bytes());
      }
    }
    engine_options.blocks_to_swap =
        choose_blocks_to_swap(label_, options_, *device_, binder_.layouts());
    blocks_to_swap_ = engine_options.blocks_to_swap;
    std::vector<std::size_t> bytes;
    for (const auto& layout : binder_.layouts()) bytes.push_back(layout.bytes);
    const std::shared_ptr<Backend> backend = device_->attach(label_);
    engine_ =
        std::make_unique<Engine>(backend, std::move(bytes), std::move(engine_options), label_);
    if (file_) use_file();
    auto resident = resident_on(blocks_, torch_device_, fine_tuner_.enabled());
    using HostCopies = torch_frontend::BlockBinder::HostCopies;
    const HostCopies copies = !share_           ? HostCopies::own
                              : share_->fills() ? HostCopies::shared_fill
                                                : HostCopies::shared_filled;
    binder_.pack(*engine_, copies); // it changes nothing when it fails
    if (share_) {
      try {
        share_->publish(); // local rank 0 waits here until every other local rank has mapped it
      } catch (...) {
        binder_.restore_to_host();
        throw;
      }
      share_->pin(*backend);
    }
    for (auto& [tensor, on_device] : resident) tensor.set_data(on_device);
    engine_->set_listener(&binder_);
    outputs_seen_.assign(blocks_.size(), false);
  }

  // The model's file (Options::weights_file): with weights_from_file, the frozen tensors' values
  // are read from it; otherwise, with the file tier, blocks read from it for each load must hold
  // its values (checked once, here). Their tensors off the device are views of it.
  void use_file() {
    std::vector<bool> in_file;
    bool any = false;
    for (int64_t b = 0; b < engine_->blocks(); ++b) {
      in_file.push_back(engine_->in_file(b));
      any = any || in_file.back();
      if (in_file.back() && !options_.weights_from_file) {
        torch_frontend::check_same_as_file(*file_, binder_.layouts()[b], b, label_);
      }
    }
    std::function<void(int64_t, std::byte*)> read;
    if (options_.weights_from_file) {
      read = [this](int64_t block, std::byte* packed) {
        torch_frontend::read_frozen(*file_, binder_.layouts()[block], block, packed, label_);
      };
    }
    binder_.use_file(any ? torch_frontend::map_file(file_->path, label_)
                         : torch_frontend::FileMap{},
                     std::move(in_file), std::move(read), file_->path);
  }

  // What needs the offloader shared: hooks that find it while it lives.
  void start(const std::shared_ptr<Impl>& self) {
    self_ = self;
    fine_tuner_.attach(self, binder_, *engine_, torch_device_.is_cuda());
  }

  torch_frontend::FineTuner& fine_tuner() { return fine_tuner_; }
  const torch_frontend::FineTuner& fine_tuner() const { return fine_tuner_; }

  ~Impl() override {
    fine_tuner_.stop(); // its worker uses the engine
    try {
      engine_->set_listener(nullptr);
      engine_->synchronize();
    } catch (const std::exception& e) {
      warn(label_, detail::concat("ModelOffloader: ", e.what()));
    }
    binder_.restore_to_host();
  }

  Engine& engine() { return *engine_; }
  c10::Device compute_device() const { return torch_device_; }
  const std::shared_ptr<Device>& device() const { return device_; }
  bool offloads_activations() const { return options_.offload_activations; }
  int64_t blocks_to_swap() const { return blocks_to_swap_; }

  // What the engine is told of each block's computation.
  // With K = 0 and no fused step nothing moves and nothing is bracketed: a block computed again
  // (non-reentrant checkpointing's recompute, which the engine sees only through backward's
  // brackets) is no different from a block computed once.
  Compute compute() const {
    return Compute{bracketed(), options_.reentrant_activation_checkpointing};
  }
  // Whether a block computed now may be differentiated later, with its weights moved by then,
  // or stepped in its backward.
  bool bracketed() const {
    return at::GradMode::is_enabled() && (blocks_to_swap_ > 0 || fine_tuner_.enabled());
  }

  void prepare() {
    binder_.check_still_frozen();
    binder_.check_file_tier_writes();
    fine_tuner_.pass_starts();
    commit_write_backs(); // a pass that stopped before the last block left some
    engine_->prepare();
  }

  // One engine call before the block, one after (Engine::enter, Engine::leave).
  torch::autograd::variable_list run_block(const std::shared_ptr<Impl>& self, int64_t block,
                                           const torch::autograd::variable_list& inputs,
                                           const BlockFn& fn) {
    Entered entered = wait(block);
    std::optional<ActivationScope> activations;
    if (options_.offload_activations) { // after the wait: the block's weights are where it runs
      activations.emplace(torch_device_, detail::concat(label_, ".", block), block_tensors(block),
                          options_.activation_threshold_bytes, device_);
    }
    const auto start = Trace::Clock::now();
    const auto outputs = fn(inputs);
    activations.reset();
    if (options_.trace) {
      last_mark_ = Trace::Clock::now();
      options_.trace->add(detail::concat("forward ", block), Track::compute, start, last_mark_);
    }
    return submit(self, block, outputs, std::move(entered.slot));
  }

  // Block b's parameters and buffers, where they are now.
  std::vector<at::Tensor> block_tensors(int64_t block) const {
    std::vector<at::Tensor> tensors;
    for (const auto& [name, t] : blocks_[block].parameters) tensors.push_back(t);
    for (const auto& [name, t] : blocks_[block].buffers) tensors.push_back(t);
    return tensors;
  }

  // Before a block's forward: its load waited for (or, in the recompute pass, made).
  Entered wait(int64_t block) {
    check_index(block);
    outputs_seen_[block] = false;
    return engine_->enter(block, compute());
  }

  void check_index(int64_t block) const {
    detail::check_block_index(label_, block, static_cast<int64_t>(outputs_seen_.size()));
  }

  // After a block's forward: its outputs bracketed in autograd, its moves. `slot` is where it
  // ran, when the caller knows.
  torch::autograd::variable_list submit(const std::shared_ptr<Impl>& self, int64_t block,
                                        const torch::autograd::variable_list& outputs,
                                        std::shared_ptr<Buffer> slot = nullptr) {
    torch::autograd::variable_list result = bracket(self, block, outputs, std::move(slot));
    engine_->leave(block, compute());
    outputs_seen_[block] = false;
    if (block + 1 == static_cast<int64_t>(outputs_seen_.size())) commit_write_backs();
    return result;
  }

  // Note [host copy after a pass]
  // A block changed in the last backward and evicted by the next forward is written back while
  // that forward runs, and its host copy takes the new bytes when the engine synchronizes. So
  // that reads and writes between passes (evaluation then a checkpoint; loading weights) see
  // the latest values, the offloader synchronizes once such a write-back is pending at the end
  // of a forward pass (after the last block), at the next prepare, and at the end of a
  // backward. At the end of a forward, the copies it waits for are the ones that pass started;
  // the host waits, the device does not.
  void commit_write_backs() {
    if (fine_tuner_.enabled() && engine_->writing_back()) engine_->synchronize();
  }

  // A block's outputs, bracketed in autograd when it may be differentiated later.
  torch::autograd::variable_list bracket(const std::shared_ptr<Impl>& self, int64_t block,
                                         const torch::autograd::variable_list& outputs,
                                         std::shared_ptr<Buffer> slot = nullptr) {
    check_index(block);
    if (blocks_to_swap_ == 0 && !fine_tuner_.enabled()) return outputs;
    if (outputs.empty()) { // nothing to bracket: the block ran without grad (Python's hook)
      outputs_seen_[block] = true;
      return outputs;
    }
    if (!slot) slot = engine_->device_buffer(block);
    check_no_output_views_weights(block, *slot, outputs);
    outputs_seen_[block] = true;
    if (!bracketed()) return outputs;
    return torch_frontend::exit_block(self, block, std::move(slot),
                                      detail::concat("[", label_, "] block ", block), outputs);
  }

  // The plain verb: without the outputs, a block that autograd may differentiate cannot be
  // bracketed, unless they were (bracket_outputs) or this is the recompute pass (its backward
  // follows at once).
  void submit_without_outputs(int64_t block) {
    check_index(block);
    const bool seen = outputs_seen_[block];
    outputs_seen_[block] = false;
    if (bracketed() && !seen && !engine_->recomputing(block, compute())) {
      throw Error(detail::concat(
          "[", label_, "] submit_move_blocks_forward(", block,
          ") with grad mode on: without the block's outputs blockswap cannot see its backward, "
          "and its weights could be gone by then. To train, use run_block(i, inputs, fn), or "
          "submit_move_blocks_forward(i, outputs) and go on with the tensors it returns (in "
          "Python: call the block as block(...), whose outputs the offloader sees); for "
          "inference, run under torch::NoGradGuard (torch.no_grad()), the submit too"));
    }
    engine_->leave(block, compute());
    if (block + 1 == static_cast<int64_t>(outputs_seen_.size())) commit_write_backs();
  }

  void block_backward_starts(int64_t block, const Buffer* slot) override {
    // Autograd runs backward with grad mode on only for create_graph: the graph it builds then
    // saves views of the block's weights that no node of blockswap's brackets.
    BLOCKSWAP_CHECK(!at::GradMode::is_enabled(), "[", label_, "] block ", block,
                    ": a backward with create_graph=true (double backward, e.g. a gradient "
                    "penalty) through swapped blocks is not supported: its second-order graph "
                    "would read weights that have moved. Use blocks_to_swap = 0 for it");
    // The span that ends here: the backward of the block after this one, or, before the last
    // block's backward, what ran between the forward and the backward (the loss).
    mark_compute(block + 1 < static_cast<int64_t>(outputs_seen_.size())
                     ? detail::concat("backward of block ", block + 1)
                     : std::string("after the blocks' forward"));
    engine_->acquire_for_backward(block, slot);
    if (fine_tuner_.backward_starts(block)) {
      torch_frontend::at_backward_end([weak = self_] {
        if (const auto self = weak.lock()) self->fine_tuner_.backward_done();
      });
    }
  }

  void gradient_ready(int64_t block, std::size_t param) override {
    fine_tuner_.gradient_ready(block, param);
  }

  const std::string& label() const { return label_; }
  // An output that views the block's slot would read another block once the slot is reused.
  void check_no_output_views_weights(int64_t block, const Buffer& slot,
                                     const torch::autograd::variable_list& outputs) const {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const at::Tensor& out = outputs[i];
      if (!out.defined() || !out.has_storage()) continue;
      const auto* data = static_cast<const std::byte*>(out.storage().data());
      BLOCKSWAP_CHECK(data < slot.data() || data >= slot.data() + slot.size(), "[", label_,
                      "] output ", i, " of block ", block,
                      " is a view of the block's own weights, which move to make room for other "
                      "blocks: return a copy (.clone()) instead");
    }
  }

private:
  // Backward runs inside autograd: a traced span ends at each bracket and starts at the last.
  void mark_compute(const std::string& what) {
    if (!options_.trace) return;
    const auto now = Trace::Clock::now();
    options_.trace->add(what, Track::compute, last_mark_, now);
    last_mark_ = now;
  }

  Options options_;
  std::string label_;
  // Before everything that can fail: a rank that fails tells the node's others (its destructor).
  std::unique_ptr<torch_frontend::NodeShare> share_ =
      options_.node_sharing
          ? std::make_unique<torch_frontend::NodeShare>(options_.node_sharing, label_)
          : nullptr;
  std::weak_ptr<Impl> self_;
  std::shared_ptr<Device> device_;
  c10::Device torch_device_;
  torch_frontend::FineTuner fine_tuner_;
  std::vector<TensorBlock> blocks_;
  BlockBinder binder_;
  std::optional<torch_frontend::FileWeights> file_; // Options::weights_file
  int64_t blocks_to_swap_ = 0;
  std::unique_ptr<Engine> engine_;
  // bracket_outputs saw block i's outputs since its wait: the plain submit may follow.
  std::vector<bool> outputs_seen_;
  Trace::Clock::time_point last_mark_;
};

bool cuda_available() {
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) &&
         torch_frontend::compat::torch_cuda_streams() && Device::present("cuda");
}

std::shared_ptr<Device> open_device(c10::Device device, DeviceOptions options) {
  if (device.is_cpu()) return Device::open("emulated", std::move(options));
  if (device.is_cuda()) {
    // Checked here, so that a LibTorch without what the CUDA path needs fails before any pass.
    BLOCKSWAP_CHECK(
        c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA), "device ", device.str(),
        ": this torch was built without CUDA; install a CUDA build of torch and build blockswap "
        "against it (pip install --no-build-isolation .), or use device cpu (the "
        "emulated device)");
    BLOCKSWAP_CHECK(torch_frontend::compat::torch_cuda_streams(), "device ", device.str(),
                    ": this blockswap was built against a torch without CUDA; rebuild it "
                    "against the CUDA build of torch it runs with");
    const int index =
        device.has_index() ? device.index() : torch_frontend::compat::current_cuda_device();
    if (!options.compute_stream) {
      options.compute_stream = [index] {
        return torch_frontend::compat::current_cuda_stream(index);
      };
    }
    return Device::open(detail::concat("cuda:", index), std::move(options));
  }
  throw Error(detail::concat("device ", device.str(),
                             " is not one blockswap runs on: cpu (the emulated device) or cuda"));
}

std::vector<std::size_t> packed_block_bytes(const BlockList& blocks, c10::Device device) {
  std::vector<std::size_t> bytes;
  for (const BlockLayout& layout : torch_frontend::layout_blocks(
           torch_frontend::tensor_blocks(blocks, "blocks"), "blocks", device)) {
    bytes.push_back(layout.bytes);
  }
  return bytes;
}

SwapPlan plan_block_lists(const std::vector<BlockList>& lists, std::size_t budget_bytes, Mode mode,
                          c10::Device device) {
  std::vector<std::vector<std::size_t>> bytes;
  for (const BlockList& list : lists) bytes.push_back(packed_block_bytes(list, device));
  return plan_swaps(bytes, budget_bytes, mode);
}

namespace {

// Only blockswap::Error leaves the constructor: LibTorch's own errors (a copy that fails, a
// device LibTorch lacks) are wrapped with the offloader's label.
std::shared_ptr<ModelOffloader::Impl>
make_impl(std::string block_type, std::vector<TensorBlock> blocks, const Options& options) {
  const std::string label = block_type;
  try {
    options.check(label, static_cast<int64_t>(blocks.size()));
  } catch (const Error& e) {
    // Node sharing: a rank whose options are wrong tells the node's others, as one that fails
    // later does (Note [node sharing protocol]).
    if (options.node_sharing) {
      try {
        torch_frontend::NodeShare(options.node_sharing, label).fail(e.what());
      } catch (const Error&) { // a malformed NodeSharing: the others' store timeout tells them
      }
    }
    throw;
  }
  try {
    auto impl =
        std::make_shared<ModelOffloader::Impl>(std::move(block_type), std::move(blocks), options);
    impl->start(impl);
    return impl;
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw Error(detail::concat(
        "[", label, "] ModelOffloader could not be built: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw Error(detail::concat("[", label, "] ModelOffloader could not be built: ", e.what()));
  }
}

} // namespace

ModelOffloader::ModelOffloader(std::string block_type, BlockList blocks, Options options)
    : impl_(make_impl(block_type, torch_frontend::tensor_blocks(blocks, block_type), options)) {}

ModelOffloader::ModelOffloader(std::string block_type, std::vector<TensorBlock> blocks,
                               Options options)
    : impl_(make_impl(std::move(block_type), std::move(blocks), options)) {}

ModelOffloader::ModelOffloader(std::string block_type, const torch::nn::ModuleList& blocks,
                               Options options)
    : ModelOffloader(std::move(block_type), blocks->children(), options) {}

ModelOffloader::~ModelOffloader() = default;

void ModelOffloader::prepare_block_devices_before_forward() {
  impl_->prepare();
}

void ModelOffloader::wait_for_block(int64_t block_idx) {
  impl_->wait(block_idx);
}

void ModelOffloader::submit_move_blocks_forward(int64_t block_idx) {
  impl_->submit_without_outputs(block_idx);
}

torch::autograd::variable_list
ModelOffloader::bracket_outputs(int64_t block_idx, const torch::autograd::variable_list& outputs) {
  return impl_->bracket(impl_, block_idx, outputs);
}

torch::autograd::variable_list
ModelOffloader::submit_move_blocks_forward(int64_t block_idx,
                                           const torch::autograd::variable_list& outputs) {
  return impl_->submit(impl_, block_idx, outputs);
}

void ModelOffloader::disable_block_swap() {
  impl_->engine().disable();
}
void ModelOffloader::enable_block_swap() {
  impl_->engine().enable();
}
void ModelOffloader::set_forward_only(bool forward_only) {
  impl_->engine().set_forward_only(forward_only);
}

torch::autograd::variable_list
ModelOffloader::run_block(int64_t block_idx, const torch::autograd::variable_list& inputs,
                          const BlockFn& fn) {
  return impl_->run_block(impl_, block_idx, inputs, fn);
}

bool ModelOffloader::is_resident(int64_t block_idx) const {
  return impl_->engine().is_resident(block_idx);
}

bool ModelOffloader::is_in_file(int64_t block_idx) const {
  return impl_->engine().in_file(block_idx);
}

void ModelOffloader::synchronize() {
  impl_->fine_tuner().close_failed_backward();
  impl_->engine().synchronize();
}

int64_t ModelOffloader::blocks_to_swap() const {
  return impl_->blocks_to_swap();
}

Stats ModelOffloader::stats() const {
  return impl_->engine().stats();
}

ActivationStats ModelOffloader::activation_stats() const {
  return blockswap::activation_stats(impl_->compute_device());
}

std::shared_ptr<Device> ModelOffloader::device() const {
  return impl_->device();
}

void ModelOffloader::reset_stats() {
  impl_->engine().reset_stats();
  if (impl_->offloads_activations()) reset_activation_stats(impl_->compute_device());
}

void ModelOffloader::set_learning_rate(double lr) {
  impl_->fine_tuner().set_learning_rate(lr);
}

void ModelOffloader::set_optimizer(const FusedOptimizer& optimizer) {
  impl_->fine_tuner().set_optimizer(optimizer);
}

StepOn ModelOffloader::step_on() const {
  return impl_->fine_tuner().on_host() ? StepOn::host : StepOn::device;
}

int64_t ModelOffloader::accumulated_backwards() const {
  return impl_->fine_tuner().accumulated_backwards();
}

int64_t ModelOffloader::completed_steps() const {
  return impl_->fine_tuner().completed_steps();
}

void ModelOffloader::discard_accumulated_gradients() {
  impl_->fine_tuner().discard_accumulated_gradients();
}

std::vector<std::pair<std::string, at::Tensor>>
ModelOffloader::optimizer_state(int64_t block_idx) const {
  return impl_->fine_tuner().state(block_idx);
}

std::vector<std::pair<std::string, int64_t>>
ModelOffloader::optimizer_steps(int64_t block_idx) const {
  return impl_->fine_tuner().steps(block_idx);
}

void ModelOffloader::set_optimizer_steps(int64_t block_idx, const std::string& parameter,
                                         int64_t steps) {
  impl_->fine_tuner().set_steps(block_idx, parameter, steps);
}

} // namespace blockswap
