// Packing a block's frozen tensors into one host buffer, and pointing them at device slots.
// Implementer-only (src/torch).
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

#include "blockswap/engine.hpp"

namespace torch::nn {
class Module;
}

namespace blockswap::torch_frontend {

// Where one tensor of a block lives inside the block's packed buffer.
struct PackedTensor {
  std::string name;
  at::Tensor variable; // the module's own parameter or buffer: rebound with set_data
  std::size_t offset = 0;
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

struct BlockLayout {
  std::vector<PackedTensor> tensors;
  std::size_t bytes = 0;
};

// The frozen parameters (requires_grad false) and the buffers of a block, at 256-byte aligned
// offsets. Throws Error when a tensor belongs to an earlier block too.
std::vector<BlockLayout>
layout_blocks(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks);

// Keeps the modules' tensors pointing at the right memory as the engine moves blocks.
class BlockBinder final : public ResidencyListener {
public:
  BlockBinder(std::vector<BlockLayout> layouts, c10::Device device);

  const std::vector<BlockLayout>& layouts() const { return layouts_; }
  // Copies every block's tensors into the engine's host buffers and leaves them empty.
  void pack(Engine& engine);
  // Points every packed tensor at its host copy again (shared ownership of the buffer).
  void restore_to_host(Engine& engine);

  void on_ready(int64_t block, std::byte* device_data) override;
  void on_evicted(int64_t block) override;

private:
  std::vector<BlockLayout> layouts_;
  c10::Device device_;
};

} // namespace blockswap::torch_frontend
