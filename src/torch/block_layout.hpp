// What a block's packable tensors are and where their bytes go in the block's packed memory:
// the layout of the host copy and of a device slot, and the one function that makes a tensor
// of packed bytes again. A new kind of weight (float8 with scales, a quantized subclass) is
// described here. Implementer-only (src/torch).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/backend.hpp"
#include "blockswap/core/codec.hpp"
#include "blockswap/torch/offloader.hpp"

namespace blockswap::torch_frontend {

// What a packed tensor is to the block: a frozen weight (never written back), a parameter that
// trains (full fine-tuning), or the optimizer's state for one (its momentum, its moments, the
// sum of its gradients while they accumulate), which blockswap itself made.
enum class Role { frozen, trainable, state };

// Where one tensor of a block lives inside the block's packed bytes.
struct PackedTensor {
  std::string name;
  Role role = Role::frozen;
  at::Tensor variable; // the module's own parameter or buffer: rebound with set_data
  std::size_t offset = 0;
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Float;
  uint64_t file_offset = 0; // a frozen tensor's first byte in the model's file (file_weights.hpp)
  std::size_t file = 0;     // which file: one of a sharded checkpoint's (FileWeights::files)
};

// A trainable parameter of a block and its optimizer state, as indices into
// BlockLayout::tensors.
struct TrainableParam {
  std::size_t tensor = 0;
  std::vector<std::size_t> state; // PackingRules::state_names, in order
  std::size_t grad_sum = 0;       // with PackingRules::grad_sum
};

// The frozen tensors first, then from `trainable_offset` on the trainable parameters and their
// state: the bytes that may change on the device (EngineOptions::trainable_bytes).
struct BlockLayout {
  std::vector<PackedTensor> tensors;
  std::size_t bytes = 0;
  std::size_t trainable_offset = 0;
  std::vector<TrainableParam> trainable;
  std::size_t trainable_bytes() const { return bytes - trainable_offset; }
  // The name of trainable parameter `p` ("attn.qkv.weight").
  const std::string& trainable_name(std::size_t p) const {
    return tensors[trainable[p].tensor].name;
  }
};

// What is packed besides frozen weights: for full fine-tuning, the parameters that require grad,
// each followed by a tensor like it per name in `state_names` ("exp_avg", ...) and, with
// `grad_sum`, one where the gradients of accumulating backwards are summed.
struct PackingRules {
  bool trainable = false;
  std::vector<std::string> state_names;
  bool grad_sum = false;
  // Sizes only (planning a model before its weights are loaded, or while an offloader holds
  // it): meta tensors count by their shape and dtype, claimed tensors are not refused. Layouts
  // made so are never packed.
  bool sizes_only = false;
};

// Each module's parameters and buffers, recursively, by name. Throws Error naming a null
// module or one listed twice.
std::vector<TensorBlock> tensor_blocks(const BlockList& blocks, const std::string& label);

// The frozen parameters (requires_grad false) of a block, at aligned offsets (core/layout.hpp),
// and with `rules.trainable` the trainable ones and their state after them. Validates every
// tensor of every block first and changes nothing: throws Error naming the tensor for a tensor
// shared with an earlier block or claimed by another offloader, and a tensor that is meta,
// sparse, quantized, not contiguous, or on a device other than the host and `device`.
// Trainable parameters (unless packed) and buffers, which stay on the device and are never
// packed, are checked too.
std::vector<BlockLayout> layout_blocks(const std::vector<TensorBlock>& blocks,
                                       const std::string& label, c10::Device device,
                                       const PackingRules& rules = {});

// The tensors of `layouts` are packed by a live offloader, process-wide (a second offloader over
// the same modules would pack the first one's views, and layout_blocks refuses them); and no
// longer. Never throw.
void claim(const std::vector<BlockLayout>& layouts);
void release_claims(const std::vector<BlockLayout>& layouts);

// The codec's ranges (core/codec.hpp) of a block's frozen tensors: each bfloat16, float16,
// float32 and float8 one by its dtype, in offset order; the others (and the padding) stay raw.
std::vector<codec::Range> frozen_ranges(const BlockLayout& layout);

// Tensor `t` over packed bytes: `memory` holds its first byte at `offset`, on `device`. The
// tensor keeps `memory` alive. The one place where packed bytes become a tensor again.
at::Tensor view(const std::shared_ptr<Buffer>& memory, std::size_t offset, const PackedTensor& t,
                c10::Device device);

} // namespace blockswap::torch_frontend
