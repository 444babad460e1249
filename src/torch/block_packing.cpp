#include "block_packing.hpp"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include <cstring>
#include <iostream>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "torch_compat.hpp"

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
  if (tensor.is_meta()) return "is a meta tensor (it holds no values): load its weights first";
  if (tensor.is_sparse() || tensor.layout() != c10::kStrided) {
    return "is not a dense tensor: blockswap swaps dense (strided) tensors only";
  }
  if (tensor.is_quantized()) return "is a quantized tensor, which blockswap cannot pack";
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
                      " is the same module as block ", earlier,
                      ": each block must be listed once");
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
      const std::string why = unusable(tensor, device);
      BLOCKSWAP_CHECK(why.empty(), "[", label, "] tensor '", name, "' of block ", b, " ", why);
    };
    // Returns whether the tensor was added (not a second listing of one added before).
    auto add = [&](const std::string& name, const at::Tensor& tensor, Role role) {
      check(name, tensor);
      BLOCKSWAP_CHECK(tensor.is_contiguous(), "[", label, "] tensor '", name, "' of block ", b,
                      " is not contiguous: make it so first (t.set_data(t.contiguous()))");
      const auto [it, inserted] = owner.emplace(tensor.unsafeGetTensorImpl(), b);
      BLOCKSWAP_CHECK(inserted || it->second == b, "[", label, "] tensor '", name, "' of block ",
                      b, " is shared with block ", it->second,
                      ": blocks must own their weights to be swapped");
      if (!inserted) return false; // the same tensor twice inside one block: packed once
      BLOCKSWAP_CHECK(!claims().tensors.contains(tensor.unsafeGetTensorImpl()), "[", label,
                      "] tensor '", name, "' of block ", b,
                      " is already managed by another ModelOffloader; destroy that one first");
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
      BLOCKSWAP_CHECK(!tensor.grad().defined(), "[", label, "] parameter '", name, "' of block ",
                      b, " has a gradient already, which the fused step would not see: drop it "
                      "before building the offloader (p.grad = None; in C++ "
                      "p.mutable_grad().reset())");
      BLOCKSWAP_CHECK(at::isFloatingType(tensor.scalar_type()), "[", label, "] parameter '",
                      name, "' of block ", b, " requires grad but is not floating point");
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

BlockBinder::BlockBinder(std::vector<BlockLayout> layouts, c10::Device device, bool strict)
    : layouts_(std::move(layouts)), device_(device), strict_(strict) {}

at::Tensor BlockBinder::host_view(int64_t block, const PackedTensor& t) const {
  // The view shares the buffer: the weights outlive the engine. Trainable tensors are where
  // the block's trainable bytes are now.
  const HostRegion region = t.role == Role::frozen
                                ? HostRegion{hosts_[block], 0}
                                : HostRegion{trainable_hosts_[block].buffer,
                                             trainable_hosts_[block].offset +
                                                 (t.offset - layouts_[block].trainable_offset)};
  return at::from_blob(
      region.data() + (t.role == Role::frozen ? t.offset : 0), t.sizes,
      [keep = region.buffer](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(t.dtype).device(at::kCPU));
}

// Note [device change]
// On a real device, set_data from a host copy to a slot (or back) changes the parameter's
// device, and autograd then forgets its gradient accumulator: the next forward makes a new one,
// without the hooks on the old (VariableHooks::set_data). The emulated device's slots are host
// memory too, so the binder does what set_data does there, and every test on the emulated
// device sees what a GPU does. Whoever hooks an accumulator (the fused step, Note [fused step])
// hooks the new one in `rebound_hook`, which runs after every bind of a trainable tensor.
void BlockBinder::bind(int64_t block, std::size_t index, const at::Tensor& data, bool on_device) {
  PackedTensor& t = layouts_[block].tensors[index];
  t.variable.set_data(data);
  if (device_.is_cpu() && t.on_device != on_device && t.variable.requires_grad()) {
    compat::forget_grad_accumulator(t.variable);
  }
  t.on_device = on_device;
  t.bound_data = t.variable.data_ptr();
  t.bound_version = t.variable._version();
  if (t.role == Role::trainable && rebound_hook) rebound_hook(block, index);
}

// Note [inference mode]
// Blocks move during passes that may run under c10::InferenceMode. A tensor made there is an
// inference tensor, which autograd refuses to save; the module's tensors must stay normal
// ones, so every view is made with inference mode off.

void BlockBinder::pack(Engine& engine, HostCopies copies) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  shared_ = copies != HostCopies::own;
  // First the copies, which may fail: nothing the caller sees changes until they are done.
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    hosts_.push_back(engine.host_buffer(static_cast<int64_t>(b)));
    trainable_hosts_.push_back(HostRegion{hosts_.back(), layouts_[b].trainable_offset});
    if (copies == HostCopies::shared_filled) continue;
    for (const PackedTensor& t : layouts_[b].tensors) {
      if (t.role == Role::state) { // zeros, like the optimizers' state before their first step
        const at::Tensor zeros = host_view(static_cast<int64_t>(b), t);
        std::memset(zeros.data_ptr(), 0, zeros.numel() * zeros.element_size());
        continue;
      }
      const at::Tensor source = t.variable.detach().to(at::kCPU).contiguous();
      std::memcpy(hosts_[b]->data() + t.offset, source.data_ptr(),
                  source.numel() * source.element_size());
    }
  }
  std::lock_guard lock(claims().mutex);
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    for (std::size_t i = 0; i < layouts_[b].tensors.size(); ++i) {
      PackedTensor& t = layouts_[b].tensors[i];
      claims().tensors.insert(t.variable.unsafeGetTensorImpl());
      bind(static_cast<int64_t>(b), i,
           strict_ ? at::empty({0}, at::TensorOptions().dtype(t.dtype).device(device_))
                   : host_view(static_cast<int64_t>(b), t),
           false);
    }
  }
}

// Note [changed tensors]
// A block's weights are the caller's too: weights loaded with copy_ or torch::load (which
// rebinds them with set_), a checkpoint restored while blocks are swapped. Each time blockswap
// points a tensor somewhere it notes the address and autograd's version counter, which every
// in-place write through the tensor bumps; when either differs at the next move, the tensor's
// current values are copied into the host copy (which is authoritative) before the slot can be
// reused, and into the slot when the block becomes ready. Such writes cost a synchronous copy
// of that tensor; frozen weights that nobody writes cost a comparison. Writes that bypass the
// version counter (through .data() or data_ptr()) cannot be seen: docs/guide.md says so.
// (Buffers, which forward may update without bumping it, are not packed at all.)
namespace {
// Whether the caller rebound the tensor or wrote it in place since blockswap last bound it.
bool caller_changed(const PackedTensor& t) {
  return t.variable.data_ptr() != t.bound_data || t.variable._version() != t.bound_version;
}
} // namespace

void BlockBinder::save_changes(int64_t block, PackedTensor& t) const {
  const at::Tensor& now = t.variable;
  BLOCKSWAP_CHECK(now.sizes().vec() == t.sizes && now.scalar_type() == t.dtype, "tensor '",
                  t.name, "' of block ", block, " was replaced by one of shape ", now.sizes(),
                  " and dtype ", now.scalar_type(), " where the block has ", at::IntArrayRef(t.sizes),
                  " and ", t.dtype, ": a swapped block's tensors keep their shape and dtype");
  BLOCKSWAP_CHECK(!shared_ || t.role != Role::frozen, "frozen tensor '", t.name, "' of block ",
                  block, " was changed, but its host copy is the node's, shared by every rank "
                  "(Options::node_sharing): load or change frozen weights before building the "
                  "offloader (on local rank 0, whose weights every rank reads); with "
                  "DistributedDataParallel, which broadcasts every parameter when it is built, "
                  "make it ignore the swapped ones (docs/distributed.md)");
  const at::Tensor host = host_view(block, t);
  if (now.data_ptr() != host.data_ptr()) {
    at::NoGradGuard no_grad;
    host.copy_(now.detach());
  }
}

void BlockBinder::check_still_frozen() const {
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    for (const PackedTensor& t : layouts_[b].tensors) {
      if (t.role != Role::frozen) continue;
      BLOCKSWAP_CHECK(!t.variable.requires_grad(), "parameter '", t.name, "' of block ", b,
                      " was made trainable after the ModelOffloader was built, which swaps it "
                      "as a frozen weight: choose which parameters train before building it");
    }
  }
}

void BlockBinder::save_caller_changes(int64_t block) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  for (PackedTensor& t : layouts_[block].tensors) {
    if (!caller_changed(t)) continue;
    save_changes(block, t);
    t.bound_data = t.variable.data_ptr();
    t.bound_version = t.variable._version();
  }
}

void BlockBinder::written_by_blockswap(int64_t block, std::size_t index) {
  PackedTensor& t = layouts_[block].tensors[index];
  t.bound_version = t.variable._version();
}

void BlockBinder::on_ready(int64_t block, const std::shared_ptr<Buffer>& slot) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    PackedTensor& t = layouts_[block].tensors[i];
    const bool changed = caller_changed(t);
    if (changed) save_changes(block, t);
    at::Tensor view = at::from_blob(
        slot->data() + t.offset, t.sizes, [keep = slot](void*) mutable { keep.reset(); },
        at::TensorOptions().dtype(t.dtype).device(device_));
    if (changed) view.copy_(host_view(block, t)); // the load may have carried older values
    bind(block, i, view, true);
  }
}

void BlockBinder::on_evicted(int64_t block) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  for (PackedTensor& t : layouts_[block].tensors) {
    if (caller_changed(t)) save_changes(block, t);
  }
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    const PackedTensor& t = layouts_[block].tensors[i];
    bind(block, i,
         strict_ ? at::empty({0}, at::TensorOptions().dtype(t.dtype).device(device_))
                 : host_view(block, t),
         false);
  }
}

void BlockBinder::on_written_back(int64_t block, const HostRegion& trainable) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> old_views;
  for (const PackedTensor& t : layouts_[block].tensors) {
    old_views.push_back(t.role == Role::frozen ? at::Tensor() : host_view(block, t));
  }
  trainable_hosts_[block] = trainable;
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    PackedTensor& t = layouts_[block].tensors[i];
    if (t.role == Role::frozen || t.bound_data != old_views[i].data_ptr()) continue; // on the device
    const at::Tensor view = host_view(block, t);
    // What the caller wrote into the old region since is theirs: it goes with the tensor.
    if (caller_changed(t) && t.variable.sizes().vec() == t.sizes) view.copy_(t.variable.detach());
    bind(block, i, view, false);
  }
}

void BlockBinder::restore_to_host() {
  const c10::InferenceMode normal(false); // Note [inference mode]
  for (std::size_t b = 0; b < layouts_.size() && b < hosts_.size(); ++b) {
    for (std::size_t i = 0; i < layouts_[b].tensors.size(); ++i) {
      PackedTensor& t = layouts_[b].tensors[i];
      try {
        // What changed on the device stays: a trainable block that never left it was never
        // written back.
        const bool on_device = t.variable.sizes().vec() == t.sizes; // not strict's placeholder
        if (caller_changed(t) || (t.role != Role::frozen && on_device)) {
          save_changes(static_cast<int64_t>(b), t);
        }
      } catch (const std::exception& e) {
        std::cerr << "blockswap: " << e.what() << "; the host copy keeps the earlier values\n";
      }
      bind(static_cast<int64_t>(b), i, host_view(static_cast<int64_t>(b), t), false);
    }
  }
  std::lock_guard lock(claims().mutex);
  for (const auto& layout : layouts_) {
    for (const auto& t : layout.tensors) claims().tensors.erase(t.variable.unsafeGetTensorImpl());
  }
}

} // namespace blockswap::torch_frontend
