// Full fine-tuning for one offloader: the fused per-parameter optimizer step during backward,
// gradient accumulation in the blocks' own memory, and when a changed block reaches host
// memory. Implementer-only (src/torch).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "block_autograd.hpp"
#include "block_binder.hpp"
#include "blockswap/core/engine.hpp"
#include "blockswap/torch/options.hpp"

namespace blockswap::torch_frontend {

class FineTuner {
public:
  // `options` were checked (Options::check). `device` is the compute device, which resolves
  // StepOn::automatic.
  FineTuner(const Options& options, std::string label, c10::Device device);
  ~FineTuner();
  FineTuner(const FineTuner&) = delete;
  FineTuner& operator=(const FineTuner&) = delete;

  bool enabled() const { return enabled_; }
  bool on_host() const { return on_host_; }
  // What the offloader packs besides frozen weights.
  PackingRules packing() const;

  // After packing: hooks on the gradient accumulator of every trainable parameter; with the
  // step on the host, its state and gradients in host memory from `host_memory` (one buffer
  // per block, at its exact size: Note [exact host memory] in src/device/host_memory.cpp) and
  // its worker thread.
  void attach(const std::shared_ptr<BackwardEvents>& events, BlockBinder& binder, Engine& engine,
              Backend& host_memory);
  // Waits for the host steps in flight and ends the worker; before the engine goes.
  void stop();

  // Block `block`'s backward starts; the first block of a backward call counts one more
  // backward toward the step (Note [accumulation] in the .cpp). Returns true when the caller
  // must arrange for backward_done() at this backward's end.
  bool backward_starts(int64_t block);
  // Post hook of a parameter's gradient accumulator (Note [fused step] in block_autograd.cpp).
  void gradient_ready(int64_t block, std::size_t param);
  // The backward has finished: after the backward that stepped, the next step starts anew;
  // what was written back reaches host memory (Note [host copy after backward] in .cpp).
  void backward_done();
  // A forward pass starts, or the caller synchronizes: a backward that failed part-way is not
  // counted, and the steps it took on the host finish (on the device blocks too).
  void close_failed_backward();
  // A forward pass starts (after close_failed_backward): with reentrant checkpointing, the
  // step of the backwards since the last pass ends here.
  void pass_starts();
  // Backwards counted toward the next step: 0 right after a step (and without accumulation).
  int64_t accumulated_backwards() const { return backwards_ >= accumulation_ ? 0 : backwards_; }
  // Steps completed so far (each ends at the n-th backward): the Python optimizers' step()
  // sees whether more than one ran since it was last called.
  int64_t completed_steps() const {
    return completed_steps_ + (backwards_ >= accumulation_ ? 1 : 0);
  }
  // torch.optim's zero_grad in the middle of an accumulation: the gradients summed so far are
  // dropped; the count of backwards goes on.
  void discard_accumulated_gradients();

  void set_learning_rate(double lr);
  void set_optimizer(const FusedOptimizer& optimizer);
  std::vector<std::pair<std::string, at::Tensor>> state(int64_t block) const;
  std::vector<std::pair<std::string, int64_t>> steps(int64_t block) const;
  void set_steps(int64_t block, const std::string& parameter, int64_t steps);

private:
  struct Param {
    int64_t steps = 0;   // steps taken
    bool summed = false; // grad_sum holds gradients of earlier backwards of this step
  };
  // The step on the host (Note [host step] in engine_training.cpp): each parameter's gradient
  // copied out, its state, and the sum of accumulating gradients, in host memory.
  struct HostParam {
    at::Tensor grad, grad_sum;
    std::vector<at::Tensor> state;
  };
  struct HostTask {
    int64_t block = 0;
    std::size_t param = 0;
    std::shared_ptr<Event> copied; // the gradient is in HostParam::grad
    at::Tensor device_grad;        // alive until then
    bool last_of_step = false;     // the last backward of a step: the parameter steps
  };
  void check_attached(int64_t block) const;
  // Puts the hook on the gradient accumulator the parameter has now, unless it is there.
  void hook(int64_t block, std::size_t param);
  // Throws Error for a trainable parameter whose gradient autograd accumulated without the
  // hook seeing it: it was not stepped.
  void check_no_gradient_missed() const;
  // The step itself: `grad` is the gradient of this backward; earlier ones are summed in
  // `sum` until the last backward of a step. `param` and `state` are where the step runs.
  void step(int64_t block, std::size_t param, at::Tensor grad, const at::Tensor& sum,
            bool last_of_step, const at::Tensor& variable, const std::vector<at::Tensor>& state);
  void host_gradient(int64_t block, std::size_t param, const at::Tensor& grad, bool last_of_step);
  void work();  // the worker thread
  void drain(); // until no host step is in flight
  // At the end of a backward (or at the next pass after one that failed): drains, reloads the
  // stepped blocks that are on the device, and throws Error for a host step that failed.
  void finish_host_steps();
  void wait_for_block(int64_t block);
  void end_step(); // after the backward(s) of a step: the count, parameters left unstepped

  bool enabled_ = false;
  bool on_host_ = false;
  FusedOptimizer optimizer_;
  int64_t accumulation_ = 1;
  double max_norm_ = 0;
  bool clip_as_python_ = false;
  std::string label_;
  BlockBinder* binder_ = nullptr;
  Engine* engine_ = nullptr;
  // The gradient accumulator of each trainable parameter that carries the hook, [block][param].
  std::vector<std::vector<compat::NodePtr>> hooked_;
  // [block][tensor]: which trainable parameter a trainable tensor of the block is.
  std::vector<std::vector<std::size_t>> param_of_;
  std::weak_ptr<BackwardEvents> events_;
  std::vector<std::vector<Param>> params_;
  int64_t backwards_ = 0;         // backward calls since the last step, the running one too
  std::vector<bool> in_backward_; // blocks the backward now running reached
  bool end_queued_ = false;
  bool per_pass_ = false;     // reentrant checkpointing: one backward per pass counts
  bool pass_counted_ = false; // this pass's backward is counted
  int64_t completed_steps_ = 0;

  std::vector<std::vector<HostParam>> host_;
  std::vector<bool> host_stepped_; // host steps changed the block in this backward
  std::vector<bool> host_saved_;   // the caller's writes to the block saved in this backward
  std::mutex mutex_;               // guards what the worker shares
  std::condition_variable changed_;
  std::deque<HostTask> tasks_;
  std::vector<int64_t> in_flight_; // host tasks per block, queued or running
  std::string host_failure_;       // the first failed host step of this backward
  bool stopping_ = false;
  std::thread worker_;
};

} // namespace blockswap::torch_frontend
