#include "block_autograd.hpp"

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <vector>

#include "blockswap/error.hpp"

namespace blockswap::torch_frontend {
namespace {

using torch::autograd::AutogradContext;

// The state a node carries from forward to backward, as an opaque IValue capsule.
struct NodeState : torch::CustomClassHolder {
  std::weak_ptr<BackwardEvents> events;
  int64_t block = -1;
  BlockFunction fn;             // recompute only
  std::vector<bool> needs_grad; // recompute only: which inputs required grad
};

c10::IValue capsule(c10::intrusive_ptr<NodeState> state) {
  return c10::IValue::make_capsule(std::move(state));
}

c10::intrusive_ptr<NodeState> state_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<NodeState>(ctx->saved_data["state"].toCapsule());
}

// A leaf that requires grad, passed to every node: it keeps the node in the graph even when no
// real input requires grad (the first block of LoRA training), so that its backward still runs.
at::Tensor graph_anchor(const variable_list& inputs) {
  auto options = at::TensorOptions().dtype(at::kFloat);
  if (!inputs.empty()) options = options.device(inputs.front().device());
  return at::zeros({}, options).requires_grad_(true); // ATen factories ignore requires_grad
}

bool any_requires_grad(const variable_list& inputs) {
  for (const auto& x : inputs) {
    if (x.requires_grad()) return true;
  }
  return false;
}

void check_inputs(const variable_list& inputs, int64_t block) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    BLOCKSWAP_CHECK(inputs[i].defined(), "input ", i, " of block ", block, " is undefined");
  }
}

// Identity on the block's inputs. Its backward runs after the gradients of all its outputs,
// that is of all the block's inputs, have been computed.
struct BlockEntry : torch::autograd::Function<BlockEntry> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, at::Tensor anchor,
                               c10::IValue state) {
    (void)anchor;
    ctx->saved_data["state"] = std::move(state);
    variable_list outputs;
    variable_list constant;
    const bool real_grad = any_requires_grad(variable_list(inputs.begin(), inputs.end()));
    for (const auto& x : inputs) {
      outputs.push_back(x.detach());
      // Inputs that need no gradient stay without one, unless none needs one: then they carry
      // the anchor's connection so that this node's backward runs.
      if (!at::isFloatingType(x.scalar_type()) || (real_grad && !x.requires_grad())) {
        constant.push_back(outputs.back());
      }
    }
    if (!constant.empty()) ctx->mark_non_differentiable(constant);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = state_of(ctx);
    if (auto events = state->events.lock()) events->block_backward_done(state->block);
    grads.emplace_back(); // anchor
    grads.emplace_back(); // state
    return grads;
  }
};

// Note [trap 1]
// Autograd saves views of a block's weights (e.g. the transpose used by linear). Pointing a
// parameter at other memory with set_data does not move those views, so if a block's weights
// sit in another slot in its backward than in its forward, its backward silently reads
// whatever that old slot holds by then: another block's weights (seen with LibTorch 1.13:
// gradient sum 1344 instead of -2.69; block_autograd_test reproduces it). Such a block runs
// its forward without a graph and is recomputed in backward, once it is back on the device;
// the recompute gives bitwise the same gradients on CPU. ModelOffloader decides per block
// (plan_backward): with the seed's training moves every block gets its own slot back before
// its backward, so its graph is kept and the recompute is not paid.
struct RecomputeBlock : torch::autograd::Function<RecomputeBlock> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, at::Tensor anchor,
                               c10::IValue state) {
    (void)anchor;
    const variable_list saved(inputs.begin(), inputs.end());
    ctx->save_for_backward(saved);
    const auto node = c10::static_intrusive_pointer_cast<NodeState>(state.toCapsule());
    ctx->saved_data["state"] = std::move(state);
    return node->fn(saved); // grad mode is off inside a Function's forward
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = state_of(ctx);
    const auto events = state->events.lock();
    BLOCKSWAP_CHECK(events != nullptr, "block ", state->block,
                    " cannot be recomputed in backward: its ModelOffloader was destroyed");
    events->wait_for_block(state->block);

    const variable_list saved = ctx->get_saved_variables();
    variable_list inputs;
    for (std::size_t i = 0; i < saved.size(); ++i) {
      inputs.push_back(saved[i].detach());
      if (state->needs_grad[i]) inputs.back().requires_grad_(true);
    }
    variable_list outputs;
    {
      at::AutoGradMode enable(true);
      outputs = state->fn(inputs);
    }
    variable_list roots, root_grads;
    for (std::size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);

    variable_list input_grads;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      input_grads.push_back(state->needs_grad[i] ? inputs[i].grad() : at::Tensor());
    }
    events->block_backward_done(state->block);
    input_grads.emplace_back(); // anchor
    input_grads.emplace_back(); // state
    return input_grads;
  }
};

} // namespace

variable_list run_with_backward_hook(const std::shared_ptr<BackwardEvents>& events, int64_t block,
                                     const variable_list& inputs, const BlockFunction& fn) {
  check_inputs(inputs, block);
  auto state = c10::make_intrusive<NodeState>();
  state->events = events;
  state->block = block;
  const variable_list entered =
      BlockEntry::apply(at::TensorList(inputs), graph_anchor(inputs), capsule(std::move(state)));
  return fn(entered);
}

variable_list run_with_recompute(const std::shared_ptr<BackwardEvents>& events, int64_t block,
                                 const variable_list& inputs, BlockFunction fn) {
  check_inputs(inputs, block);
  auto state = c10::make_intrusive<NodeState>();
  state->events = events;
  state->block = block;
  state->fn = std::move(fn);
  for (const auto& x : inputs) state->needs_grad.push_back(x.requires_grad());
  return RecomputeBlock::apply(at::TensorList(inputs), graph_anchor(inputs),
                               capsule(std::move(state)));
}

} // namespace blockswap::torch_frontend
