// What a ModelOffloader does (offloader_impl.hpp): its verbs, each pass's engine calls and the
// brackets around each block. How one is built is in offloader_build.cpp.
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <utility>

#include "activation_store.hpp"
#include "block_autograd.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/log.hpp"
#include "blockswap/torch.hpp"
#include "offloader_impl.hpp"

namespace blockswap {

ModelOffloader::Impl::Impl(std::string block_type, std::vector<TensorBlock> blocks, Options options)
    : options_(std::move(options)), label_(std::move(block_type)), device_(device_for(options_)),
      torch_device_(torch_device(*device_)), fine_tuner_(options_, label_, torch_device_),
      blocks_(std::move(blocks)),
      binder_(torch_frontend::layout_blocks(blocks_, label_, torch_device_, fine_tuner_.packing()),
              label_, torch_device_, options_.strict_residency) {
  try {
    if (options_.offload_activations) torch_frontend::install_saved_tensor_hooks();
    build();
  } catch (const std::exception& e) {
    if (share_) share_->fail(e.what()); // the node's other ranks wait for nothing
    throw;
  }
}

ModelOffloader::Impl::~Impl() {
  fine_tuner_.stop(); // its worker uses the engine
  try {
    engine_->set_listener(nullptr);
    engine_->synchronize();
  } catch (const std::exception& e) {
    warn(label_, detail::concat("ModelOffloader: ", e.what()));
  }
  binder_.restore_to_host();
}

// With K = 0 and no fused step nothing moves and nothing is bracketed: a block computed again
// (non-reentrant checkpointing's recompute, which the engine sees only through backward's
// brackets) is no different from a block computed once.
Compute ModelOffloader::Impl::compute() const {
  return Compute{bracketed(), options_.reentrant_activation_checkpointing};
}

bool ModelOffloader::Impl::bracketed() const {
  return at::GradMode::is_enabled() && (blocks_to_swap_ > 0 || fine_tuner_.enabled());
}

void ModelOffloader::Impl::prepare() {
  binder_.check_still_frozen();
  binder_.check_read_only_writes();
  fine_tuner_.pass_starts();
  commit_write_backs(); // a pass that stopped before the last block left some
  engine_->prepare();
}

torch::autograd::variable_list
ModelOffloader::Impl::run_block(const std::shared_ptr<Impl>& self, int64_t block,
                                const torch::autograd::variable_list& inputs, const BlockFn& fn) {
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

std::vector<at::Tensor> ModelOffloader::Impl::block_tensors(int64_t block) const {
  std::vector<at::Tensor> tensors;
  for (const auto& [name, t] : blocks_[block].parameters) tensors.push_back(t);
  for (const auto& [name, t] : blocks_[block].buffers) tensors.push_back(t);
  return tensors;
}

Entered ModelOffloader::Impl::wait(int64_t block) {
  check_index(block);
  outputs_seen_[block] = false;
  return engine_->enter(block, compute());
}

void ModelOffloader::Impl::check_index(int64_t block) const {
  detail::check_block_index(label_, block, static_cast<int64_t>(outputs_seen_.size()));
}

torch::autograd::variable_list
ModelOffloader::Impl::submit(const std::shared_ptr<Impl>& self, int64_t block,
                             const torch::autograd::variable_list& outputs,
                             std::shared_ptr<Buffer> slot) {
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
void ModelOffloader::Impl::commit_write_backs() {
  if (fine_tuner_.enabled() && engine_->writing_back()) engine_->synchronize();
}

torch::autograd::variable_list
ModelOffloader::Impl::bracket(const std::shared_ptr<Impl>& self, int64_t block,
                              const torch::autograd::variable_list& outputs,
                              std::shared_ptr<Buffer> slot) {
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

void ModelOffloader::Impl::submit_without_outputs(int64_t block) {
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

void ModelOffloader::Impl::block_backward_starts(int64_t block, const Buffer* slot) {
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

void ModelOffloader::Impl::gradient_ready(int64_t block, std::size_t param) {
  fine_tuner_.gradient_ready(block, param);
}

void ModelOffloader::Impl::check_no_output_views_weights(
    int64_t block, const Buffer& slot, const torch::autograd::variable_list& outputs) const {
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

void ModelOffloader::Impl::mark_compute(const std::string& what) {
  if (!options_.trace) return;
  const auto now = Trace::Clock::now();
  options_.trace->add(what, Track::compute, last_mark_, now);
  last_mark_ = now;
}

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

std::vector<std::pair<at::Tensor, at::Tensor>>
ModelOffloader::frozen_values(int64_t block_idx) const {
  const c10::InferenceMode normal(false); // Note [inference mode] in block_binder.cpp
  return impl_->frozen_values(block_idx);
}

void ModelOffloader::take_changes(int64_t block_idx) {
  impl_->take_changes(block_idx);
}

void ModelOffloader::Impl::take_changes(int64_t block) {
  BLOCKSWAP_CHECK_ARGUMENT(block >= 0 && block < static_cast<int64_t>(binder_.layouts().size()),
                           "take_changes: block ", block, " out of range");
  engine_->synchronize(); // no copy reads or writes the block's host copy meanwhile
  binder_.save_caller_changes(block);
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

CompressionStats ModelOffloader::compression() const {
  CompressionStats stats = impl_->engine().compression();
  stats.reason = impl_->compression_reason();
  return stats;
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
