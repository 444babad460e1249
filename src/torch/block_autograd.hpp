// Autograd wiring for training with swapped blocks. Implementer-only (src/torch).
//
// C++ modules have no backward hooks, so a block's outputs pass through an identity autograd
// node whose backward runs just before the block's own backward: the block is brought back to
// where autograd's saved views of its weights point. Nothing is attached to the block's inputs:
// an identity there would regroup the sums of gradients that autograd accumulates (a tensor
// used inside and outside the block), and the gradients would no longer be bitwise those of
// the model run without blockswap. Note [trap 1] in the .cpp says why the node exists.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/backend.hpp"
#include "torch_compat.hpp"

namespace blockswap::torch_frontend {

using variable_list = std::vector<at::Tensor>; // torch::autograd::variable_list

// What the autograd node calls back, from autograd's thread. Held weakly: once the offloader
// is gone, a backward that would need it raises instead of reading stale memory.
class BackwardEvents {
public:
  virtual ~BackwardEvents() = default;
  // Block `block`'s backward is about to run; autograd's views of its weights point into
  // `slot`, the memory its forward ran in.
  virtual void block_backward_starts(int64_t block, const Buffer* slot) = 0;
  // Full fine-tuning: trainable parameter `param` of block `block` has its gradient of this
  // backward in .grad (autograd has just accumulated it).
  virtual void gradient_ready(int64_t block, std::size_t param) = 0;
};

// Calls events->gradient_ready(block, param) each time autograd has accumulated a gradient into
// `parameter` (a leaf that requires grad). Returns the parameter's gradient accumulator, which
// carries the hook: keep it, or autograd may make a new one without it.
compat::NodePtr on_gradient(const at::Tensor& parameter,
                            const std::shared_ptr<BackwardEvents>& events, int64_t block,
                            std::size_t param);

// Runs `callback` once the backward now running (called from inside it) has finished.
void at_backward_end(std::function<void()> callback);

// The block's outputs, passed through an identity whose backward fires block_backward_starts
// before any of the block's own backward runs; undefined outputs stay undefined, outputs that
// need no gradient get none, and when none needs one the outputs are returned as they are. The
// node shares `slot`, so the memory outlives the offloader as long as the graph does (Note
// [slot lifetime] in engine.cpp). `what` names the block in the error raised when the
// offloader is gone by then ("[blocks] block 3").
variable_list exit_block(const std::shared_ptr<BackwardEvents>& events, int64_t block,
                         std::shared_ptr<Buffer> slot, std::string what,
                         const variable_list& outputs);

} // namespace blockswap::torch_frontend
