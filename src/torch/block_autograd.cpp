#include "block_autograd.hpp"

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include <vector>

#include "blockswap/core/error.hpp"

namespace blockswap::torch_frontend {
namespace {

using torch::autograd::AutogradContext;

// Note [trap 1]
// Autograd saves views of a block's weights (e.g. the transpose used by linear). Pointing a
// parameter at other memory with set_data does not move those views, so when a block's slot
// holds another block by the time its backward runs, the backward silently reads that other
// block's weights (seen with LibTorch 1.13: gradient sum 1344 instead of -2.69;
// block_autograd_test reproduces it). Hence the node on a block's outputs: its backward runs
// before the block's own and makes the engine put the block back into the slot its views
// point to (Note [exact backward] in engine_training.cpp). Recomputing the block would work too, at
// the price of a second forward; bringing the weights back costs at most one load, and none in the
// schedule's own order.

// The state the node carries from forward to backward, as an opaque IValue capsule.
struct NodeState : torch::CustomClassHolder {
  std::weak_ptr<BackwardEvents> events;
  int64_t block = -1;
  std::shared_ptr<Buffer> slot;
  std::string what;
};

bool any_requires_grad(const variable_list& tensors) {
  for (const auto& x : tensors) {
    if (x.defined() && x.requires_grad()) return true;
  }
  return false;
}

// Identity on the block's defined outputs.
struct BlockExit : torch::autograd::Function<BlockExit> {
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors, c10::IValue state) {
    ctx->saved_data["state"] = std::move(state);
    // An output the loss never uses gets no gradient, not zeros (DESIGN.md trap 11): zeros
    // would flow on into what made it, and a parameter that feeds only that output would have
    // .grad = 0 where the model without blockswap leaves None (weight decay then moves it).
    ctx->set_materialize_grads(false);
    variable_list outputs, constant;
    for (const auto& x : tensors) {
      outputs.push_back(x.detach());
      if (!at::isFloatingType(x.scalar_type()) || !x.requires_grad()) {
        constant.push_back(outputs.back());
      }
    }
    if (!constant.empty()) ctx->mark_non_differentiable(constant);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state =
        c10::static_intrusive_pointer_cast<NodeState>(ctx->saved_data["state"].toCapsule());
    const auto events = state->events.lock();
    BLOCKSWAP_CHECK(events != nullptr, state->what,
                    "'s backward runs after its ModelOffloader was destroyed or closed "
                    "(close(), or in Python a new ModelOffloader built over its blocks, which "
                    "takes them over): keep the offloader until backward() has run");
    events->block_backward_starts(state->block, state->slot.get());
    grads.emplace_back(); // state; an undefined gradient stays undefined (no gradient)
    return grads;
  }
};

// Note [fused step]
// The fused step needs each trainable parameter's gradient once autograd has summed every
// contribution to it in this backward: the post hook of its gradient accumulator runs right
// after the accumulation, which is after every node that feeds it and, as the accumulator
// outranks other nodes in autograd's ready queue, before the next block's backward can start
// and evict this block. (ModelOffloader still checks that the block is there.)
struct GradientReady : torch::autograd::FunctionPostHook {
  std::weak_ptr<BackwardEvents> events;
  int64_t block = 0;
  std::size_t param = 0;

  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    if (const auto alive = events.lock()) alive->gradient_ready(block, param);
    return outputs;
  }
};

} // namespace

compat::NodePtr on_gradient(const at::Tensor& parameter,
                            const std::shared_ptr<BackwardEvents>& events, int64_t block,
                            std::size_t param) {
  compat::NodePtr accumulator = compat::grad_accumulator(parameter);
  BLOCKSWAP_ASSERT(accumulator != nullptr, "a trainable parameter without a gradient accumulator");
  auto hook = std::make_unique<GradientReady>();
  hook->events = events;
  hook->block = block;
  hook->param = param;
  accumulator->add_post_hook(std::move(hook));
  return accumulator;
}

void at_backward_end(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

variable_list exit_block(const std::shared_ptr<BackwardEvents>& events, int64_t block,
                         std::shared_ptr<Buffer> slot, std::string what,
                         const variable_list& outputs) {
  if (!any_requires_grad(outputs)) return outputs; // no backward will run through the block
  auto state = c10::make_intrusive<NodeState>();
  state->events = events;
  state->block = block;
  state->slot = std::move(slot);
  state->what = std::move(what);
  variable_list defined;
  for (const auto& x : outputs) {
    if (x.defined()) defined.push_back(x);
  }
  const variable_list passed =
      BlockExit::apply(at::TensorList(defined), c10::IValue::make_capsule(std::move(state)));
  variable_list out;
  std::size_t next = 0;
  for (const auto& x : outputs) out.push_back(x.defined() ? passed[next++] : x);
  return out;
}

} // namespace blockswap::torch_frontend
