// BLOCKSWAP_CUDA_CHECK: every CUDA runtime call, checked. Implementer-only (src/device/cuda).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>

#include "blockswap/core/error.hpp"
#include "blockswap/core/log.hpp"

namespace blockswap::detail {

[[noreturn]] inline void throw_cuda(cudaError_t error, const char* call, const char* file,
                                    int line) {
  int device = -1;
  cudaGetDevice(&device);
  const std::string message =
      concat(call, " failed: ", cudaGetErrorName(error), " (", cudaGetErrorString(error),
             ") on cuda:", device, " at ", file, ":", line);
  if (error == cudaErrorMemoryAllocation) throw OutOfMemory(message);
  throw Error(message);
}

// For destructors and other paths that must not throw: the same text, to blockswap's log.
inline void log_cuda(cudaError_t error, const char* call, const char* file, int line) noexcept {
  int device = -1;
  cudaGetDevice(&device);
  char text[512];
  std::snprintf(text, sizeof text, "%s failed: %s (%s) on cuda:%d at %s:%d", call,
                cudaGetErrorName(error), cudaGetErrorString(error), device, file, line);
  warn("", text);
}

} // namespace blockswap::detail

// Throws blockswap::Error naming the call, the CUDA error and the device.
#define BLOCKSWAP_CUDA_CHECK(call)                                                                 \
  do {                                                                                             \
    const cudaError_t blockswap_cuda_error = (call);                                               \
    if (blockswap_cuda_error != cudaSuccess) {                                                     \
      ::blockswap::detail::throw_cuda(blockswap_cuda_error, #call, __FILE__, __LINE__);            \
    }                                                                                              \
  } while (false)

// Logs the call, the CUDA error and the device to stderr; never throws (destructors).
#define BLOCKSWAP_CUDA_LOG(call)                                                                   \
  do {                                                                                             \
    const cudaError_t blockswap_cuda_error = (call);                                               \
    if (blockswap_cuda_error != cudaSuccess) {                                                     \
      ::blockswap::detail::log_cuda(blockswap_cuda_error, #call, __FILE__, __LINE__);              \
    }                                                                                              \
  } while (false)
