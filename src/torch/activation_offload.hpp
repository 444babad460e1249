// Activation offloading for the LibTorch front end (ActivationScope in
// blockswap/torch/activation_scope.hpp). Implementer-only (src/torch).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>

namespace blockswap::torch_frontend {

// Makes LibTorch's autograd engine ask blockswap for the hooks of each tensor it saves (Note
// [saved-tensor hooks in C++] in activation_offload.cpp). Idempotent. Throws blockswap::Error
// where an engine other than LibTorch's own is in charge (a Python process).
void install_saved_tensor_hooks();

// How host memory for one storage's copy is allocated: `pinned` on a GPU. Tests replace it to
// make a copy fail; an empty function restores the default.
using HostAllocator = std::function<at::Tensor(std::size_t bytes, bool pinned)>;
void set_activation_host_allocator(HostAllocator allocator);

} // namespace blockswap::torch_frontend
