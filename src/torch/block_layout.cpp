#include "block_layout.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/nn/module.h> // tensor_blocks: the modules' named parameters and buffers

#include <algorithm>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"

namespace blockswap::torch_frontend {
namespace {

// Tensors packed by a live offloader, process-wide: a second offloader over the same modules
// would pack the first one's views.
struct Claims {
  std::mutex mutex;
  std::unordered_set<const void*> tensors;
};
Claims& claims() {
  static Claims instance;
  return instance;
}

// Why `tensor` cannot be swapped, or nothing.
std::string unusable(const at::Tensor& tensor, c10::Device device) {
  if (tensor.is_meta()) {
    return "is a meta tensor (it holds no values): load its weights first, or build it empty "
           "(torch::empty) and give the file its values are in (Options::weights_file and "
           "weights_from_file; Python: weights_file=, which takes meta frozen weights)";
  }
  if (tensor.is_sparse() || tensor.layout() != c10::kStrided) {
    return "is not a dense tensor: blockswap swaps dense (strided) tensors only";
  }
  if (tensor.is_quantized()) return "is a quantized tensor, which blockswap cannot pack";
  // A wrapper tensor subclass (torchao's Float8Tensor) keeps its values in inner tensors: the
  // Python package opens it into them (Note [wrapper subclasses], _block_tensors.py).
  if (!tensor.has_storage()) {
    return "has no storage of its own (a wrapper tensor subclass): give blockswap its inner "
           "tensors instead";
  }
  if (!tensor.device().is_cpu() && tensor.device().type() != device.type()) {
    return detail::concat("is on ", tensor.device().str(), ", but the offloader's device is ",
                          device.str());
  }
  if (!tensor.device().is_cpu() && device.has_index() && tensor.device() != device) {
    return detail::concat("is on ", tensor.device().str(), ", but the offloader's device is ",
                          device.str());
  }
  return {};
}

} // namespace

std::vector<TensorBlock> tensor_blocks(const BlockList& blocks, const std::string& label) {
  std::vector<TensorBlock> out;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    BLOCKSWAP_CHECK(blocks[b] != nullptr, "[", label, "] block ", b, " is a null module");
    for (std::size_t earlier = 0; earlier < b; ++earlier) {
      BLOCKSWAP_CHECK(blocks[earlier] != blocks[b], "[", label, "] block ", b,
                      " is the same module as block ", earlier, ": each block must be listed once");
    }
    TensorBlock block;
    for (const auto& item : blocks[b]->named_parameters(/*recurse=*/true)) {
      block.parameters.emplace_back(item.key(), item.value());
    }
    for (const auto& item : blocks[b]->named_buffers(/*recurse=*/true)) {
      block.buffers.emplace_back(item.key(), item.value());
    }
    out.push_back(std::move(block));
  }
  return out;
}

namespace {
// Appends a tensor at the next aligned offset, of the tensor's shape or, for the placeholder of
// state blockswap makes, of `shape`.
void place(BlockLayout& layout, const std::string& name, const at::Tensor& tensor, Role role,
           const std::optional<std::vector<int64_t>>& shape = std::nullopt) {
  const std::vector<int64_t> sizes = shape ? *shape : tensor.sizes().vec();
  int64_t numel = 1;
  for (int64_t size : sizes) numel *= size;
  layout.bytes = blockswap::layout::align_up(layout.bytes);
  PackedTensor packed{name, role, tensor, layout.bytes, sizes, tensor.scalar_type()};
  layout.tensors.push_back(std::move(packed));
  layout.bytes += static_cast<std::size_t>(numel) * tensor.element_size();
}
} // namespace

std::vector<BlockLayout> layout_blocks(const std::vector<TensorBlock>& blocks,
                                       const std::string& label, c10::Device device,
                                       const PackingRules& rules) {
  std::vector<BlockLayout> layouts(blocks.size());
  std::unordered_map<const void*, std::size_t> owner; // TensorImpl -> block
  std::lock_guard lock(claims().mutex);
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    BlockLayout& layout = layouts[b];
    auto check = [&](const std::string& name, const at::Tensor& tensor) {
      if (rules.sizes_only && tensor.is_meta()) return;
      const std::string why = unusable(tensor, device);
      BLOCKSWAP_CHECK(why.empty(), "[", label, "] tensor '", name, "' of block ", b, " ", why);
    };
    // Returns whether the tensor was added (not a second listing of one added before).
    auto add = [&](const std::string& name, const at::Tensor& tensor, Role role) {
      check(name, tensor);
      BLOCKSWAP_CHECK(tensor.is_contiguous(), "[", label, "] tensor '", name, "' of block ", b,
                      " is not contiguous: make it so first (C++: t.set_data(t.contiguous()); "
                      "Python: p.data = p.data.contiguous())");
      const auto [it, inserted] = owner.emplace(tensor.unsafeGetTensorImpl(), b);
      BLOCKSWAP_CHECK(inserted || it->second == b, "[", label, "] tensor '", name, "' of block ", b,
                      " is shared with block ", it->second,
                      ": blocks must own their weights to be swapped");
      if (!inserted) return false; // the same tensor twice inside one block: packed once
      BLOCKSWAP_CHECK(rules.sizes_only || !claims().tensors.contains(tensor.unsafeGetTensorImpl()),
                      "[", label, "] tensor '", name, "' of block ", b,
                      " is already managed by another ModelOffloader; close (or destroy) that one "
                      "first");
      place(layout, name, tensor, role);
      return true;
    };
    for (const auto& [name, tensor] : blocks[b].parameters) {
      if (tensor.defined() && !tensor.requires_grad()) add(name, tensor, Role::frozen);
    }
    layout.trainable_offset = layout.bytes; // nothing trains
    for (const auto& [name, tensor] : blocks[b].parameters) {
      if (!tensor.defined() || !tensor.requires_grad()) continue;
      if (!rules.trainable) {
        check(name, tensor); // stays as it is, on the device
        continue;
      }
      BLOCKSWAP_CHECK(!tensor.grad().defined(), "[", label, "] parameter '", name, "' of block ", b,
                      " has a gradient already, which the fused step would not see: drop it "
                      "before building the offloader (p.grad = None; in C++ "
                      "p.mutable_grad().reset())");
      BLOCKSWAP_CHECK(at::isFloatingType(tensor.scalar_type()), "[", label, "] parameter '", name,
                      "' of block ", b, " requires grad but is not floating point");
      if (add(name, tensor, Role::trainable)) {
        if (layout.trainable.empty()) layout.trainable_offset = layout.tensors.back().offset;
        layout.trainable.push_back(TrainableParam{layout.tensors.size() - 1, {}, 0});
      }
    }
    // The state after all the trainable parameters, in the same order.
    for (TrainableParam& param : layout.trainable) {
      const PackedTensor parameter = layout.tensors[param.tensor];
      auto state = [&](const std::string& suffix) {
        place(layout, parameter.name + "." + suffix,
              at::empty({0}, at::TensorOptions().dtype(parameter.dtype)), Role::state,
              parameter.sizes);
        return layout.tensors.size() - 1;
      };
      for (const std::string& suffix : rules.state_names) param.state.push_back(state(suffix));
      if (rules.grad_sum) param.grad_sum = state("grad_sum");
    }
    // Buffers are state the forward may update (running statistics), in ways autograd's
    // version counter does not always see (LibTorch's batch_norm): they stay on the device,
    // like adapters, and are never packed.
    for (const auto& [name, tensor] : blocks[b].buffers) {
      if (tensor.defined()) check(name, tensor);
    }
  }
  return layouts;
}

void claim(const std::vector<BlockLayout>& layouts) {
  std::lock_guard lock(claims().mutex);
  for (const auto& layout : layouts) {
    for (const auto& t : layout.tensors) claims().tensors.insert(t.variable.unsafeGetTensorImpl());
  }
}

void release_claims(const std::vector<BlockLayout>& layouts) {
  std::lock_guard lock(claims().mutex);
  for (const auto& layout : layouts) {
    for (const auto& t : layout.tensors) claims().tensors.erase(t.variable.unsafeGetTensorImpl());
  }
}

at::Tensor view(const std::shared_ptr<Buffer>& memory, std::size_t offset, const PackedTensor& t,
                c10::Device device) {
  return at::from_blob(
      memory->data() + offset, t.sizes, [keep = memory](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(t.dtype).device(device));
}

std::vector<codec::Range> frozen_ranges(const BlockLayout& layout) {
  std::vector<codec::Range> ranges;
  for (const PackedTensor& t : layout.tensors) {
    if (t.role != Role::frozen) continue;
    codec::DType dtype = codec::DType::raw;
    switch (t.dtype) {
    case at::kBFloat16:
      dtype = codec::DType::bf16;
      break;
    case at::kHalf:
      dtype = codec::DType::fp16;
      break;
    case at::kFloat:
      dtype = codec::DType::fp32;
      break;
    default:
      if (c10::isFloat8Type(t.dtype)) dtype = codec::DType::fp8;
      break;
    }
    if (dtype == codec::DType::raw) continue;
    int64_t numel = 1;
    for (int64_t s : t.sizes) numel *= s;
    const auto bytes = static_cast<uint64_t>(numel) * c10::elementSize(t.dtype);
    if (bytes > 0) ranges.push_back(codec::Range{t.offset, bytes, dtype});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const codec::Range& a, const codec::Range& b) { return a.offset < b.offset; });
  return ranges;
}

} // namespace blockswap::torch_frontend
