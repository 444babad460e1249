#include "block_packing.hpp"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "blockswap/error.hpp"

namespace blockswap::torch_frontend {
namespace {

constexpr std::size_t kAlignment = 256;

std::size_t align(std::size_t offset) {
  return (offset + kAlignment - 1) / kAlignment * kAlignment;
}

// A tensor that refers to no memory: using it in an op fails with a shape error instead of
// computing with another block's weights.
at::Tensor nowhere(const PackedTensor& t, c10::Device device) {
  return at::empty({0}, at::TensorOptions().dtype(t.dtype).device(device));
}

// Tensors packed by a live offloader, process-wide: a second offloader over the same modules
// would see their empty placeholders and pack nothing.
struct Claims {
  std::mutex mutex;
  std::unordered_set<const void*> tensors;
};
Claims& claims() {
  static Claims instance;
  return instance;
}

} // namespace

std::vector<BlockLayout>
layout_blocks(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks) {
  std::vector<BlockLayout> layouts(blocks.size());
  std::unordered_map<const void*, std::size_t> owner; // TensorImpl -> block
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    BLOCKSWAP_CHECK(blocks[b] != nullptr, "block ", b, " is a null module");
    BlockLayout& layout = layouts[b];
    auto add = [&](const std::string& name, const at::Tensor& tensor) {
      if (!tensor.defined()) return;
      const auto [it, inserted] = owner.emplace(tensor.unsafeGetTensorImpl(), b);
      BLOCKSWAP_CHECK(inserted || it->second == b, "tensor '", name, "' of block ", b,
                      " is shared with block ", it->second,
                      ": blocks must own their weights to be swapped");
      if (!inserted) return; // the same tensor twice inside one block: packed once
      {
        std::lock_guard lock(claims().mutex);
        BLOCKSWAP_CHECK(!claims().tensors.contains(tensor.unsafeGetTensorImpl()), "tensor '", name,
                        "' of block ", b,
                        " is already managed by another ModelOffloader; destroy that one first");
      }
      layout.bytes = align(layout.bytes);
      layout.tensors.push_back(
          PackedTensor{name, tensor, layout.bytes, tensor.sizes().vec(), tensor.scalar_type()});
      layout.bytes += tensor.numel() * tensor.element_size();
    };
    for (const auto& item : blocks[b]->named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) add(item.key(), item.value());
    }
    for (const auto& item : blocks[b]->named_buffers(/*recurse=*/true)) {
      add(item.key(), item.value());
    }
  }
  return layouts;
}

BlockBinder::BlockBinder(std::vector<BlockLayout> layouts, c10::Device device)
    : layouts_(std::move(layouts)), device_(device) {}

void BlockBinder::pack(Engine& engine) {
  {
    std::lock_guard lock(claims().mutex);
    for (const auto& layout : layouts_) {
      for (const auto& t : layout.tensors)
        claims().tensors.insert(t.variable.unsafeGetTensorImpl());
    }
  }
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    std::byte* host = engine.host_data(static_cast<int64_t>(b));
    for (PackedTensor& t : layouts_[b].tensors) {
      const at::Tensor source = t.variable.to(at::kCPU).contiguous();
      std::memcpy(host + t.offset, source.data_ptr(), source.numel() * source.element_size());
      t.variable.set_data(nowhere(t, device_));
    }
  }
}

void BlockBinder::restore_to_host(Engine& engine) {
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    std::shared_ptr<Buffer> host = engine.host_buffer(static_cast<int64_t>(b));
    for (PackedTensor& t : layouts_[b].tensors) {
      // The tensor keeps the packed buffer alive: no copy, and the weights outlive the engine.
      t.variable.set_data(at::from_blob(
          host->data() + t.offset, t.sizes, [host](void*) mutable { host.reset(); },
          at::TensorOptions().dtype(t.dtype).device(at::kCPU)));
    }
  }
  std::lock_guard lock(claims().mutex);
  for (const auto& layout : layouts_) {
    for (const auto& t : layout.tensors) claims().tensors.erase(t.variable.unsafeGetTensorImpl());
  }
}

void BlockBinder::on_ready(int64_t block, std::byte* device_data) {
  for (PackedTensor& t : layouts_[block].tensors) {
    t.variable.set_data(at::from_blob(device_data + t.offset, t.sizes,
                                      at::TensorOptions().dtype(t.dtype).device(device_)));
  }
}

void BlockBinder::on_evicted(int64_t block) {
  for (PackedTensor& t : layouts_[block].tensors) t.variable.set_data(nowhere(t, device_));
}

} // namespace blockswap::torch_frontend
