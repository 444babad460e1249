// Note [saved-tensor hooks in C++]
// LibTorch's default saved-tensor hooks (at::SavedTensorDefaultHooks) hold Python objects, so a
// C++ program cannot push any. What it can reach is the autograd engine: every SavedVariable
// asks Engine::get_default_engine().get_default_saved_variable_hooks() for hooks as it is made,
// and the default engine is replaceable (set_default_engine_stub, the entry point torch's Python
// engine uses: PythonEngine answers that same method with the Python hook stack). blockswap's
// engine is an instance of LibTorch's own class whose one override answers with the hooks of
// the source it was given (activation_scope.cpp: while an ActivationScope is open on the saving
// thread). Graph execution, ready queues and device threads are torch's inherited code.
//
// It is process-wide and permanent: every later backward, blockswap's or not, runs on it, and it
// is a second engine instance beside the base one that get_default_engine() made first (torch
// expects one; two have run side by side without trouble on 2.7 to 2.13). Where the engine in
// charge is not LibTorch's own class, installing is refused rather than composed: in a Python
// process it is torch's Python engine (the Python package uses the public saved_tensors_hooks
// instead, python/blockswap/_activations.py), elsewhere another library's.
#include "torch_compat_autograd.hpp"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <mutex>
#include <typeinfo>
#include <utility>

#include "blockswap/core/error.hpp"

namespace blockswap::torch_frontend::compat {
namespace {

std::atomic<SavedTensorHooksSource> hooks_source{nullptr};

// One saved tensor's hooks, as autograd's SavedVariable holds them.
class SavedVariableHooks final : public torch::autograd::SavedVariableHooks {
public:
  explicit SavedVariableHooks(std::unique_ptr<SavedTensorHooks> hooks) : hooks_(std::move(hooks)) {}
  void call_pack_hook(const at::Tensor& tensor) override { hooks_->pack(tensor); }
  at::Tensor call_unpack_hook() override { return hooks_->unpack(); }

private:
  std::unique_ptr<SavedTensorHooks> hooks_;
};

class HookingEngine final : public torch::autograd::Engine {
public:
  HookingEngine() = default;
  ~HookingEngine() override { stop(); }
  HookingEngine(const HookingEngine&) = delete;
  HookingEngine& operator=(const HookingEngine&) = delete;

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    const SavedTensorHooksSource source = hooks_source.load();
    if (source == nullptr || !at::SavedTensorDefaultHooks::is_enabled() || in_backward()) {
      return nullptr;
    }
    std::unique_ptr<SavedTensorHooks> hooks = source();
    if (!hooks) return nullptr;
    return std::make_unique<SavedVariableHooks>(std::move(hooks));
  }
};

torch::autograd::Engine& hooking_engine() {
  static HookingEngine engine;
  return engine;
}

} // namespace

void install_saved_tensor_hooks(SavedTensorHooksSource source) {
  BLOCKSWAP_ASSERT(source != nullptr);
  static std::mutex mutex;
  const std::lock_guard lock(mutex);
  if (const SavedTensorHooksSource installed = hooks_source.load()) {
    BLOCKSWAP_ASSERT(installed == source, "one source of saved-tensor hooks only");
    return;
  }
  torch::autograd::Engine& engine = torch::autograd::Engine::get_default_engine();
  BLOCKSWAP_CHECK(typeid(engine) == typeid(torch::autograd::Engine),
                  "offloaded activations in C++ replace this process's autograd engine, and the "
                  "engine in charge is not LibTorch's own (",
                  typeid(engine).name(),
                  "): a Python process has torch's Python engine, or another library replaced "
                  "it first; blockswap leaves it in charge. From Python, use "
                  "blockswap.ModelOffloader(..., offload_activations=True)");
  hooks_source.store(source);
  torch::autograd::set_default_engine_stub(&hooking_engine);
}

bool in_backward() {
  return torch::autograd::get_current_graph_task_id() != -1;
}

c10::VariableVersion version_counter(const at::Tensor& tensor) {
  return torch::autograd::impl::version_counter(tensor);
}

} // namespace blockswap::torch_frontend::compat
