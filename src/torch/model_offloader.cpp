#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <iostream>
#include <utility>

#include "block_autograd.hpp"
#include "block_packing.hpp"
#include "blockswap/device/emulated.hpp"
#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/torch.hpp"
#include "cuda_stream.hpp"
#if BLOCKSWAP_HAS_CUDA
#include "blockswap/device/cuda.hpp"
#endif

namespace blockswap {

using torch_frontend::BlockBinder;
using torch_frontend::BlockLayout;

namespace {

// The device the options name, with its index resolved ("cuda" means the current one).
c10::Device resolve_device(const Options& options) {
  if (options.device.is_cuda() && !options.device.has_index()) {
    return c10::Device(c10::kCUDA,
                       static_cast<c10::DeviceIndex>(torch_frontend::current_cuda_device()));
  }
  return options.device;
}

std::shared_ptr<Backend> make_backend(const Options& options, c10::Device device) {
  if (device.is_cpu()) {
    EmulatedDeviceOptions emulated;
    emulated.link_gbps = options.emulated_link_gbps;
    if (options.emulated_capacity_bytes > 0)
      emulated.capacity_bytes = options.emulated_capacity_bytes;
    return std::make_shared<EmulatedDevice>(emulated);
  }
#if BLOCKSWAP_HAS_CUDA
  if (device.is_cuda()) {
    CudaDeviceOptions cuda;
    cuda.device = device.index();
    cuda.compute_stream = [index = cuda.device] {
      return torch_frontend::current_cuda_stream(index);
    };
    return std::make_shared<CudaDevice>(cuda);
  }
#endif
  throw Error(detail::concat("device ", device.str(),
                             " is not supported by this build of blockswap (",
#if BLOCKSWAP_HAS_CUDA
                             "devices: cpu = the emulated device, cuda"
#else
                             "built without CUDA; devices: cpu = the emulated device"
#endif
                             ")"));
}

// Adapters being trained and buffers stay on the compute device for good: their device copies,
// made before anything is changed (the constructor is all or nothing).
std::vector<std::pair<at::Tensor, at::Tensor>>
resident_on(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks, c10::Device device) {
  std::vector<std::pair<at::Tensor, at::Tensor>> moves;
  if (device.is_cpu()) return moves;
  for (const auto& block : blocks) {
    for (auto& p : block->parameters()) {
      if (p.requires_grad() && p.device() != device) moves.emplace_back(p, p.data().to(device));
    }
    for (auto& t : block->buffers()) {
      if (t.defined() && t.device() != device) moves.emplace_back(t, t.data().to(device));
    }
  }
  return moves;
}

int64_t choose_blocks_to_swap(const Options& options, const std::vector<BlockLayout>& layouts) {
  if (options.blocks_to_swap != -1) return options.blocks_to_swap;
  BLOCKSWAP_CHECK(options.device_budget_bytes > 0,
                  "blocks_to_swap = -1 asks the planner to choose K, which needs "
                  "device_budget_bytes > 0");
  std::vector<std::size_t> bytes;
  for (const auto& layout : layouts) bytes.push_back(layout.bytes);
  return plan_blocks_to_swap(bytes, options.device_budget_bytes,
                             options.supports_backward ? Mode::training : Mode::forward_only);
}

std::vector<BlockLayout> checked_layouts(const std::string& label,
                                         const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                                         c10::Device device) {
  BLOCKSWAP_CHECK(!blocks.empty(), "[", label, "] ModelOffloader needs at least one block");
  return torch_frontend::layout_blocks(blocks, label, device);
}

} // namespace

class ModelOffloader::Impl final : public torch_frontend::BackwardEvents {
public:
  Impl(std::string block_type, std::vector<std::shared_ptr<torch::nn::Module>> blocks,
       Options options)
      : options_(options), label_(std::move(block_type)), device_(resolve_device(options)),
        blocks_(std::move(blocks)), binder_(checked_layouts(label_, blocks_, device_), device_,
                                            options.strict_residency) {
    blocks_to_swap_ = choose_blocks_to_swap(options_, binder_.layouts());
    std::vector<std::size_t> bytes;
    for (const auto& layout : binder_.layouts()) bytes.push_back(layout.bytes);
    EngineOptions engine_options;
    engine_options.label = label_;
    engine_options.blocks_to_swap = blocks_to_swap_;
    engine_options.supports_backward = options_.supports_backward;
    engine_options.rotating_slots = options_.rotating_slots;
    engine_options.debug = options_.debug;
    engine_options.trace = options_.trace;
    engine_options.algorithm = options_.algorithm;
    engine_ =
        std::make_unique<Engine>(make_backend(options_, device_), std::move(bytes), engine_options);
    auto resident = resident_on(blocks_, device_);
    binder_.pack(*engine_); // the last step that can fail; it changes nothing when it does
    for (auto& [tensor, on_device] : resident) tensor.set_data(on_device);
    engine_->set_listener(&binder_);
    forwarded_.assign(binder_.layouts().size(), false);
  }

  ~Impl() override {
    try {
      engine_->set_listener(nullptr);
      engine_->synchronize();
    } catch (const std::exception& e) {
      std::cerr << "[" << label_ << "] ModelOffloader: " << e.what() << '\n';
    }
    binder_.restore_to_host();
  }

  Engine& engine() { return *engine_; }
  int64_t blocks_to_swap() const { return blocks_to_swap_; }

  // The recompute pass of reentrant checkpointing: grad mode on, with that option, for a block
  // that already ran forward in this pass (a block that has not is computed normally: not
  // every block need be checkpointed).
  bool recompute_pass(int64_t block) const {
    return options_.reentrant_activation_checkpointing && at::GradMode::is_enabled() &&
           forwarded_[block];
  }
  // Whether a block computed now may be differentiated later, with its weights moved by then.
  bool bracketed() const { return at::GradMode::is_enabled() && blocks_to_swap_ > 0; }

  void prepare() {
    binder_.check_still_frozen();
    engine_->prepare();
    forwarded_.assign(forwarded_.size(), false);
  }

  torch::autograd::variable_list run_block(const std::shared_ptr<Impl>& self, int64_t block,
                                           const torch::autograd::variable_list& inputs,
                                           const BlockFn& fn) {
    wait(block);
    const auto start = Trace::Clock::now();
    const auto outputs = fn(inputs);
    if (options_.trace) {
      last_mark_ = Trace::Clock::now();
      options_.trace->add(detail::concat("forward ", block), Track::compute, start, last_mark_);
    }
    return submit(self, block, outputs);
  }

  // Before a block's forward: its load waited for (or, in the recompute pass, made).
  void wait(int64_t block) {
    check_index(block);
    if (recompute_pass(block)) {
      engine_->acquire(block);
      return;
    }
    check_first_forward(block);
    engine_->wait_for_block(block);
  }

  // After a block's forward: its outputs bracketed in autograd, its moves.
  torch::autograd::variable_list submit(const std::shared_ptr<Impl>& self, int64_t block,
                                        const torch::autograd::variable_list& outputs) {
    check_index(block);
    torch::autograd::variable_list result = outputs;
    if (blocks_to_swap_ > 0) {
      std::shared_ptr<Buffer> slot = engine_->device_buffer(block);
      check_no_output_views_weights(block, *slot, outputs);
      if (bracketed()) {
        result = torch_frontend::exit_block(self, block, std::move(slot),
                                            detail::concat("[", label_, "] block ", block), outputs);
      }
    }
    if (!recompute_pass(block)) move_after_forward(block);
    return result;
  }

  void move_after_forward(int64_t block) {
    check_index(block);
    forwarded_[block] = true;
    engine_->after_forward(block);
  }

  void block_backward_starts(int64_t block, const Buffer* slot) override {
    // Autograd runs backward with grad mode on only for create_graph: the graph it builds then
    // saves views of the block's weights that no node of blockswap's brackets.
    BLOCKSWAP_CHECK(!at::GradMode::is_enabled(), "[", label_, "] block ", block,
                    ": a backward with create_graph=true (double backward, e.g. a gradient "
                    "penalty) through swapped blocks is not supported: its second-order graph "
                    "would read weights that have moved. Use blocks_to_swap = 0 for it");
    mark_compute(detail::concat("backward of block ", block + 1));
    engine_->acquire_for_backward(block, slot);
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

  void check_index(int64_t block) const {
    BLOCKSWAP_CHECK(block >= 0 && block < static_cast<int64_t>(forwarded_.size()), "[", label_,
                    "] block index ", block, " is out of range for ", forwarded_.size(),
                    " blocks");
  }

private:
  // Backward runs inside autograd: a traced span ends at each bracket and starts at the last.
  void mark_compute(const std::string& what) {
    if (!options_.trace) return;
    const auto now = Trace::Clock::now();
    options_.trace->add(what, Track::compute, last_mark_, now);
    last_mark_ = now;
  }

  // In training, a block computed twice with grad mode on between two prepares is either the
  // recompute of reentrant checkpointing without that option, or a second pass without
  // prepare: the moves would follow neither. Both are named.
  void check_first_forward(int64_t block) const {
    const bool training = options_.supports_backward && !engine_->forward_only();
    BLOCKSWAP_CHECK(!(training && at::GradMode::is_enabled() && forwarded_[block]), "[", label_,
                    "] block ", block,
                    " runs forward a second time in this pass. If this is the recompute of "
                    "reentrant activation checkpointing, set "
                    "Options::reentrant_activation_checkpointing = true; otherwise call "
                    "prepare_block_devices_before_forward() before each pass");
  }

  Options options_;
  std::string label_;
  c10::Device device_;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks_;
  BlockBinder binder_;
  int64_t blocks_to_swap_ = 0;
  std::unique_ptr<Engine> engine_;
  std::vector<bool> forwarded_; // computed since the last prepare, outside a recompute pass
  Trace::Clock::time_point last_mark_;
};

bool cuda_available() {
#if BLOCKSWAP_HAS_CUDA
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) && CudaDevice::available();
#else
  return false;
#endif
}

namespace {

// Only blockswap::Error leaves the constructor: LibTorch's own errors (a copy that fails, a
// device LibTorch lacks) are wrapped with the offloader's label.
std::shared_ptr<ModelOffloader::Impl>
make_impl(std::string block_type, std::vector<std::shared_ptr<torch::nn::Module>> blocks,
          const Options& options) {
  const std::string label = block_type;
  try {
    return std::make_shared<ModelOffloader::Impl>(std::move(block_type), std::move(blocks),
                                                  options);
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw Error(detail::concat("[", label, "] ModelOffloader could not be built: ",
                               e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw Error(detail::concat("[", label, "] ModelOffloader could not be built: ", e.what()));
  }
}

} // namespace

ModelOffloader::ModelOffloader(std::string block_type,
                               std::vector<std::shared_ptr<torch::nn::Module>> blocks,
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
  impl_->check_index(block_idx);
  if (impl_->recompute_pass(block_idx)) return;
  BLOCKSWAP_CHECK(!impl_->bracketed(), "[", impl_->label(), "] submit_move_blocks_forward(",
                  block_idx,
                  ") with grad mode on: without the block's outputs blockswap cannot see its "
                  "backward, and its weights could be gone by then. To train, use run_block(i, "
                  "inputs, fn), or submit_move_blocks_forward(i, outputs) and go on with the "
                  "tensors it returns; for inference, run under torch::NoGradGuard");
  impl_->move_after_forward(block_idx);
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

void ModelOffloader::synchronize() {
  impl_->engine().synchronize();
}

int64_t ModelOffloader::blocks_to_swap() const {
  return impl_->blocks_to_swap();
}

Stats ModelOffloader::stats() const {
  const EngineStats s = impl_->engine().stats();
  return Stats{s.h2d_bytes,     s.d2h_bytes,    s.moves,
               s.stall_seconds, s.device_bytes, s.peak_device_bytes};
}

void ModelOffloader::reset_stats() {
  impl_->engine().reset_stats();
}

} // namespace blockswap
