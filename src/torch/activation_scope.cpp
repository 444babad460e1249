// ActivationScope (blockswap/torch/activation_scope.hpp): the C++ front end's groups of the
// activation store, handed to autograd through its engine (Note [saved-tensor hooks in C++] in
// torch_compat_autograd.cpp) while a scope is open on the saving thread.
#include "blockswap/torch/activation_scope.hpp"

#include <ATen/core/grad_mode.h>

#include <unordered_set>
#include <utility>

#include "activation_store.hpp"
#include "torch_compat_autograd.hpp"

namespace blockswap {

struct ActivationScope::State {
  std::shared_ptr<torch_frontend::ActivationGroup> group;
};

namespace torch_frontend {
namespace {

thread_local std::shared_ptr<ActivationScope::State> current_scope;

// One saved tensor's hooks: the pack and unpack of the open scope's group.
class ScopeHooks final : public compat::SavedTensorHooks {
public:
  explicit ScopeHooks(std::shared_ptr<ActivationGroup> group) : group_(std::move(group)) {}
  void pack(const at::Tensor& tensor) override { saved_ = group_->pack(tensor); }
  at::Tensor unpack() override { return saved_->unpack(); }

private:
  std::shared_ptr<ActivationGroup> group_;
  std::shared_ptr<SavedActivation> saved_;
};

std::unique_ptr<compat::SavedTensorHooks> scope_hooks() {
  if (!current_scope) return nullptr;
  return std::make_unique<ScopeHooks>(current_scope->group);
}

} // namespace

void install_saved_tensor_hooks() {
  compat::install_saved_tensor_hooks(&scope_hooks);
}

} // namespace torch_frontend

ActivationScope::ActivationScope(c10::Device device, std::string label,
                                 const std::vector<at::Tensor>& weights,
                                 std::size_t threshold_bytes, std::shared_ptr<Device> counted_by) {
  if (!at::GradMode::is_enabled() || torch_frontend::compat::in_backward()) return;
  torch_frontend::install_saved_tensor_hooks();
  // Their storages where they are while the block computes, taken at the first pack: a scope
  // may open before the block's wait binds its weights to a slot, and a saved view of the slot
  // taken for an activation would be copied while the slot is reloaded.
  auto weight_storages = [weights] {
    std::unordered_set<const void*> storages;
    for (const auto& t : weights) {
      if (t.defined() && t.has_storage() && t.storage().data() != nullptr) {
        storages.insert(t.storage().data());
      }
    }
    return storages;
  };
  auto state = std::make_shared<State>();
  state->group = torch_frontend::ActivationGroup::open(
      device, std::move(label), std::move(weight_storages), threshold_bytes, counted_by);
  state_ = std::move(state);
  previous_ = std::exchange(torch_frontend::current_scope, state_);
}

ActivationScope::~ActivationScope() {
  if (state_) torch_frontend::current_scope = std::move(previous_);
}

ActivationStats activation_stats(c10::Device device) {
  return torch_frontend::store_stats(device);
}

void reset_activation_stats(c10::Device device) {
  torch_frontend::reset_store_stats(device);
}

} // namespace blockswap
