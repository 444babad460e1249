#include "fine_tune.hpp"

#include "fused_optimizers.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/function.h> // Node, complete: hooked accumulators are replaced here
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "blockswap/core/error.hpp"

namespace blockswap::torch_frontend {

FineTuner::FineTuner(const Options& options, std::string label, c10::Device device)
    : enabled_(!std::holds_alternative<std::monostate>(options.optimizer)),
      optimizer_(options.optimizer), accumulation_(options.gradient_accumulation_steps),
      max_norm_(options.max_grad_norm_per_parameter), clip_as_python_(options.clip_as_python),
      label_(std::move(label)) {
  // automatic: the faster one measured (docs/performance.md, "Full fine-tuning"): on the
  // emulated device the host, whose step runs beside the compute thread; on a GPU the device,
  // whose step runs at the device's memory bandwidth instead of the CPU's.
  const StepOn where = options.step_on != StepOn::automatic ? options.step_on
                       : device.is_cpu()                    ? StepOn::host
                                                            : StepOn::device;
  on_host_ = enabled_ && where == StepOn::host;
  per_pass_ = options.reentrant_activation_checkpointing;
}

PackingRules FineTuner::packing() const {
  if (!enabled_) return {};
  if (on_host_) return PackingRules{true, {}, false}; // the state stays in host memory
  return PackingRules{true, state_names(optimizer_), accumulation_ > 1};
}

FineTuner::~FineTuner() {
  stop();
}

namespace {

// Tensors of the given sizes and dtypes, zeros, in one host buffer from `backend`: each tensor
// keeps the buffer alive (optimizer_state() hands them to the caller).
class HostTensors {
public:
  HostTensors(Backend& backend, const std::vector<const PackedTensor*>& tensors) {
    std::size_t bytes = 0;
    for (const PackedTensor* t : tensors) bytes = align(bytes) + nbytes(*t);
    memory_ = std::make_shared<Buffer>(backend.allocate_host(bytes));
    std::memset(memory_->data(), 0, bytes);
  }
  at::Tensor next(const PackedTensor& t) {
    offset_ = align(offset_);
    std::byte* data = memory_->data() + offset_;
    offset_ += nbytes(t);
    return at::from_blob(
        data, t.sizes, [memory = memory_](void*) {}, at::TensorOptions().dtype(t.dtype));
  }

private:
  static std::size_t align(std::size_t bytes) { return (bytes + 63) / 64 * 64; }
  static std::size_t nbytes(const PackedTensor& t) {
    return static_cast<std::size_t>(c10::multiply_integers(t.sizes)) * c10::elementSize(t.dtype);
  }
  std::shared_ptr<Buffer> memory_;
  std::size_t offset_ = 0;
};

} // namespace

void FineTuner::attach(const std::shared_ptr<BackwardEvents>& events, BlockBinder& binder,
                       Engine& engine, Backend& host_memory) {
  binder_ = &binder;
  engine_ = &engine;
  const auto& layouts = binder.layouts();
  params_.assign(layouts.size(), {});
  in_backward_.assign(layouts.size(), false);
  if (!enabled_) return;
  events_ = events;
  hooked_.assign(layouts.size(), {});
  param_of_.assign(layouts.size(), {});
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    params_[b].resize(layouts[b].trainable.size());
    hooked_[b].resize(layouts[b].trainable.size());
    param_of_[b].assign(layouts[b].tensors.size(), 0);
    for (std::size_t p = 0; p < layouts[b].trainable.size(); ++p) {
      param_of_[b][layouts[b].trainable[p].tensor] = p;
      hook(static_cast<int64_t>(b), p);
    }
  }
  binder.rebound_hook = [this](int64_t block, std::size_t tensor) {
    hook(block, param_of_[block][tensor]);
  };
  if (!on_host_) return;
  const auto names = state_names(optimizer_);
  host_.resize(layouts.size());
  host_stepped_.assign(layouts.size(), false);
  host_saved_.assign(layouts.size(), false);
  in_flight_.assign(layouts.size(), 0);
  const std::size_t per_param = 1 + (accumulation_ > 1 ? 1 : 0) + names.size();
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    std::vector<const PackedTensor*> tensors;
    for (const TrainableParam& param : layouts[b].trainable)
      tensors.insert(tensors.end(), per_param, &layouts[b].tensors[param.tensor]);
    if (tensors.empty()) continue;
    HostTensors memory(host_memory, tensors);
    for (const TrainableParam& param : layouts[b].trainable) {
      const PackedTensor& t = layouts[b].tensors[param.tensor];
      HostParam host{memory.next(t), at::Tensor(), {}};
      if (accumulation_ > 1) host.grad_sum = memory.next(t);
      for (std::size_t i = 0; i < names.size(); ++i) host.state.push_back(memory.next(t));
      host_[b].push_back(std::move(host));
    }
  }
  binder.before_load_hook = [this](int64_t block) { wait_for_block(block); };
  worker_ = std::thread([this] { work(); });
}

// Note [device change] in block_binder.cpp: a parameter that moves between the host and the
// device gets a new gradient accumulator, so the hook goes on whichever one the parameter has
// now (the graph of a forward keeps the one it used, hooked when the parameter was bound).
void FineTuner::hook(int64_t block, std::size_t param) {
  const auto events = events_.lock();
  if (!events) return;
  const PackedTensor& t = binder_->tensor(block, binder_->layouts()[block].trainable[param].tensor);
  compat::NodePtr accumulator = compat::grad_accumulator(t.variable);
  if (accumulator == hooked_[block][param]) return;
  hooked_[block][param] = on_gradient(t.variable, events, block, param);
}

void FineTuner::stop() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
  if (binder_ != nullptr) binder_->before_load_hook = nullptr;
}

// Note [accumulation]
// torch.optim with accumulation steps every parameter that has a .grad when the trainer calls
// step() after its n-th micro-batch, whichever micro-batches reached it. So the fused step
// counts backward calls, not backwards per block: every parameter steps in the n-th backward,
// with the gradients of the backwards before summed in (grad_sum). What the fused step cannot
// do raises instead of stepping at another time: a parameter with summed gradients that the
// n-th backward does not reach (backward_done), and a trainer whose step() comes after fewer
// backwards (a micro-batch without backward: the Python optimizers' step() checks
// accumulated_backwards()).
bool FineTuner::backward_starts(int64_t block) {
  if (!enabled_) return false;
  in_backward_[block] = true;
  if (end_queued_) return false;
  end_queued_ = true;
  if (!per_pass_ || !pass_counted_) ++backwards_;
  pass_counted_ = true;
  return true;
}

void FineTuner::gradient_ready(int64_t block, std::size_t param) {
  const TrainableParam& where = binder_->layouts()[block].trainable[param];
  const PackedTensor& t = binder_->tensor(block, where.tensor);
  at::Tensor variable = t.variable;
  const at::Tensor grad = variable.grad();
  if (!grad.defined()) return;
  // The gradient lives in the step, or in the block's memory while it accumulates: never in
  // .grad, which would keep a device copy of every parameter's gradient.
  variable.mutable_grad().reset();
  BLOCKSWAP_CHECK(in_backward_[block], "[", label_, "] parameter '", t.name, "' of block ", block,
                  " got a gradient outside its block's backward (used outside the block, or "
                  "backward called on a tensor computed from it directly): a parameter that "
                  "trains with its block may be used only inside the block");
  const bool last_of_step = backwards_ >= accumulation_;
  if (on_host_) {
    host_gradient(block, param, grad, last_of_step);
    return;
  }
  BLOCKSWAP_CHECK(engine_->is_ready(block) &&
                      variable.data_ptr() == binder_->bound_data(block, where.tensor),
                  "[", label_, "] parameter '", t.name, "' of block ", block,
                  " got its gradient after the block left the device, so it cannot be stepped");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> state;
  for (std::size_t s : where.state) state.push_back(binder_->tensor(block, s).variable.detach());
  const at::Tensor sum =
      accumulation_ > 1 ? binder_->tensor(block, where.grad_sum).variable.detach() : at::Tensor();
  step(block, param, grad, sum, last_of_step, variable.detach(), state);
  if (accumulation_ > 1) binder_->written_by_blockswap(block, where.grad_sum);
  binder_->written_by_blockswap(block, where.tensor);
  for (std::size_t s : where.state) binder_->written_by_blockswap(block, s);
  engine_->mark_dirty(block);
}

void FineTuner::step(int64_t block, std::size_t param, at::Tensor grad, const at::Tensor& sum,
                     bool last_of_step, const at::Tensor& variable,
                     const std::vector<at::Tensor>& state) {
  Param& p = params_[block][param];
  if (!last_of_step) {
    if (p.summed) {
      sum.add_(grad);
    } else {
      sum.copy_(grad);
    }
    p.summed = true;
    return;
  }
  if (p.summed) {
    // LibTorch sums into .grad in place: the earlier backwards' sum, plus this one.
    sum.add_(grad);
    grad = sum;
    p.summed = false;
  }
  if (max_norm_ > 0) clip_gradient(grad, max_norm_, clip_as_python_);
  const auto& layout = binder_->layouts()[block];
  step_parameter(optimizer_,
                 ParamStep{layout.trainable_name(param), block, variable, grad, state, ++p.steps});
}

// Note [host step] in engine_training.cpp: the gradient goes out on the copy stream; the worker
// waits for it and steps the host copy; loads of the block wait for the worker (before_load).
void FineTuner::host_gradient(int64_t block, std::size_t param, const at::Tensor& grad,
                              bool last_of_step) {
  // The step changes the host copy: what the caller wrote into the block's tensors on the
  // device since they were bound (weights loaded after an evaluation pass) goes there first.
  if (!host_saved_[block]) {
    host_saved_[block] = true;
    binder_->save_caller_changes(block);
  }
  HostParam& host = host_[block][param];
  const at::Tensor out = grad.contiguous();
  HostTask task{block, param,
                engine_->copy_out(static_cast<std::byte*>(host.grad.data_ptr()),
                                  static_cast<const std::byte*>(out.data_ptr()),
                                  out.numel() * out.element_size(), block),
                out, last_of_step};
  {
    std::lock_guard lock(mutex_);
    tasks_.push_back(std::move(task));
    ++in_flight_[block];
    if (last_of_step) host_stepped_[block] = true;
  }
  changed_.notify_all();
}

void FineTuner::work() {
  const at::NoGradGuard no_grad; // this thread's own grad mode
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return; // stopping, nothing left
    HostTask task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    std::string failure;
    try {
      engine_->wait(*task.copied);
      task.device_grad = at::Tensor();
      const HostParam& host = host_[task.block][task.param];
      const TrainableParam& where = binder_->layouts()[task.block].trainable[task.param];
      step(task.block, task.param, host.grad, host.grad_sum, task.last_of_step,
           binder_->host_copy(task.block, where.tensor), host.state);
    } catch (const std::exception& e) {
      const auto& layout = binder_->layouts()[task.block];
      failure = detail::concat("parameter '", layout.trainable_name(task.param), "' of block ",
                               task.block, ": ", e.what());
    }
    task.device_grad = at::Tensor();
    lock.lock();
    if (!failure.empty() && host_failure_.empty()) host_failure_ = failure;
    --in_flight_[task.block];
    changed_.notify_all();
  }
}

void FineTuner::drain() {
  if (!on_host_) return;
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return tasks_.empty() &&
           std::all_of(in_flight_.begin(), in_flight_.end(), [](int64_t n) { return n == 0; });
  });
}

void FineTuner::wait_for_block(int64_t block) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return in_flight_[block] == 0; });
}

// Note [host copy after backward]
// A block changed on the device is written back when it leaves; the host copy takes the new
// bytes when the engine synchronizes (Note [atomic write-back] in host_store.cpp). Synchronizing at
// the end of every backward that stepped means that between backwards (where a trainer saves
// checkpoints, reads weights, or a write fails) every host copy is the latest, and no write-back
// is pending while the next forward moves blocks. The copies it waits for are those the
// backward's last blocks started, which the next forward needs first anyway.
void FineTuner::finish_host_steps() {
  if (!on_host_) return;
  drain();
  std::string failure;
  {
    std::lock_guard lock(mutex_);
    failure.swap(host_failure_);
  }
  // The blocks stepped on the host that are still on the device get their new weights; a
  // backward through a graph that saved the old ones raises, as after torch.optim's step.
  std::fill(host_saved_.begin(), host_saved_.end(), false);
  for (std::size_t b = 0; b < host_stepped_.size(); ++b) {
    if (!host_stepped_[b]) continue;
    host_stepped_[b] = false;
    binder_->save_caller_changes(static_cast<int64_t>(b)); // written after the backward: kept
    for (const TrainableParam& param : binder_->layouts()[b].trainable) {
      torch::autograd::impl::bump_version(
          binder_->tensor(static_cast<int64_t>(b), param.tensor).variable);
      binder_->written_by_blockswap(static_cast<int64_t>(b), param.tensor);
    }
    engine_->reload_trainable(static_cast<int64_t>(b));
  }
  BLOCKSWAP_CHECK(failure.empty(), "[", label_, "] the step on the host failed for ", failure,
                  "; that parameter keeps its value from before this step");
}

void FineTuner::backward_done() {
  end_queued_ = false;
  finish_host_steps();
  engine_->synchronize();
  engine_->write_back_early(); // Note [write-back before the forward] in engine_training.cpp
  // Reentrant checkpointing runs a backward per checkpoint inside the outer one: the step is
  // over when the next pass starts.
  if (!per_pass_) end_step();
  check_no_gradient_missed();
}

// The hook takes every gradient out of .grad (gradient_ready): one left there at the end of a
// backward went to an accumulator without the hook, and its parameter did not step. Raising is
// the only honest answer; the gradient is dropped so that the next backward does not add to it.
void FineTuner::check_no_gradient_missed() const {
  for (std::size_t b = 0; b < params_.size(); ++b) {
    for (const TrainableParam& where : binder_->layouts()[b].trainable) {
      at::Tensor variable = binder_->tensor(static_cast<int64_t>(b), where.tensor).variable;
      if (!variable.grad().defined()) continue;
      variable.mutable_grad().reset();
      throw Error(detail::concat(
          "[", label_, "] parameter '", binder_->tensor(static_cast<int64_t>(b), where.tensor).name,
          "' of block ", b,
          " got a gradient that the fused step did not see, so it did not "
          "step: its gradient accumulator was replaced behind blockswap (the parameter moved "
          "with .data = or set_data, or to another device); move a model's parameters before "
          "building its ModelOffloader"));
    }
  }
}

void FineTuner::end_step() {
  std::fill(in_backward_.begin(), in_backward_.end(), false);
  std::string partial;
  const bool stepped = backwards_ >= accumulation_;
  if (stepped) {
    backwards_ = 0;
    ++completed_steps_;
  }
  for (std::size_t b = 0; stepped && b < params_.size(); ++b) {
    for (std::size_t p = 0; p < params_[b].size(); ++p) {
      if (!params_[b][p].summed) continue;
      params_[b][p].summed = false; // the next step starts anew
      const auto& layout = binder_->layouts()[b];
      partial += detail::concat(partial.empty() ? "" : ", ", "'", layout.trainable_name(p),
                                "' of block ", b);
    }
  }
  BLOCKSWAP_CHECK(partial.empty(), "[", label_, "] parameter(s) ", partial,
                  " got gradients in earlier accumulating backwards but none in the last one "
                  "(backward ",
                  accumulation_, " of gradient_accumulation_steps=", accumulation_,
                  "), where the fused step runs: they were not "
                  "stepped and their summed gradients are dropped. Reach every parameter that "
                  "trains in the last backward of each step, or accumulate over one backward");
}

void FineTuner::pass_starts() {
  close_failed_backward();
  if (per_pass_ && pass_counted_) {
    pass_counted_ = false;
    end_step();
  }
}

void FineTuner::close_failed_backward() {
  if (!end_queued_) return;
  end_queued_ = false; // the backward failed before its end: it does not count
  if (!per_pass_ || pass_counted_) --backwards_;
  pass_counted_ = false;
  std::fill(in_backward_.begin(), in_backward_.end(), false);
  // The steps it took stand (as those on the device do): those on the host finish, and the
  // blocks they changed that are on the device take the new weights.
  finish_host_steps();
}

void FineTuner::discard_accumulated_gradients() {
  drain();
  for (auto& block : params_) {
    for (Param& p : block) p.summed = false; // the next backward's gradient replaces the sum
  }
}

void FineTuner::set_learning_rate(double lr) {
  BLOCKSWAP_CHECK(enabled_, "[", label_,
                  "] set_learning_rate: this offloader has no optimizer "
                  "(Options::optimizer)");
  BLOCKSWAP_CHECK(std::isfinite(lr) && lr >= 0, "[", label_, "] learning rate ", lr,
                  " must be finite and >= 0");
  drain(); // steps on the host still in flight (a backward that failed) read the optimizer
  torch_frontend::set_learning_rate(label_, optimizer_, lr);
}

void FineTuner::set_optimizer(const FusedOptimizer& optimizer) {
  BLOCKSWAP_CHECK(enabled_, "[", label_,
                  "] set_optimizer: this offloader has no optimizer "
                  "(Options::optimizer); it is chosen when the offloader is built");
  check_optimizer(label_, optimizer);
  BLOCKSWAP_CHECK(optimizer.index() == optimizer_.index() &&
                      state_names(optimizer) == state_names(optimizer_),
                  "[", label_,
                  "] set_optimizer: the new optimizer must be the same kind as the "
                  "offloader's, with the same state (",
                  state_names(optimizer_).size(),
                  " tensor(s) per parameter; SGD's momentum cannot start or stop being 0)");
  drain();
  optimizer_ = optimizer;
}

void FineTuner::check_attached(int64_t block) const {
  detail::check_block_index(label_, block, static_cast<int64_t>(params_.size()));
}

std::vector<std::pair<std::string, at::Tensor>> FineTuner::state(int64_t block) const {
  check_attached(block);
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (on_host_) {
    const auto& layout = binder_->layouts()[block];
    const auto names = state_names(optimizer_);
    for (std::size_t p = 0; p < host_[block].size(); ++p) {
      const std::string& name = layout.trainable_name(p);
      for (std::size_t i = 0; i < names.size(); ++i) {
        out.emplace_back(name + "." + names[i], host_[block][p].state[i]);
      }
      if (accumulation_ > 1) out.emplace_back(name + ".grad_sum", host_[block][p].grad_sum);
    }
    return out;
  }
  for (const PackedTensor& t : binder_->layouts()[block].tensors) {
    if (t.role == Role::state) out.emplace_back(t.name, t.variable);
  }
  return out;
}

std::vector<std::pair<std::string, int64_t>> FineTuner::steps(int64_t block) const {
  check_attached(block);
  std::vector<std::pair<std::string, int64_t>> out;
  const auto& layout = binder_->layouts()[block];
  for (std::size_t p = 0; p < params_[block].size(); ++p) {
    out.emplace_back(layout.trainable_name(p), params_[block][p].steps);
  }
  return out;
}

void FineTuner::set_steps(int64_t block, const std::string& parameter, int64_t steps) {
  check_attached(block);
  BLOCKSWAP_CHECK(steps >= 0, "[", label_, "] a step count cannot be negative (", steps, ")");
  drain();
  const auto& layout = binder_->layouts()[block];
  for (std::size_t p = 0; p < params_[block].size(); ++p) {
    if (layout.trainable_name(p) != parameter) continue;
    params_[block][p].steps = steps;
    return;
  }
  throw Error(detail::concat("[", label_, "] block ", block, " has no trainable parameter '",
                             parameter, "'"));
}

} // namespace blockswap::torch_frontend
