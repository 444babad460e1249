// The activation store's front-end side (activation_store.hpp): a group opened around a block's
// forward, autograd's pack hook on it, and each saved tensor's unpack (Note [saved storages] in
// activation_store.cpp).
#include <ATen/ops/empty.h>

#include "activation_store.hpp"
#include "blockswap/core/error.hpp"
#include "torch_compat.hpp"
#include "torch_compat_autograd.hpp"

namespace blockswap::torch_frontend {
namespace {

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
                                                       Weights weights, std::size_t threshold_bytes,
                                                       std::weak_ptr<Device> counted_by) {
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
  // May throw: nothing changed then.
  group->group_ = group->store_->open_group(std::move(label), std::move(counted_by));
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

} // namespace blockswap::torch_frontend
