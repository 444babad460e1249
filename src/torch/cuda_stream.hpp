// The current torch CUDA stream, through libc10 only (no libc10_cuda link). Implementer-only.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace blockswap::torch_frontend {

// The device index torch considers current.
int current_cuda_device();
// Whether this LibTorch can tell blockswap its current CUDA stream (LibTorch 2.x).
bool cuda_streams_supported();
// Throws Error unless this LibTorch can tell blockswap its current CUDA stream (LibTorch 2.x).
void check_cuda_streams();
// The stream torch computes on now on `device` (the raw cudaStream_t). Needs LibTorch 2.x.
CUstream_st* current_cuda_stream(int device);

} // namespace blockswap::torch_frontend
