// Every difference between the torch versions blockswap supports (2.7 to 2.14), and the torch
// internals it reaches into, in one place: nothing else in blockswap branches on a version.
// The autograd engine's internals are in torch_compat_autograd.hpp beside it. Implementer-only
// (src/torch).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <torch/version.h>

#include <memory>
#include <string>

struct CUstream_st;

namespace torch::autograd {
struct Node;
} // namespace torch::autograd

namespace blockswap::torch_frontend::compat {

// The oldest torch blockswap supports (cmake/BlockswapTorch.cmake checks the same range).
inline constexpr int min_torch_major = 2;
inline constexpr int min_torch_minor = 7;

// autograd's owning pointer to a node: std::shared_ptr<Node> up to torch 2.12,
// c10::intrusive_ptr<Node> from 2.13 on (torch_compat.cpp checks it against
// torch::autograd::impl::grad_accumulator). Node stays incomplete here: a source that copies or
// drops a NodePtr of 2.13 on includes torch/csrc/autograd/function.h.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
using NodePtr = c10::intrusive_ptr<torch::autograd::Node>;
#else
using NodePtr = std::shared_ptr<torch::autograd::Node>;
#endif

// The leaf's gradient accumulator, made if it has none (the one the next forward will use).
NodePtr grad_accumulator(const at::Tensor& leaf);
// The leaf's gradient accumulator if it has one now, else null; makes none.
NodePtr current_grad_accumulator(const at::Tensor& leaf);
// Drops the leaf's link to its gradient accumulator, as set_data does when a tensor changes
// device (Note [device change] in block_binder): the next forward makes a new one.
void forget_grad_accumulator(const at::Tensor& leaf);

// `device` with its index: torch's current device of that type where it has none.
c10::Device with_index(c10::Device device);
// torch's current stream on `device`.
c10::Stream current_stream(c10::Device device);
// A stream of torch's pool on `device`, for copies beside the compute stream.
c10::Stream pool_stream(c10::Device device);

// Whether this torch was built with CUDA and blockswap with its CUDA-stream integration.
bool torch_cuda_streams();
// The device index torch considers current on CUDA.
int current_cuda_device();
// The stream torch computes on now on CUDA device `device` (the raw cudaStream_t). Throws
// Error where torch_cuda_streams() is false.
CUstream_st* current_cuda_stream(int device);
// Gives the CUDA memory torch's caching allocator keeps cached and unused back to the driver
// (emptyCache) and says, in words, what the allocator still holds on `device` (the OutOfMemory
// message of a slot that did not fit: Note [slots beside torch's allocator] in
// src/device/cuda/cuda_device.cpp). Error where torch_cuda_streams() is false.
std::string release_cuda_cache(int device);

} // namespace blockswap::torch_frontend::compat
