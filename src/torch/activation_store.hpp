// The one activation store: what blocks' forwards save for backward, moved to host memory and
// back as ActivationRule says (Note [offloaded activations] in core/activation_rule.hpp), for
// both front ends: ActivationScope in C++ (activation_scope.cpp) and the Python package, whose
// saved_tensors_hooks hand each saved tensor to it through _C (python/blockswap/_activations.py).
// Implementer-only (src/torch).
//
//   auto group = ActivationGroup::open(device, "blocks.3", weights, threshold);
//   std::shared_ptr<SavedActivation> saved = group->pack(tensor); // autograd's pack hook
//   at::Tensor again = saved->unpack();                            // its unpack hook
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "blockswap/torch/activation_scope.hpp"

namespace blockswap::torch_frontend {

class ActivationStore; // one a torch device, shared by its offloaders and scopes
struct Group;
struct SavedStorage;

// One tensor autograd saved: kept as it is, or recorded by its storage (Note [saved storages]
// in activation_store.cpp).
class SavedActivation {
public:
  SavedActivation(std::shared_ptr<ActivationStore> store, const at::Tensor& kept,
                  const void* counted);
  SavedActivation(std::shared_ptr<SavedStorage> storage, const at::Tensor& tensor);
  ~SavedActivation();
  // not copyable, not movable: the store counts it
  SavedActivation(const SavedActivation&) = delete;
  SavedActivation& operator=(const SavedActivation&) = delete;

  // The tensor, on the device with its sizes, strides and offset (brought back if it was in
  // host memory). Throws Error when it was written in place after it was saved.
  at::Tensor unpack();

private:
  std::shared_ptr<ActivationStore> store_; // kept tensors: to forget their count
  at::Tensor kept_;
  const void* counted_ = nullptr; // kept_'s storage, counted on the device
  std::shared_ptr<SavedStorage> storage_;
  std::vector<int64_t> sizes_, strides_;
  int64_t offset_ = 0;
  at::ScalarType dtype_ = at::kByte;
  std::optional<c10::VariableVersion> version_;
  uint32_t saved_version_ = 0;
  bool unpacked_ = false;
};

// One open group: what autograd saves while it is open is block `label`'s activations.
class ActivationGroup {
public:
  // The data pointers of the storages of the block's own weights, buffers and adapters where
  // they are while it computes: asked at the first pack (a group may open before the block's
  // wait binds its weights to a slot).
  using Weights = std::function<std::unordered_set<const void*>()>;

  // Opens a group on `device` (kCPU: the emulated device, or kCUDA): every earlier group of the
  // device's store still on the device goes to host memory now. Throws Error when this LibTorch
  // lacks the device, or when a copy to host memory fails (then the earlier groups stay on the
  // device, and nothing was lost).
  static std::shared_ptr<ActivationGroup> open(c10::Device device, std::string label,
                                               Weights weights, std::size_t threshold_bytes);

  // autograd's pack hook: storages of at least the threshold are recorded to move; the others,
  // tensors on another device, not plain strided ones and views of the weights stay.
  std::shared_ptr<SavedActivation> pack(const at::Tensor& tensor);
  // A pack hook that keeps `tensor` as it is (Python: a subclass, which comes back as the same
  // object): counted while its storage is on the device.
  std::shared_ptr<SavedActivation> keep(const at::Tensor& tensor);

private:
  ActivationGroup() = default;
  std::shared_ptr<ActivationStore> store_;
  std::shared_ptr<Group> group_;
  Weights weights_;
  std::optional<std::unordered_set<const void*>> weight_storages_;
  std::size_t threshold_bytes_ = 0;
};

// Makes LibTorch's autograd engine ask the open ActivationScope for the hooks of each tensor it
// saves (activation_scope.cpp; Note [saved-tensor hooks in C++] in torch_compat_autograd.cpp).
// Idempotent. Throws Error where an engine other than LibTorch's own is in charge.
void install_saved_tensor_hooks();

// The counters of a device's store (activation_stats in activation_scope.hpp).
ActivationStats store_stats(c10::Device device);
void reset_store_stats(c10::Device device);

// How host memory for one storage's copy is allocated (`pinned` on a GPU): torch's allocators
// (its caching pinned allocator on a GPU). Tests replace it to make a copy fail; an empty
// function restores the default.
using HostAllocator = std::function<at::Tensor(std::size_t bytes, bool pinned)>;
void set_activation_host_allocator(HostAllocator allocator);
at::Tensor default_host_allocation(std::size_t bytes, bool pinned);

} // namespace blockswap::torch_frontend
