#include "cuda_stream.hpp"

#include <c10/core/Device.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

#include "blockswap/core/error.hpp"

namespace blockswap::torch_frontend {

int current_cuda_device() {
  const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  return guard.getDevice().index();
}

bool cuda_streams_supported() {
  return TORCH_VERSION_MAJOR >= 2;
}

void check_cuda_streams() {
#if TORCH_VERSION_MAJOR < 2
  throw Error(detail::concat("blockswap on CUDA needs LibTorch 2.x (to follow torch's current "
                             "stream); this is LibTorch ",
                             TORCH_VERSION));
#endif
}

CUstream_st* current_cuda_stream(int device) {
#if TORCH_VERSION_MAJOR >= 2
  // Stream::native_handle asks the CUDA guard registered in libc10 for the cudaStream_t.
  const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  const c10::Stream stream =
      guard.getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  return static_cast<CUstream_st*>(stream.native_handle());
#else
  (void)device;
  throw Error(detail::concat("blockswap on CUDA needs LibTorch 2.x; this is ", TORCH_VERSION));
#endif
}

} // namespace blockswap::torch_frontend
