// Autograd wiring for training with swapped blocks. Implementer-only (src/torch).
//
// C++ modules have no backward hooks, so the seed's per-block backward hook is an autograd
// node placed on the block's inputs: it runs once the gradients of all the block's inputs
// exist, i.e. right after the block's backward.
#pragma once

#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace blockswap::torch_frontend {

using variable_list = torch::autograd::variable_list;
using BlockFunction = std::function<variable_list(const variable_list&)>;

// What the autograd nodes call back. Held weakly: a node whose offloader is gone does nothing
// (BlockEntry) or fails with a clear error (recompute).
class BackwardEvents {
public:
  virtual ~BackwardEvents() = default;
  // Block `block` is needed on the device now (its recompute is about to run).
  virtual void wait_for_block(int64_t block) = 0;
  // Block `block`'s backward is complete: the seed's backward hook.
  virtual void block_backward_done(int64_t block) = 0;
};

// fn(inputs), with `events.block_backward_done(block)` fired after the block's backward.
variable_list run_with_backward_hook(const std::shared_ptr<BackwardEvents>& events, int64_t block,
                                     const variable_list& inputs, const BlockFunction& fn);

// fn(inputs) without keeping its graph; in backward the block is waited for, recomputed with
// grad mode on and differentiated, then block_backward_done fires. Note [trap 1] in the .cpp.
variable_list run_with_recompute(const std::shared_ptr<BackwardEvents>& events, int64_t block,
                                 const variable_list& inputs, BlockFunction fn);

} // namespace blockswap::torch_frontend
