// Packing a block's frozen tensors into one host buffer, and pointing them at device slots.
// Implementer-only (src/torch).
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/torch.hpp"

namespace blockswap::torch_frontend {

// What a packed tensor is to the block: a frozen weight (never written back), a parameter that
// trains (full fine-tuning), or the optimizer's state for one (its momentum, its moments, the
// sum of its gradients while they accumulate), which blockswap itself made.
enum class Role { frozen, trainable, state };

// Where one tensor of a block lives inside the block's packed buffer.
struct PackedTensor {
  std::string name;
  Role role = Role::frozen;
  at::Tensor variable; // the module's own parameter or buffer: rebound with set_data
  std::size_t offset = 0;
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Float;
  // What blockswap last pointed `variable` at, to see the caller's writes (Note [changed
  // tensors] in the .cpp).
  const void* bound_data = nullptr;
  int64_t bound_version = 0;
  bool on_device = false; // bound to a slot (Note [device change] in the .cpp)
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
};

// What is packed besides frozen weights: for full fine-tuning, the parameters that require grad,
// each followed by a tensor like it per name in `state_names` ("exp_avg", ...) and, with
// `grad_sum`, one where the gradients of accumulating backwards are summed.
struct PackingRules {
  bool trainable = false;
  std::vector<std::string> state_names;
  bool grad_sum = false;
};

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

// Each module's parameters and buffers, recursively, by name. Throws Error naming a null
// module or one listed twice.
std::vector<TensorBlock> tensor_blocks(const BlockList& blocks, const std::string& label);

// Keeps the modules' tensors pointing at the right memory as the engine moves blocks: a view
// of its slot while a block is ready, a view of its host copy otherwise (or, when `strict`,
// a tensor with no elements, so that computing with it fails).
class BlockBinder final : public ResidencyListener {
public:
  BlockBinder(std::vector<BlockLayout> layouts, c10::Device device, bool strict);

  const std::vector<BlockLayout>& layouts() const { return layouts_; }
  // Where the host copies are: the engine's own, which pack() fills; node-shared memory
  // (Options::node_sharing) that this process fills, or that another rank of the node filled
  // and pack() only binds to. The caller's writes into node-shared frozen weights raise.
  enum class HostCopies { own, shared_fill, shared_filled };
  // Copies every block's tensors into the engine's host buffers (unless `copies` is
  // shared_filled), then points them at those copies and claims them. All or nothing: when it
  // throws, no tensor has changed.
  void pack(Engine& engine, HostCopies copies = HostCopies::own);
  // Saves what the caller changed, points every packed tensor at its host copy (sharing the
  // buffer, which outlives the engine) and releases the claims. Never throws.
  void restore_to_host();

  // Throws Error naming a packed frozen parameter that was made trainable after packing: its
  // optimizer's updates would bypass what blockswap can see.
  void check_still_frozen() const;
  // The tensor of block `block` at `index` (its variable: reads true values wherever the block
  // is), and notes that blockswap itself wrote it in place (an optimizer step), which is not a
  // change of the caller's to copy anywhere.
  const PackedTensor& tensor(int64_t block, std::size_t index) const {
    return layouts_[block].tensors[index];
  }
  void written_by_blockswap(int64_t block, std::size_t index);
  // Copies what the caller wrote into block `block`'s tensors since blockswap bound them into
  // their host copy (which a step on the host is about to change).
  void save_caller_changes(int64_t block);
  // The host copy of that tensor (where it is now), whatever the tensor is bound to.
  at::Tensor host_copy(int64_t block, std::size_t index) const {
    return host_view(block, layouts_[block].tensors[index]);
  }
  // Called before a block is loaded from its host copy (ResidencyListener::before_load).
  std::function<void(int64_t)> before_load_hook;
  // Called after each bind of a trainable tensor (index into the block's tensors): its
  // gradient accumulator may be a new one (Note [device change] in the .cpp).
  std::function<void(int64_t, std::size_t)> rebound_hook;
  void before_load(int64_t block) override {
    if (before_load_hook) before_load_hook(block);
  }

  void on_ready(int64_t block, const std::shared_ptr<Buffer>& slot) override;
  void on_evicted(int64_t block) override;
  void on_written_back(int64_t block, const HostRegion& trainable) override;

private:
  at::Tensor host_view(int64_t block, const PackedTensor& t) const;
  void save_changes(int64_t block, PackedTensor& t) const;
  void bind(int64_t block, std::size_t index, const at::Tensor& data, bool on_device);

  std::vector<BlockLayout> layouts_;
  std::vector<std::shared_ptr<Buffer>> hosts_; // the engine's host buffers, from pack()
  // Where each block's trainable bytes are in host memory (Note [atomic write-back]).
  std::vector<HostRegion> trainable_hosts_;
  c10::Device device_;
  bool strict_ = false;
  bool shared_ = false; // node-shared host copies (pack)
};

} // namespace blockswap::torch_frontend
