#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <iostream>
#include <utility>

#include "block_autograd.hpp"
#include "block_packing.hpp"
#include "blockswap/emulated.hpp"
#include "blockswap/engine.hpp"
#include "blockswap/error.hpp"
#include "blockswap/planner.hpp"
#include "blockswap/torch.hpp"
#include "cuda_stream.hpp"
#if BLOCKSWAP_HAS_CUDA
#include "blockswap/cuda.hpp"
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

// Adapters being trained stay on the compute device for good: put them there once.
void move_trainable_to(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                       c10::Device device) {
  if (device.is_cpu()) return;
  for (const auto& block : blocks) {
    for (auto& p : block->parameters()) {
      if (p.requires_grad() && p.device() != device) p.set_data(p.data().to(device));
    }
  }
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

} // namespace

class ModelOffloader::Impl final : public torch_frontend::BackwardEvents {
public:
  Impl(std::string block_type, std::vector<std::shared_ptr<torch::nn::Module>> blocks,
       Options options)
      : options_(options), device_(resolve_device(options)), blocks_(std::move(blocks)),
        binder_(torch_frontend::layout_blocks(blocks_), device_) {
    BLOCKSWAP_CHECK(!blocks_.empty(), "[", block_type, "] ModelOffloader needs at least one block");
    blocks_to_swap_ = choose_blocks_to_swap(options_, binder_.layouts());
    std::vector<std::size_t> bytes;
    for (const auto& layout : binder_.layouts()) bytes.push_back(layout.bytes);
    EngineOptions engine_options;
    engine_options.label = std::move(block_type);
    engine_options.blocks_to_swap = blocks_to_swap_;
    engine_options.supports_backward = options_.supports_backward;
    engine_options.rotating_slots = options_.rotating_slots;
    engine_options.debug = options_.debug;
    engine_options.trace = options_.trace;
    engine_options.algorithm = options_.algorithm;
    engine_ =
        std::make_unique<Engine>(make_backend(options_, device_), std::move(bytes), engine_options);
    move_trainable_to(blocks_, device_);
    if (options_.supports_backward) plan_backward(engine_->schedule());
    binder_.pack(*engine_);
    engine_->set_listener(&binder_);
  }

  ~Impl() override {
    try {
      engine_->set_listener(nullptr);
      engine_->synchronize();
    } catch (const std::exception& e) {
      std::cerr << "[" << engine_->label() << "] ModelOffloader: " << e.what() << '\n';
    }
    try {
      binder_.restore_to_host(*engine_);
    } catch (const std::exception& e) {
      std::cerr << "[" << engine_->label()
                << "] ModelOffloader could not restore weights: " << e.what() << '\n';
    }
  }

  Engine& engine() { return *engine_; }
  int64_t blocks_to_swap() const { return blocks_to_swap_; }

  bool recompute_pass() const {
    return options_.reentrant_activation_checkpointing && at::GradMode::is_enabled();
  }

  torch::autograd::variable_list run_block(const std::shared_ptr<Impl>& self, int64_t block,
                                           const torch::autograd::variable_list& inputs,
                                           const BlockFn& fn) {
    // Backward moves exist only when training with swapping on and grad mode on.
    const bool autograd = at::GradMode::is_enabled() && options_.supports_backward &&
                          !engine_->forward_only() && engine_->enabled() && blocks_to_swap_ > 0;
    if (recompute_pass()) {
      // The caller's reentrant checkpointing recomputes the block: the verbs do nothing, but
      // the backward moves must still follow its backward.
      check_ready(block);
      return autograd && hooks_[block]
                 ? torch_frontend::run_with_backward_hook(self, block, inputs, fn)
                 : fn(inputs);
    }
    engine_->wait_for_block(block);
    check_ready(block);
    const auto start = Trace::Clock::now();
    torch::autograd::variable_list outputs;
    if (autograd && recompute_[block]) {
      outputs = torch_frontend::run_with_recompute(self, block, inputs, fn);
    } else if (autograd && hooks_[block]) {
      if (evicted_[block]) forward_data_[block] = engine_->device_data(block);
      outputs = torch_frontend::run_with_backward_hook(self, block, inputs, fn);
    } else {
      outputs = fn(inputs);
    }
    if (options_.trace) {
      last_mark_ = Trace::Clock::now();
      options_.trace->add(detail::concat("forward ", block), Track::compute, start, last_mark_);
    }
    engine_->after_forward(block);
    return outputs;
  }

  void wait_for_block(int64_t block) override { engine_->wait_for_block(block); }

  // The seed's backward hook: after block b's backward, its moves; then block b-1 must be on
  // the device before its own backward starts.
  void block_backward_done(int64_t block) override {
    if (options_.trace) {
      // Backward runs inside autograd: the span ends at this hook and starts at the last mark.
      const auto now = Trace::Clock::now();
      options_.trace->add(detail::concat("backward to block ", block), Track::compute, last_mark_,
                          now);
      last_mark_ = now;
    }
    engine_->after_backward(block);
    const int64_t previous = block - 1;
    if (previous < 0 || !engine_->is_resident(previous)) return;
    engine_->wait_for_block(previous);
    // Runs before the previous block's backward starts (its outputs are this block's inputs).
    BLOCKSWAP_ASSERT(!evicted_[previous] || recompute_[previous] ||
                         forward_data_[previous] == nullptr ||
                         engine_->device_data(previous) == forward_data_[previous],
                     "block ", previous, " came back to another slot: its saved tensors would ",
                     "read other weights (Note [trap 1])");
  }

private:
  void check_ready(int64_t block) const {
    BLOCKSWAP_CHECK(engine_->is_ready(block), "[", engine_->label(), "] block ", block,
                    " is not on the device: call prepare_block_devices_before_forward() before "
                    "the pass and run blocks in order");
  }

  // Note [trap 1] (block_autograd.cpp): a block whose weights sit at another address in its
  // backward than in its forward must be recomputed. The seed's training moves give every
  // block evicted after its forward the very slot it left (block N-K+i borrows block i's slot
  // and hands it back), so its saved views read its own weights again and no recompute is
  // needed; the simulation below finds any block for which that does not hold. Blocks with
  // work after their backward (moves, or a block to wait for) get a hook.
  void plan_backward(const Schedule& training) {
    const int64_t n = training.blocks();
    recompute_.assign(n, false);
    evicted_.assign(n, false);
    hooks_.assign(n, false);
    forward_data_.assign(n, nullptr);
    std::vector<int64_t> slot = training.initial_slots(), forward_slot(n, -1);
    std::vector<bool> backward_done(n, false), reloaded(n, false);
    for (const Op& op : training.pass()) {
      if (op.kind == Op::Kind::forward) forward_slot[op.block] = slot[op.block];
      if (op.kind == Op::Kind::backward) {
        backward_done[op.block] = true;
        recompute_[op.block] = evicted_[op.block] && slot[op.block] != forward_slot[op.block];
      }
      if (op.kind != Op::Kind::move) continue;
      const Move& m = op.move;
      if (forward_slot[m.out] >= 0 && !backward_done[m.out]) evicted_[m.out] = true;
      if (backward_done[op.block]) reloaded[m.in] = true;
      slot[m.in] = std::exchange(slot[m.out], -1);
    }
    for (int64_t b = 0; b < n; ++b) {
      hooks_[b] = !training.after_backward(b).empty() || (b >= 1 && reloaded[b - 1]);
    }
  }

  Options options_;
  c10::Device device_;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks_;
  BlockBinder binder_;
  int64_t blocks_to_swap_ = 0;
  std::unique_ptr<Engine> engine_;
  std::vector<bool> recompute_; // differentiate by recomputing (Note [trap 1])
  std::vector<bool> evicted_;   // leaves the device between its forward and its backward
  std::vector<bool> hooks_;     // has work after its backward
  std::vector<const std::byte*> forward_data_; // where an evicted block's weights were
  Trace::Clock::time_point last_mark_;         // the end of the last traced compute
};

bool cuda_available() {
#if BLOCKSWAP_HAS_CUDA
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) && CudaDevice::available();
#else
  return false;
#endif
}

ModelOffloader::ModelOffloader(std::string block_type,
                               std::vector<std::shared_ptr<torch::nn::Module>> blocks,
                               Options options)
    : impl_(std::make_shared<Impl>(std::move(block_type), std::move(blocks), options)) {}

ModelOffloader::ModelOffloader(std::string block_type, const torch::nn::ModuleList& blocks,
                               Options options)
    : ModelOffloader(std::move(block_type), blocks->children(), options) {}

ModelOffloader::~ModelOffloader() = default;

void ModelOffloader::prepare_block_devices_before_forward() {
  impl_->engine().prepare();
}

void ModelOffloader::wait_for_block(int64_t block_idx) {
  if (impl_->recompute_pass()) return;
  impl_->engine().wait_for_block(block_idx);
}

void ModelOffloader::submit_move_blocks_forward(int64_t block_idx) {
  if (impl_->recompute_pass()) return;
  impl_->engine().after_forward(block_idx);
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
