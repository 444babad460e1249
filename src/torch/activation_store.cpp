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
// ordered by events against torch's current stream (docs/performance.md, "Offloaded activations
// and the Device": why not the Device's copy stream); record_stream keeps torch's allocator from
// reusing device memory a side stream still reads or writes. The host copies are buffers of
// exactly their storage's size from the pool of the group's Device (Device::pooled_host, Note
// [exact host memory] in src/device/host_memory.cpp), on the emulated device as on a GPU; a
// group without a Device (an ActivationScope given none) uses torch's host allocators. On the
// emulated device (kCPU) the copies are synchronous.
#include "activation_store.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/StreamGuard.h>

#include <algorithm>

#include "blockswap/core/error.hpp"
#include "blockswap/device/device.hpp"
#include "torch_compat.hpp"

namespace blockswap::torch_frontend {
namespace {

std::mutex allocator_mutex;
HostAllocator host_allocator; // empty: default_host_allocation

} // namespace

ActivationStore::ActivationStore(c10::Device device) : device_(device), cuda_(device.is_cuda()) {
  BLOCKSWAP_CHECK(device.is_cpu() || device.is_cuda(), "offloaded activations: device ",
                  device.str(), " is neither kCPU (the emulated device) nor kCUDA");
  if (cuda_) {
    d2h_ = compat::pool_stream(device_);
    h2d_ = compat::pool_stream(device_);
  }
}

ActivationStats ActivationStore::stats() {
  const std::lock_guard lock(mutex_);
  return stats_;
}

void ActivationStore::reset_stats() {
  const std::lock_guard lock(mutex_);
  stats_ = ActivationStats{0, 0, stats_.device_bytes, stats_.device_bytes};
}

std::shared_ptr<Group> ActivationStore::open_group(std::string label,
                                                   std::weak_ptr<Device> counted_by) {
  const std::lock_guard lock(mutex_);
  forget_freed_groups(/*storages=*/true);
  const ActivationRule::Group id = next_id_++;
  try {
    for (const ActivationRule::Group out : rule_.open(id)) {
      if (const auto group = groups_.at(out).lock()) evict(*group);
    }
  } catch (...) {
    rule_.forget(id);
    throw;
  }
  auto group = std::make_shared<Group>(id, std::move(label), std::move(counted_by));
  groups_.emplace(id, group);
  return group;
}

std::shared_ptr<SavedStorage> ActivationStore::storage_of(const std::shared_ptr<Group>& group,
                                                          const at::Tensor& t, const void* data) {
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

void ActivationStore::keep(const void* data, std::size_t nbytes) {
  const std::lock_guard lock(mutex_);
  auto& [views, bytes] = kept_[data];
  if (views++ == 0) {
    bytes = nbytes;
    add(nbytes);
  }
}

void ActivationStore::forget_kept(const void* data) {
  const std::lock_guard lock(mutex_);
  const auto it = kept_.find(data);
  if (it == kept_.end()) return;
  if (--it->second.first == 0) {
    stats_.device_bytes -= it->second.second;
    kept_.erase(it);
  }
}

void ActivationStore::storage_freed(const SavedStorage& s) {
  const std::lock_guard lock(mutex_);
  if (s.device.defined()) stats_.device_bytes -= s.nbytes;
  if (s.host.defined()) {
    if (const auto counter = s.group->counted_by.lock()) counter->count_host_freed(s.nbytes);
  }
}

at::Tensor ActivationStore::unpack(SavedStorage& s, bool first_unpack_of_view) {
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

void ActivationStore::add(std::size_t nbytes) {
  stats_.device_bytes += nbytes;
  stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, stats_.device_bytes);
}

// Groups whose saved tensors were all freed (their graphs ran or were dropped), and with
// `storages` the storages freed.
void ActivationStore::forget_freed_groups(bool storages) {
  for (auto it = groups_.begin(); it != groups_.end();) {
    if (!it->second.expired()) {
      ++it;
      continue;
    }
    rule_.forget(it->first);
    it = groups_.erase(it);
  }
  if (storages) std::erase_if(storages_, [](const auto& entry) { return entry.second.expired(); });
}

std::vector<std::shared_ptr<SavedStorage>> ActivationStore::live_storages(const Group& group) {
  std::vector<std::shared_ptr<SavedStorage>> live;
  for (auto it = storages_.lower_bound({group.id, 0});
       it != storages_.end() && it->first.first == group.id; ++it) {
    if (auto s = it->second.lock()) live.push_back(std::move(s));
  }
  return live;
}

void ActivationStore::evict(const Group& group) {
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
    try {
      for (const auto& s : storages) {
        copy_out(*s, true);
        s->device.record_stream(d2h_);
        s->d2h_done.emplace(c10::DeviceType::CUDA);
        s->d2h_done->record(d2h_);
      }
    } catch (...) {
      drop_host_copies(storages);
      throw;
    }
  } else {
    try {
      for (const auto& s : storages) copy_out(*s, false);
    } catch (...) {
      drop_host_copies(storages);
      throw;
    }
  }
  const auto counter = group.counted_by.lock();
  for (const auto& s : storages) { // only once every copy was enqueued: all or nothing
    s->device = at::Tensor();
    stats_.device_bytes -= s->nbytes;
    stats_.offloaded_bytes += s->nbytes;
    if (counter) counter->count_d2h(s->nbytes);
  }
}

// A copy failed: the copies made before it are dropped, so that nothing changed. A host buffer
// whose copy is in flight goes back to the Device's pool, where only a later copy on the same
// stream writes into it, and a buffer the pool frees is freed by cudaFreeHost, which waits for
// the device (torch's pinned allocator keeps its own until the copy ends).
void ActivationStore::drop_host_copies(const std::vector<std::shared_ptr<SavedStorage>>& storages) {
  for (const auto& s : storages) {
    s->host = at::Tensor();
    s->d2h_done.reset();
  }
}

void ActivationStore::copy_out(SavedStorage& s, bool pinned) {
  try {
    at::Tensor host = allocate_host(s.nbytes, pinned, s.group->counted_by.lock().get());
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

void ActivationStore::bring_back(const Group& group) {
  for (const auto& s : live_storages(group)) {
    if (!s->device.defined() && s->host.defined() && s->views > s->unpacked) copy_in(*s);
  }
}

void ActivationStore::copy_in(SavedStorage& s) {
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
  if (const auto counter = s.group->counted_by.lock()) counter->count_h2d(s.nbytes);
}

std::shared_ptr<ActivationStore> store_for(c10::Device device) {
  device = compat::with_index(device);
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<ActivationStore>> stores;
  const std::lock_guard lock(mutex);
  auto& store = stores[device.str()];
  if (!store) store = std::make_shared<ActivationStore>(device);
  return store;
}

void set_activation_host_allocator(HostAllocator allocator) {
  const std::lock_guard lock(allocator_mutex);
  host_allocator = std::move(allocator);
}

at::Tensor default_host_allocation(std::size_t bytes, bool pinned) {
  return at::empty({static_cast<int64_t>(bytes)},
                   at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
}

at::Tensor allocate_host(std::size_t bytes, bool pinned, Device* device) {
  HostAllocator allocator;
  {
    const std::lock_guard lock(allocator_mutex); // not held while it runs: it may be Python's
    allocator = host_allocator;
  }
  if (allocator) return allocator(bytes, pinned);
  if (device == nullptr) return default_host_allocation(bytes, pinned);
  auto buffer = std::make_shared<Buffer>(device->pooled_host(bytes));
  return at::from_blob(
      buffer->data(), {static_cast<int64_t>(bytes)},
      [buffer](void*) mutable { buffer.reset(); }, // gives it back to the pool
      at::TensorOptions().dtype(at::kByte));
}

} // namespace blockswap::torch_frontend
