#include "torch_compat.hpp"

#include <c10/core/Device.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <type_traits>
#include <utility>

#ifndef BLOCKSWAP_TORCH_CUDA
#define BLOCKSWAP_TORCH_CUDA 0 // the build defines it 1 against a CUDA torch
#endif
#if BLOCKSWAP_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "blockswap/core/error.hpp"

// A torch older than the supported range fails here, with this message, and not deep in a
// header (the build checks first: cmake/BlockswapTorch.cmake, setup.py).
static_assert(TORCH_VERSION_MAJOR > blockswap::torch_frontend::compat::min_torch_major ||
                  (TORCH_VERSION_MAJOR == blockswap::torch_frontend::compat::min_torch_major &&
                   TORCH_VERSION_MINOR >= blockswap::torch_frontend::compat::min_torch_minor),
              "blockswap needs torch 2.7 or newer: run scripts/setup-deps");

namespace blockswap::torch_frontend::compat {

static_assert(std::is_same_v<NodePtr, decltype(torch::autograd::impl::grad_accumulator(
                                          std::declval<at::Tensor>()))>,
              "torch_compat.hpp: NodePtr is not what this torch's grad_accumulator returns");

NodePtr grad_accumulator(const at::Tensor& leaf) {
  return torch::autograd::impl::grad_accumulator(leaf);
}

NodePtr current_grad_accumulator(const at::Tensor& leaf) {
  return torch::autograd::impl::try_get_grad_accumulator(leaf);
}

void forget_grad_accumulator(const at::Tensor& leaf) {
  // The same field, and the same reset, as VariableHooks::set_data's on a change of device.
  if (auto* meta = torch::autograd::impl::get_autograd_meta(leaf)) meta->grad_accumulator_.reset();
}

c10::Device with_index(c10::Device device) {
  if (device.has_index() || device.is_cpu()) return device;
  const c10::impl::VirtualGuardImpl guard(device.type());
  return guard.getDevice();
}

c10::Stream current_stream(c10::Device device) {
  const c10::impl::VirtualGuardImpl guard(device.type());
  return guard.getStream(device);
}

c10::Stream pool_stream(c10::Device device) {
  const c10::impl::VirtualGuardImpl guard(device.type());
  return guard.getStreamFromGlobalPool(device);
}

bool torch_cuda_streams() {
  return BLOCKSWAP_TORCH_CUDA != 0;
}

int current_cuda_device() {
  const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  return guard.getDevice().index();
}

std::string release_cuda_cache(int device) {
#if BLOCKSWAP_TORCH_CUDA
  namespace cache = c10::cuda::CUDACachingAllocator;
  if (!cache::get()->initialized()) return "torch has not used CUDA yet";
  cache::emptyCache();
  const auto stats = cache::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  // [0]: StatType::AGGREGATE in every supported torch (c10/core/Allocator.h, 2.7's
  // CachingDeviceAllocator.h)
  return detail::concat("torch's caching allocator holds ", stats.allocated_bytes[0].current,
                        " bytes in tensors, ", stats.reserved_bytes[0].current,
                        " bytes reserved in all");
#else
  return detail::concat("cuda:", device, ": this torch has no CUDA caching allocator");
#endif
}

CUstream_st* current_cuda_stream(int device) {
#if BLOCKSWAP_TORCH_CUDA
  // c10_cuda's own accessor: every supported torch has it (c10::Stream::native_handle only
  // from 2.11 on).
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  throw Error(detail::concat("cuda:", device,
                             ": this blockswap was built against a torch "
                             "without CUDA (torch ",
                             TORCH_VERSION,
                             "); rebuild it against a "
                             "CUDA build of torch"));
#endif
}

} // namespace blockswap::torch_frontend::compat
