// The autograd internals blockswap reaches for offloaded activations in a LibTorch program (part
// of torch_compat: nothing else includes torch/csrc/autograd's engine, graph-task or
// saved-variable headers). Implementer-only (src/torch).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <memory>

namespace blockswap::torch_frontend::compat {

// One saved tensor's pair of hooks as autograd calls them: pack once, when the tensor is saved;
// unpack at each read in backward (a graph kept for a second backward reads again).
class SavedTensorHooks {
public:
  virtual ~SavedTensorHooks() = default;
  virtual void pack(const at::Tensor& tensor) = 0;
  virtual at::Tensor unpack() = 0;
};

// Asked, on the saving thread, for the hooks of each tensor autograd saves outside a backward
// while saved-tensor hooks are enabled; null: the tensor is saved as autograd saves it.
using SavedTensorHooksSource = std::unique_ptr<SavedTensorHooks> (*)();

// Makes autograd ask `source` for the hooks of every tensor it saves from now on, in this whole
// process and for the rest of it (Note [saved-tensor hooks in C++] in torch_compat_autograd.cpp):
// the process's default autograd engine becomes an instance of LibTorch's own engine class that
// answers one more question. Idempotent; `source` must be the same at every call. Throws Error,
// changing nothing, where the engine in charge is not LibTorch's own: a Python process (torch's
// Python engine), or another library that replaced the engine first.
void install_saved_tensor_hooks(SavedTensorHooksSource source);

// Whether autograd's engine is running a backward on this thread (a reentrant checkpoint's
// recompute saves inside one).
bool in_backward();

// The version counter `tensor` shares with its views: an in-place write bumps it.
c10::VariableVersion version_counter(const at::Tensor& tensor);

} // namespace blockswap::torch_frontend::compat
