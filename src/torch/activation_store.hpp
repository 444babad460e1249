// The one activation store: what blocks' forwards save for backward, moved to host memory and
// back as ActivationRule says (Note [offloaded activations] in core/activation_rule.hpp), for
// both front ends: ActivationScope in C++ (activation_scope.cpp) and the Python package, whose
// saved_tensors_hooks hand each saved tensor to it through _C (python/blockswap/_activations.py).
// Implementer-only (src/torch): activation_store.cpp (the store), activation_group.cpp (groups
// and saved tensors).
//
//   auto group = ActivationGroup::open(device, "blocks.3", weights, threshold, counted_by);
//   std::shared_ptr<SavedActivation> saved = group->pack(tensor); // autograd's pack hook
//   at::Tensor again = saved->unpack();                            // its unpack hook
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "blockswap/core/activation_rule.hpp"
#include "blockswap/torch/activation_scope.hpp"

namespace blockswap {
class Device;
} // namespace blockswap

namespace blockswap::torch_frontend {

class ActivationStore;

// One group of the store: what one block's forward saved.
struct Group {
  Group(ActivationRule::Group group_id, std::string group_label, std::weak_ptr<Device> counter)
      : id(group_id), label(std::move(group_label)), counted_by(std::move(counter)) {}
  const ActivationRule::Group id;
  const std::string label;
  const std::weak_ptr<Device> counted_by; // the Device that counts its copies (TransferStats)
};

// One saved storage: on the device until its group goes out, then a host copy, then, brought
// back, a device copy again until every view of it was unpacked.
struct SavedStorage {
  SavedStorage(std::shared_ptr<ActivationStore> owner, std::shared_ptr<Group> saved_in,
               at::Tensor bytes);
  ~SavedStorage();
  // not copyable, not movable: the store counts it
  SavedStorage(const SavedStorage&) = delete;
  SavedStorage& operator=(const SavedStorage&) = delete;

  std::shared_ptr<ActivationStore> store;
  std::shared_ptr<Group> group;
  at::Tensor device; // a flat byte tensor over the storage, undefined while only on the host
  at::Tensor host;
  std::size_t nbytes;
  int64_t views = 0;
  int64_t unpacked = 0;
  std::optional<c10::Event> d2h_done, h2d_done;
};

// The saved activations of every offloader and scope of one torch device (store_for).
class ActivationStore : public std::enable_shared_from_this<ActivationStore> {
public:
  // kCPU (the emulated device: synchronous copies) or kCUDA (two side streams of torch's pool).
  explicit ActivationStore(c10::Device device);

  c10::Device device() const { return device_; }
  ActivationStats stats();
  void reset_stats();

  // A group opens: the groups the rule names go to host memory, all or nothing.
  std::shared_ptr<Group> open_group(std::string label, std::weak_ptr<Device> counted_by);
  // The storage `t` views (`data`, its data), in `group`: made once per storage and group.
  std::shared_ptr<SavedStorage> storage_of(const std::shared_ptr<Group>& group, const at::Tensor& t,
                                           const void* data);
  // Small tensors kept on the device, counted once per storage.
  void keep(const void* data, std::size_t nbytes);
  void forget_kept(const void* data);
  void storage_freed(const SavedStorage& s);
  // Backward reads `s`: its device tensor, brought back first if it is in host memory; the
  // first read of its group starts bringing back the group the rule names ahead.
  at::Tensor unpack(SavedStorage& s, bool first_unpack_of_view);

private:
  void add(std::size_t nbytes);
  void forget_freed_groups(bool storages);
  std::vector<std::shared_ptr<SavedStorage>> live_storages(const Group& group);
  void evict(const Group& group);
  void copy_out(SavedStorage& s, bool pinned);
  static void drop_host_copies(const std::vector<std::shared_ptr<SavedStorage>>& storages);
  void bring_back(const Group& group);
  void copy_in(SavedStorage& s);

  const c10::Device device_;
  const bool cuda_;
  c10::Stream d2h_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  c10::Stream h2d_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  std::recursive_mutex mutex_; // a SavedStorage may die while the store holds it
  ActivationStats stats_;
  ActivationRule rule_;
  ActivationRule::Group next_id_ = 0;
  std::map<ActivationRule::Group, std::weak_ptr<Group>> groups_; // in the order they opened
  std::map<std::pair<ActivationRule::Group, std::uintptr_t>, std::weak_ptr<SavedStorage>> storages_;
  std::unordered_map<const void*, std::pair<int64_t, std::size_t>> kept_;
};

// The store of a torch device (a kCUDA device without an index: the current one).
std::shared_ptr<ActivationStore> store_for(c10::Device device);

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
  // device's store still on the device goes to host memory now. `counted_by` (may be empty) is
  // the blockswap Device whose TransferStats count what this group moves. Throws Error when this
  // LibTorch lacks the device, or when a copy to host memory fails (then the earlier groups stay
  // on the device, and nothing was lost).
  static std::shared_ptr<ActivationGroup> open(c10::Device device, std::string label,
                                               Weights weights, std::size_t threshold_bytes,
                                               std::weak_ptr<Device> counted_by = {});

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

// How host memory for one storage's copy is allocated (`pinned` on a GPU): by default from the
// pool of the group's Device (Device::pooled_host), or torch's allocators for a group without
// one. Tests replace it to make a copy fail; an empty function restores the default.
using HostAllocator = std::function<at::Tensor(std::size_t bytes, bool pinned)>;
void set_activation_host_allocator(HostAllocator allocator);
at::Tensor default_host_allocation(std::size_t bytes, bool pinned); // torch's allocators
// The allocator set, or else `device`'s pool, or else torch's allocators.
at::Tensor allocate_host(std::size_t bytes, bool pinned, Device* device);

} // namespace blockswap::torch_frontend
