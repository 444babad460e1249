// Note [offloaded activations]
// What a block's forward saves for backward is recorded by *storage*: several views of one
// storage (a chunk, a transpose) are copied once, and each comes back with its own sizes,
// strides and offset on the restored storage, so backward's kernels see the layout they would
// have seen. A saved tensor stays where it is when its storage is under the threshold, is not a
// plain strided tensor on the scope's device, or is one of the block's weights, buffers or
// adapters (slots and host copies that blockswap already manages).
//
// A scope's group of storages is copied to host memory when the *next* scope opens, under that
// block's compute: the group open when backward starts, the last block's, never leaves the
// device. In backward, the first unpack of a group starts restoring the group saved before it
// (the groups of every offloader of the device in the order they were saved: FLUX's single
// blocks hand over to its double blocks), so that each restore runs under one block's backward.
// A storage's device copy is dropped once every view of it was unpacked (autograd holds what it
// unpacked while it needs it); a graph kept for a second backward unpacks again from the host.
//
// On a GPU the copies run on two side streams of torch's pool, device->host and host->device,
// ordered by events against the compute stream; record_stream keeps the allocator from reusing
// memory a side stream still reads or writes. On the emulated device (kCPU) they are
// synchronous copies. The Python package implements the same rules (blockswap/_activations.py).
//
// Note [saved-tensor hooks in C++]
// LibTorch's default saved-tensor hooks (at::SavedTensorDefaultHooks) hold Python objects. What
// a C++ program can reach is the autograd engine: every SavedVariable asks
// Engine::get_default_engine().get_default_saved_variable_hooks() for hooks as it is made, and
// the engine is replaceable (set_default_engine_stub, as torch's Python engine does). blockswap's
// engine is LibTorch's own, with that one method answering while an ActivationScope is open on
// the saving thread.
#include "activation_offload.hpp"

#include <ATen/SavedTensorHooks.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <map>
#include <mutex>
#include <optional>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "blockswap/core/error.hpp"
#include "blockswap/torch/activation_scope.hpp"

namespace blockswap {
namespace torch_frontend {
namespace {

std::mutex allocator_mutex;
HostAllocator host_allocator; // empty: at::empty

at::Tensor allocate_host(std::size_t bytes, bool pinned) {
  {
    const std::lock_guard lock(allocator_mutex);
    if (host_allocator) return host_allocator(bytes, pinned);
  }
  return at::empty({static_cast<int64_t>(bytes)},
                   at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
}

bool in_backward() {
  return torch::autograd::get_current_graph_task_id() != -1;
}

class Store;

struct Group {
  explicit Group(std::string name) : label(std::move(name)) {}
  std::string label;
  bool saved = false; // a storage was recorded in it (a group of small tensors has none)
  bool evicted = false;
  bool restoring = false;
};

// One saved storage: on the device until its group is evicted, then a host copy, then,
// restored, a device copy again until every view of it was unpacked.
struct Storage {
  Storage(std::shared_ptr<Store> owner, std::shared_ptr<Group> saved_in, at::Tensor bytes);
  ~Storage();
  std::shared_ptr<Store> store;
  std::shared_ptr<Group> group;
  at::Tensor device; // a flat byte tensor over the storage, undefined while only on the host
  at::Tensor host;
  std::size_t nbytes;
  int64_t views = 0;
  int64_t unpacked = 0;
  std::optional<c10::Event> d2h_done, h2d_done;
};

// The saved activations of every offloader and scope of one torch device.
class Store : public std::enable_shared_from_this<Store> {
public:
  explicit Store(c10::Device device) : device_(device), cuda_(device.is_cuda()) {
    BLOCKSWAP_CHECK(device.is_cpu() || device.is_cuda(), "offloaded activations: device ",
                    device.str(), " is neither kCPU (the emulated device) nor kCUDA");
    if (cuda_) {
      const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      d2h_ = guard.getStreamFromGlobalPool(device_);
      h2d_ = guard.getStreamFromGlobalPool(device_);
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

  // A scope opens: every earlier group still on the device goes to host memory, and a new group
  // starts.
  std::shared_ptr<Group> open_group(std::string label) {
    const std::lock_guard lock(mutex_);
    std::erase_if(groups_, [](const std::weak_ptr<Group>& g) { return g.expired(); });
    for (const auto& weak : groups_) {
      const auto earlier = weak.lock();
      if (earlier && !earlier->evicted && !earlier->restoring) evict(*earlier);
    }
    auto group = std::make_shared<Group>(std::move(label));
    groups_.push_back(group);
    return group;
  }

  // The storage `tensor` views, in `group` (made once per storage and group).
  std::shared_ptr<Storage> storage_of(const std::shared_ptr<Group>& group, const at::Tensor& t) {
    const std::lock_guard lock(mutex_);
    const auto key = std::make_pair(group.get(), t.storage().data());
    auto& weak = storages_[key];
    auto storage = weak.lock();
    if (!storage) {
      at::Tensor flat = at::empty({0}, t.options().dtype(at::kByte));
      flat.set_(t.storage(), 0, {static_cast<int64_t>(t.storage().nbytes())}, {1});
      storage = std::make_shared<Storage>(shared_from_this(), group, std::move(flat));
      weak = storage;
      group->saved = true;
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

  void storage_freed(const Storage& s) {
    const std::lock_guard lock(mutex_);
    if (s.device.defined()) stats_.device_bytes -= s.nbytes;
  }

  // Block backward: the device tensor of `s`, restoring it (and its group's predecessor) first.
  at::Tensor unpack(Storage& s, bool first_unpack_of_view) {
    const std::lock_guard lock(mutex_);
    Group& group = *s.group;
    if (!group.restoring) {
      group.restoring = true;
      if (const auto previous = previous_of(group)) restore(*previous);
    }
    if (!s.device.defined()) copy_in(s);
    at::Tensor device = s.device;
    if (s.h2d_done) {
      const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      const c10::Stream compute = guard.getStream(device_);
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

  std::vector<std::shared_ptr<Storage>> live_storages(const Group& group) {
    std::vector<std::shared_ptr<Storage>> live;
    for (auto& [key, weak] : storages_) {
      if (key.first != &group) continue;
      if (auto s = weak.lock()) live.push_back(std::move(s));
    }
    std::erase_if(storages_, [](const auto& entry) { return entry.second.expired(); });
    return live;
  }

  void evict(Group& group) {
    group.evicted = true;
    std::vector<std::shared_ptr<Storage>> storages;
    for (auto& s : live_storages(group)) {
      if (s->device.defined() && !s->host.defined()) storages.push_back(std::move(s));
    }
    if (storages.empty()) return;
    if (cuda_) {
      const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      c10::Event computed(c10::DeviceType::CUDA);
      computed.record(guard.getStream(device_));
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

  void copy_out(Storage& s, bool pinned) {
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

  void restore(const Group& group) {
    for (const auto& s : live_storages(group)) {
      if (!s->device.defined() && s->host.defined() && s->views > s->unpacked) copy_in(*s);
    }
  }

  void copy_in(Storage& s) {
    at::Tensor device;
    if (cuda_) {
      const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      device = at::empty({static_cast<int64_t>(s.nbytes)},
                         at::TensorOptions().dtype(at::kByte).device(device_));
      c10::Event allocated(c10::DeviceType::CUDA); // the memory's earlier users
      allocated.record(guard.getStream(device_));
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

  // The group saved last before `group` that went to host memory and is not coming back yet.
  std::shared_ptr<Group> previous_of(const Group& group) {
    std::shared_ptr<Group> previous;
    for (const auto& weak : groups_) {
      auto g = weak.lock();
      if (g.get() == &group) return previous;
      if (g && g->saved && g->evicted && !g->restoring) previous = std::move(g);
    }
    return nullptr;
  }

  const c10::Device device_;
  const bool cuda_;
  c10::Stream d2h_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  c10::Stream h2d_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  std::recursive_mutex mutex_; // a Storage may die while the store holds it
  ActivationStats stats_;
  std::vector<std::weak_ptr<Group>> groups_; // in the order they were saved
  std::map<std::pair<const Group*, const void*>, std::weak_ptr<Storage>> storages_;
  std::unordered_map<const void*, std::pair<int64_t, std::size_t>> kept_;
};

Storage::Storage(std::shared_ptr<Store> owner, std::shared_ptr<Group> saved_in, at::Tensor bytes)
    : store(std::move(owner)), group(std::move(saved_in)), device(std::move(bytes)),
      nbytes(static_cast<std::size_t>(device.numel())) {}

Storage::~Storage() {
  store->storage_freed(*this);
}

std::shared_ptr<Store> store_for(c10::Device device) {
  if (device.is_cuda() && !device.has_index()) {
    const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    device = guard.getDevice();
  }
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<Store>> stores;
  const std::lock_guard lock(mutex);
  auto& store = stores[device.str()];
  if (!store) store = std::make_shared<Store>(device);
  return store;
}

// One saved tensor's hooks.
class Hooks final : public torch::autograd::SavedVariableHooks {
public:
  explicit Hooks(std::shared_ptr<ActivationScope::State> scope) : scope_(std::move(scope)) {}
  ~Hooks() override;
  void call_pack_hook(const at::Tensor& tensor) override;
  at::Tensor call_unpack_hook() override;

private:
  std::shared_ptr<ActivationScope::State> scope_;
  at::Tensor kept_;
  const void* counted_ = nullptr; // kept_'s storage, counted on the device
  std::shared_ptr<Storage> storage_;
  std::vector<int64_t> sizes_, strides_;
  int64_t offset_ = 0;
  at::ScalarType dtype_ = at::kByte;
  std::optional<c10::VariableVersion> version_;
  uint32_t saved_version_ = 0;
  bool unpacked_ = false;
};

} // namespace
} // namespace torch_frontend

struct ActivationScope::State {
  std::shared_ptr<torch_frontend::Store> store;
  std::shared_ptr<torch_frontend::Group> group;
  std::vector<at::Tensor> weight_tensors;
  // Their storages where they are while the block computes, taken at the first pack: a scope
  // may open before the block's wait binds its weights to a slot, and a saved view of the slot
  // taken for an activation would be copied while the slot is reloaded.
  std::optional<std::unordered_set<const void*>> weights;
  std::size_t threshold_bytes = 0;

  const std::unordered_set<const void*>& weight_storages() {
    if (!weights) {
      weights.emplace();
      for (const auto& t : weight_tensors) {
        if (t.defined() && t.has_storage() && t.storage().data() != nullptr) {
          weights->insert(t.storage().data());
        }
      }
    }
    return *weights;
  }
};

namespace torch_frontend {
namespace {

thread_local std::shared_ptr<ActivationScope::State> current_scope;

Hooks::~Hooks() {
  if (counted_ != nullptr) scope_->store->forget_kept(counted_);
}

void Hooks::call_pack_hook(const at::Tensor& tensor) {
  Store& store = *scope_->store;
  if (!tensor.defined() || tensor.layout() != at::kStrided || !tensor.has_storage() ||
      tensor.device() != store.device() || tensor.storage().data() == nullptr) {
    kept_ = tensor;
    return;
  }
  const void* data = tensor.storage().data();
  const std::size_t nbytes = tensor.storage().nbytes();
  if (scope_->weight_storages().contains(data)) {
    kept_ = tensor; // a view of a weight: a slot, a host copy, an adapter
    return;
  }
  if (nbytes < scope_->threshold_bytes) {
    kept_ = tensor;
    counted_ = data;
    store.keep(data, nbytes);
    return;
  }
  storage_ = store.storage_of(scope_->group, tensor);
  sizes_ = tensor.sizes().vec();
  strides_ = tensor.strides().vec();
  offset_ = tensor.storage_offset();
  dtype_ = tensor.scalar_type();
  version_ = torch::autograd::impl::version_counter(tensor);
  saved_version_ = version_->current_version();
}

at::Tensor Hooks::call_unpack_hook() {
  if (!storage_) return kept_;
  const uint32_t now = version_->current_version();
  BLOCKSWAP_CHECK(now == saved_version_, "[", storage_->group->label,
                  "] a tensor saved for backward was modified by an inplace operation after it "
                  "was saved (version ",
                  saved_version_, ", now ", now,
                  "); with offloaded activations backward reads the value copied to host memory. "
                  "Clone it before writing it in place");
  const at::Tensor device = scope_->store->unpack(*storage_, !unpacked_);
  unpacked_ = true;
  at::Tensor view = at::empty({0}, device.options().dtype(dtype_));
  view.set_(device.storage(), offset_, sizes_, strides_);
  return view;
}

class HookingEngine final : public torch::autograd::Engine {
public:
  HookingEngine() = default;
  ~HookingEngine() override { stop(); }
  HookingEngine(const HookingEngine&) = delete;
  HookingEngine& operator=(const HookingEngine&) = delete;

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (!current_scope || !at::SavedTensorDefaultHooks::is_enabled() || in_backward()) {
      return nullptr;
    }
    return std::make_unique<Hooks>(current_scope);
  }
};

torch::autograd::Engine& hooking_engine() {
  static HookingEngine engine;
  return engine;
}

} // namespace

void install_saved_tensor_hooks() {
  static std::mutex mutex;
  const std::lock_guard lock(mutex);
  torch::autograd::Engine& engine = torch::autograd::Engine::get_default_engine();
  if (&engine == &hooking_engine()) return;
  BLOCKSWAP_CHECK(typeid(engine) == typeid(torch::autograd::Engine),
                  "offload_activations: this process's autograd engine is not LibTorch's own (",
                  typeid(engine).name(),
                  "; a Python process has torch's Python engine). From Python, use "
                  "blockswap.ModelOffloader(..., offload_activations=True)");
  torch::autograd::set_default_engine_stub(&hooking_engine);
}

void set_activation_host_allocator(HostAllocator allocator) {
  const std::lock_guard lock(allocator_mutex);
  host_allocator = std::move(allocator);
}

} // namespace torch_frontend

ActivationScope::ActivationScope(c10::Device device, std::string label,
                                 const std::vector<at::Tensor>& weights,
                                 std::size_t threshold_bytes) {
  if (!at::GradMode::is_enabled() || torch_frontend::in_backward()) return;
  torch_frontend::install_saved_tensor_hooks();
  auto state = std::make_shared<State>();
  try {
    state->store = torch_frontend::store_for(device);
  } catch (const c10::Error& e) { // a LibTorch without that device's streams
    throw Error(detail::concat("[", label, "] offloaded activations on ", device.str(),
                               ": this LibTorch cannot use it (", e.what_without_backtrace(),
                               "); use the device the model computes on"));
  }
  state->threshold_bytes = threshold_bytes;
  state->weight_tensors = weights;
  state->group = state->store->open_group(std::move(label)); // may throw: nothing changed yet
  state_ = std::move(state);
  previous_ = std::exchange(torch_frontend::current_scope, state_);
}

ActivationScope::~ActivationScope() {
  if (state_) torch_frontend::current_scope = std::move(previous_);
}

ActivationStats activation_stats(c10::Device device) {
  return torch_frontend::store_for(device)->stats();
}

void reset_activation_stats(c10::Device device) {
  torch_frontend::store_for(device)->reset_stats();
}

} // namespace blockswap
