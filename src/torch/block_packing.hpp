// Packing a block's frozen tensors into one host buffer, and pointing them at device slots.
// Implementer-only (src/torch).
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/torch.hpp"

namespace blockswap::torch_frontend {

// Where one tensor of a block lives inside the block's packed buffer.
struct PackedTensor {
  std::string name;
  at::Tensor variable; // the module's own parameter or buffer: rebound with set_data
  std::size_t offset = 0;
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Float;
  // What blockswap last pointed `variable` at, to see the caller's writes (Note [changed
  // tensors] in the .cpp).
  const void* bound_data = nullptr;
  int64_t bound_version = 0;
};

struct BlockLayout {
  std::vector<PackedTensor> tensors;
  std::size_t bytes = 0;
};

// The frozen parameters (requires_grad false) of a block, at aligned offsets (core/layout.hpp).
// Validates every tensor of every block first and changes nothing: throws Error naming the
// tensor for a tensor shared with an earlier block or claimed by
// another offloader, and a tensor that is meta, sparse, quantized, not contiguous, or on a
// device other than the host and `device`. Trainable parameters and buffers, which stay on
// the device and are never packed, are checked too.
std::vector<BlockLayout> layout_blocks(const std::vector<TensorBlock>& blocks,
                                       const std::string& label, c10::Device device);

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
  // Copies every block's tensors into the engine's host buffers, then points them at those
  // copies and claims them. All or nothing: when it throws, no tensor has changed.
  void pack(Engine& engine);
  // Saves what the caller changed, points every packed tensor at its host copy (sharing the
  // buffer, which outlives the engine) and releases the claims. Never throws.
  void restore_to_host();

  // Throws Error naming a packed parameter that was made trainable after packing: its
  // optimizer's updates would bypass what blockswap can see.
  void check_still_frozen() const;

  void on_ready(int64_t block, const std::shared_ptr<Buffer>& slot) override;
  void on_evicted(int64_t block) override;

private:
  at::Tensor host_view(int64_t block, const PackedTensor& t) const;
  void save_changes(int64_t block, PackedTensor& t) const;
  static void bind(PackedTensor& t, const at::Tensor& data);

  std::vector<BlockLayout> layouts_;
  std::vector<std::shared_ptr<Buffer>> hosts_; // the engine's host buffers, from pack()
  c10::Device device_;
  bool strict_ = false;
};

} // namespace blockswap::torch_frontend
