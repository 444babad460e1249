// Note [saved storages]
// What the store moves of a group (when: Note [offloaded activations] in
// core/activation_rule.hpp). A saved tensor is recorded by its *storage*: several views of one
// storage (a chunk, a transpose) are copied once, and each comes back with its own sizes,
// strides and offset on the restored storage, so that backward's kernels see the layout they
// would have seen (a compact copy of a strided view could change their rounding). A saved
// tensor stays where it is when its storage is under the threshold (counted on the device, once
// per storage), when it is not a plain strided tensor on the group's device (a wrapper subclass,
// a sparse tensor), when it views one of the block's weights, buffers or adapters (slots and
// host copies that blockswap already manages), or when it is saved inside a backward (a
// recompute reads it at once).
//
// A group's own storages come back one by one as backward unpacks them; the group the rule names
// ahead comes back whole. A storage's device copy is dropped once every view of it was unpacked
// (autograd holds what it unpacked while it needs it); a graph kept for a second backward
// unpacks again from the host copy. A saved tensor written in place after it was saved raises at
// its unpack, as autograd does without hooks (its version counter is checked).
//
// On a GPU the copies run on two side streams of torch's pool, device->host and host->device,
// ordered by events against torch's current stream, into torch's caching pinned memory
// (docs/performance.md, "Offloaded activations and the Device": why not the Device's copy
// stream); record_stream keeps torch's allocator from reusing memory a side stream still reads
// or writes. On the emulated device (kCPU) the copies are synchronous.
#include "activation_store.hpp"

#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "blockswap/core/activation_rule.hpp"
#include "blockswap/core/error.hpp"
#include "torch_compat.hpp"
#include "torch_compat_autograd.hpp"

namespace blockswap::torch_frontend {

struct Group {
  Group(ActivationRule::Group group_id, std::string group_label)
      : id(group_id), label(std::move(group_label)) {}
  const ActivationRule::Group id;
  const std::string label;
};

// One saved storage: on the device until its group goes out, then a host copy, then, brought
// back, a device copy again until every view of it was unpacked.
struct SavedStorage {
  SavedStorage(std::shared_ptr<ActivationStore> owner, std::shared_ptr<Group> saved_in,
               at::Tensor bytes);
  ~SavedStorage();
  std::shared_ptr<ActivationStore> store;
  std::shared_ptr<Group> group;
  at::Tensor device; // a flat byte tensor over the storage, undefined while only on the host
  at::Tensor host;
  std::size_t nbytes;
  int64_t views = 0;
  int64_t unpacked = 0;
  std::optional<c10::Event> d2h_done, h2d_done;
};

namespace {

std::mutex allocator_mutex;
HostAllocator host_allocator; // empty: default_host_allocation

at::Tensor allocate_host(std::size_t bytes, bool pinned) {
  HostAllocator allocator;
  {
    const std::lock_guard lock(allocator_mutex);
    allocator = host_allocator;
  }
  return allocator ? allocator(bytes, pinned) : default_host_allocation(bytes, pinned);
}

// The storage's data, or null where it has none that can be copied.
const void* storage_data(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || !t.has_storage() ||
      t.unsafeGetTensorImpl()->is_python_dispatch()) {
    return nullptr;
  }
  try {
    return t.storage().data();
  } catch (const c10::Error&) { // a tensor whose storage may not be accessed (a fake tensor)
    return nullptr;
  }
}

} // namespace

class ActivationStore : public std::enable_shared_from_this<ActivationStore> {
public:
  explicit ActivationStore(c10::Device device) : device_(device), cuda_(device.is_cuda()) {
    BLOCKSWAP_CHECK(device.is_cpu() || device.is_cuda(), "offloaded activations: device ",
                    device.str(), " is neither kCPU (the emulated device) nor kCUDA");
    if (cuda_) {
      d2h_ = compat::pool_stream(device_);
      h2d_ = compat::pool_stream(device_);
    }
  }

  c10::Device device() const { return device_; }

  ActivationStats stats() {
    const std::lock_guard lock(mutex_);
    return stats_;
  }

  void reset_stats() {
    const std::lock_guard lock(mutex_);
    stats_ = ActivationStats{0, 0, stats_.device_bytes, stats_.device_bytes};
  }

  // A group opens: the groups the rule names go to host memory, all or nothing.
  std::shared_ptr<Group> open_group(std::string label) {
    const std::lock_guard lock(mutex_);
    forget_freed_groups();
    const ActivationRule::Group id = next_id_++;
    try {
      for (const ActivationRule::Group out : rule_.open(id)) {
        if (const auto group = groups_.at(out).lock()) evict(*group);
      }
    } catch (...) {
      rule_.forget(id);
      throw;
    }
    auto group = std::make_shared<Group>(id, std::move(label));
    groups_.emplace(id, group);
    return group;
  }

  // The storage `t` views, in `group` (made once per storage and group).
  std::shared_ptr<SavedStorage> storage_of(const std::shared_ptr<Group>& group, const at::Tensor& t,
                                           const void* data) {
    const std::lock_guard lock(mutex_);
    auto& weak = storages_[{group->id, reinterpret_cast<std::uintptr_t>(data)}];
    auto storage = weak.lock();
    if (!storage) {
      at::Tensor flat = at::empty({0}, t.options().dtype(at::kByte));
      flat.set_(t.storage(), 0, {static_cast<int64_t>(t.storage().nbytes())}, {1});
      storage = std::make_shared<SavedStorage>(shared_from_this(), group, std::move(flat));
      weak = storage;
      rule_.saved(group->id);
      add(storage->nbytes);
    }
    ++storage->views;
    return storage;
  }

  // Small tensors kept on the device are counted once per storage.
  void keep(const void* key, std::size_t nbytes) {
    const std::lock_guard lock(mutex_);
    auto& [views, bytes] = kept_[key];
    if (views++ == 0) {
      bytes = nbytes;
      add(nbytes);
    }
  }
  void forget_kept(const void* key) {
    const std::lock_guard lock(mutex_);
    const auto it = kept_.find(key);
    if (it == kept_.end()) return;
    if (--it->second.first == 0) {
      stats_.device_bytes -= it->second.second;
      kept_.erase(it);
    }
  }

  void storage_freed(const SavedStorage& s) {
    const std::lock_guard lock(mutex_);
    if (s.device.defined()) stats_.device_bytes -= s.nbytes;
  }

  // Backward reads `s`: its device tensor, brought back first if it is in host memory; the
  // first read of its group starts bringing back the group the rule names ahead.
  at::Tensor unpack(SavedStorage& s, bool first_unpack_of_view) {
    const std::lock_guard lock(mutex_);
    forget_freed_groups(/*storages=*/false); // the group ahead is a live one
    const ActivationRule::Restore restore = rule_.backward_starts(s.group->id);
    if (!s.device.defined()) copy_in(s); // the group's own, as they are read
    if (restore.ahead) {
      if (const auto ahead = groups_.at(*restore.ahead).lock()) bring_back(*ahead);
    }
    at::Tensor device = s.device;
    if (s.h2d_done) {
      const c10::Stream compute = compat::current_stream(device_);
      s.h2d_done->block(compute);
      device.record_stream(compute);
    }
    if (first_unpack_of_view && ++s.unpacked >= s.views && s.host.defined()) {
      s.device = at::Tensor(); // autograd holds what it unpacked
      s.h2d_done.reset();
      s.unpacked = 0; // a graph kept for a second backward unpacks again from the host copy
      stats_.device_bytes -= s.nbytes;
    }
    return device;
  }

private:
  void add(std::size_t nbytes) {
    stats_.device_bytes += nbytes;
    stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, stats_.device_bytes);
  }

  // Groups whose saved tensors were all freed (their graphs ran or were dropped), and with
  // `storages` the storages freed.
  void forget_freed_groups(bool storages = true) {
    for (auto it = groups_.begin(); it != groups_.end();) {
      if (!it->second.expired()) {
        ++it;
        continue;
      }
      rule_.forget(it->first);
      it = groups_.erase(it);
    }
    if (storages) {
      std::erase_if(storages_, [](const auto& entry) { return entry.second.expired(); });
    }
  }

  std::vector<std::shared_ptr<SavedStorage>> live_storages(const Group& group) {
    std::vector<std::shared_ptr<SavedStorage>> live;
    for (auto it = storages_.lower_bound({group.id, 0});
         it != storages_.end() && it->first.first == group.id; ++it) {
      if (auto s = it->second.lock()) live.push_back(std::move(s));
    }
    return live;
  }

  void evict(const Group& group) {
    std::vector<std::shared_ptr<SavedStorage>> storages;
    for (auto& s : live_storages(group)) {
      if (s->device.defined() && !s->host.defined()) storages.push_back(std::move(s));
    }
    if (storages.empty()) return;
    if (cuda_) {
      c10::Event computed(c10::DeviceType::CUDA);
      computed.record(compat::current_stream(device_));
      computed.block(d2h_);
      const c10::StreamGuard on_d2h(d2h_);
      for (const auto& s : storages) {
        copy_out(*s, true);
        s->device.record_stream(d2h_);
        s->d2h_done.emplace(c10::DeviceType::CUDA);
        s->d2h_done->record(d2h_);
      }
    } else {
      for (const auto& s : storages) copy_out(*s, false);
    }
    for (const auto& s : storages) { // only once every copy was enqueued: all or nothing
      s->device = at::Tensor();
      stats_.device_bytes -= s->nbytes;
      stats_.offloaded_bytes += s->nbytes;
    }
  }

  void copy_out(SavedStorage& s, bool pinned) {
    try {
      at::Tensor host = allocate_host(s.nbytes, pinned);
      host.copy_(s.device, /*non_blocking=*/pinned);
      s.host = std::move(host);
    } catch (const std::exception& e) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      throw Error(
          detail::concat("[", s.group->label, "] offloading ", s.nbytes,
                         " bytes of saved activations to host memory failed (",
                         c10_error ? c10_error->what_without_backtrace() : e.what(),
                         "); they stay on the device and nothing was lost. Free host memory, raise "
                         "activation_threshold_bytes, or turn offload_activations off"));
    }
  }

  void bring_back(const Group& group) {
    for (const auto& s : live_storages(group)) {
      if (!s->device.defined() && s->host.defined() && s->views > s->unpacked) copy_in(*s);
    }
  }

  void copy_in(SavedStorage& s) {
    at::Tensor device;
    if (cuda_) {
      device = at::empty({static_cast<int64_t>(s.nbytes)},
                         at::TensorOptions().dtype(at::kByte).device(device_));
      c10::Event allocated(c10::DeviceType::CUDA); // the memory's earlier users
      allocated.record(compat::current_stream(device_));
      allocated.block(h2d_);
      if (s.d2h_done) s.d2h_done->block(h2d_);
      {
        const c10::StreamGuard on_h2d(h2d_);
        device.copy_(s.host, /*non_blocking=*/true);
      }
      device.record_stream(h2d_);
      s.h2d_done.emplace(c10::DeviceType::CUDA);
      s.h2d_done->record(h2d_);
    } else {
      device = s.host.clone();
    }
    s.device = std::move(device);
    add(s.nbytes);
    stats_.restored_bytes += s.nbytes;
  }

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

namespace {

std::shared_ptr<ActivationStore> store_for(c10::Device device) {
  device = compat::with_index(device);
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<ActivationStore>> stores;
  const std::lock_guard lock(mutex);
  auto& store = stores[device.str()];
  if (!store) store = std::make_shared<ActivationStore>(device);
  return store;
}

} // namespace

SavedStorage::SavedStorage(std::shared_ptr<ActivationStore> owner, std::shared_ptr<Group> saved_in,
                           at::Tensor bytes)
    : store(std::move(owner)), group(std::move(saved_in)), device(std::move(bytes)),
      nbytes(static_cast<std::size_t>(device.numel())) {}

SavedStorage::~SavedStorage() {
  store->storage_freed(*this);
}

SavedActivation::SavedActivation(std::shared_ptr<ActivationStore> store, const at::Tensor& kept,
                                 const void* counted)
    : store_(std::move(store)), kept_(kept), counted_(counted) {}

SavedActivation::SavedActivation(std::shared_ptr<SavedStorage> storage, const at::Tensor& tensor)
    : storage_(std::move(storage)), sizes_(tensor.sizes().vec()), strides_(tensor.strides().vec()),
      offset_(tensor.storage_offset()), dtype_(tensor.scalar_type()),
      version_(compat::version_counter(tensor)), saved_version_(version_->current_version()) {}

SavedActivation::~SavedActivation() {
  if (counted_ != nullptr) store_->forget_kept(counted_);
}

at::Tensor SavedActivation::unpack() {
  if (!storage_) return kept_;
  const uint32_t now = version_->current_version();
  BLOCKSWAP_CHECK(now == saved_version_, "[", storage_->group->label,
                  "] a tensor saved for backward was modified by an inplace operation after it "
                  "was saved (version ",
                  saved_version_, ", now ", now,
                  "); with offloaded activations backward reads the value copied to host memory. "
                  "Clone it before writing it in place");
  const at::Tensor device = storage_->store->unpack(*storage_, !unpacked_);
  unpacked_ = true;
  at::Tensor view = at::empty({0}, device.options().dtype(dtype_));
  view.set_(device.storage(), offset_, sizes_, strides_);
  return view;
}

std::shared_ptr<ActivationGroup> ActivationGroup::open(c10::Device device, std::string label,
                                                       Weights weights,
                                                       std::size_t threshold_bytes) {
  std::shared_ptr<ActivationGroup> group(new ActivationGroup());
  try {
    group->store_ = store_for(device);
  } catch (const c10::Error& e) { // a LibTorch without that device's streams
    throw Error(detail::concat("[", label, "] offloaded activations on ", device.str(),
                               ": this LibTorch cannot use it (", e.what_without_backtrace(),
                               "); use the device the model computes on"));
  }
  group->weights_ = std::move(weights);
  group->threshold_bytes_ = threshold_bytes;
  group->group_ = group->store_->open_group(std::move(label)); // may throw: nothing changed
  return group;
}

std::shared_ptr<SavedActivation> ActivationGroup::pack(const at::Tensor& tensor) {
  ActivationStore& store = *store_;
  const void* data = storage_data(tensor);
  if (data == nullptr || tensor.device() != store.device() || compat::in_backward()) {
    return std::make_shared<SavedActivation>(store_, tensor, nullptr);
  }
  if (!weight_storages_) weight_storages_ = weights_ ? weights_() : decltype(weights_()){};
  if (weight_storages_->contains(data)) { // a view of a weight: a slot, a host copy, an adapter
    return std::make_shared<SavedActivation>(store_, tensor, nullptr);
  }
  const std::size_t nbytes = tensor.storage().nbytes();
  if (nbytes < threshold_bytes_) {
    store.keep(data, nbytes);
    return std::make_shared<SavedActivation>(store_, tensor, data);
  }
  return std::make_shared<SavedActivation>(store.storage_of(group_, tensor, data), tensor);
}

std::shared_ptr<SavedActivation> ActivationGroup::keep(const at::Tensor& tensor) {
  const void* data = storage_data(tensor);
  if (data == nullptr || tensor.device() != store_->device()) {
    return std::make_shared<SavedActivation>(store_, tensor, nullptr);
  }
  store_->keep(data, tensor.storage().nbytes());
  return std::make_shared<SavedActivation>(store_, tensor, data);
}

ActivationStats store_stats(c10::Device device) {
  return store_for(device)->stats();
}

void reset_store_stats(c10::Device device) {
  store_for(device)->reset_stats();
}

void set_activation_host_allocator(HostAllocator allocator) {
  const std::lock_guard lock(allocator_mutex);
  host_allocator = std::move(allocator);
}

at::Tensor default_host_allocation(std::size_t bytes, bool pinned) {
  return at::empty({static_cast<int64_t>(bytes)},
                   at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
}

} // namespace blockswap::torch_frontend
