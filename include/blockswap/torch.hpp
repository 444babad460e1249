// blockswap's LibTorch front end: the seed's ModelOffloader for torch::nn::Module blocks.
//
//   #include <blockswap/torch.hpp>
//
//   std::vector<std::shared_ptr<torch::nn::Module>> blocks = ...;  // frozen base + LoRA
//   blockswap::Options options;
//   options.blocks_to_swap = 6;
//   options.supports_backward = true;
//   blockswap::ModelOffloader offloader("blocks", blocks, options);
//
//   for (int step = 0; step < steps; ++step) {
//     offloader.prepare_block_devices_before_forward();
//     torch::Tensor h = x;
//     for (int64_t i = 0; i < (int64_t)blocks.size(); ++i) {
//       h = offloader.run_block(i, {h}, [&, i](const torch::autograd::variable_list& in) {
//         return torch::autograd::variable_list{blocks[i]->as<Block>()->forward(in[0])};
//       })[0];
//     }
//     loss(h).backward();  // blocks move back in during backward, as the seed's hooks do
//     optimizer.step();
//   }
//
// Each block's frozen parameters and buffers are packed into one aligned host buffer (pinned
// on a GPU). While a block is on the device its tensors are views of its device slot; while it
// is not, they are views of its host copy, so reading them (sum(), torch::save) gives their
// true values, and on a GPU computing with them fails on the device check. Parameters that
// require grad (adapters being trained) are never packed and never move unless
// Options::optimizer is set (full fine-tuning, below); buffers (running statistics) never are.
// Weights the caller changes through the tensor (copy_, torch::load) are written back to the host
// copy, never dropped; writes through .data() or data_ptr() are not seen.
//
// Training is exact in any order: before a block's backward runs, its weights are put back
// where its forward's saved tensors point (loading them if another block took the slot). With
// grad mode on, the plain submit_move_blocks_forward(i) cannot see backward and raises; use
// run_block, or the overload that takes and returns the block's outputs. docs/guide.md lists
// which call patterns are exact and which raise.
#pragma once

// LibTorch's nn headers: what the example above uses (torch::nn::Module, ->as<Block>(),
// torch::autograd::variable_list), and what a source that includes this header has always had.
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

// The front end itself, in three parts that need only c10 and at::Tensor: a source that only
// names their types can include the part it uses instead of this header, and compiles faster.
#include "blockswap/torch/activation_scope.hpp" // ActivationScope, ActivationStats
#include "blockswap/torch/offloader.hpp"        // ModelOffloader, BlockList, plan_block_lists
#include "blockswap/torch/options.hpp"          // Options, FusedSGD, FusedAdamW, open_device
