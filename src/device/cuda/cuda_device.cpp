#include "blockswap/device/cuda.hpp"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <iostream>
#include <mutex>
#include <type_traits>

#include "cuda_handles.hpp"

namespace blockswap {
namespace {

using cuda::DeviceScope;

class CudaEvent final : public Event {
public:
  explicit CudaEvent(int device) : handle(device) {}
  cuda::EventHandle handle;
  bool recorded = false;
};

template <typename E> auto& cuda_event(E& event) {
  auto* e =
      dynamic_cast<std::conditional_t<std::is_const_v<E>, const CudaEvent, CudaEvent>*>(&event);
  BLOCKSWAP_CHECK(e != nullptr, "cuda device: the event was not made by this backend");
  return *e;
}

void warn_pageable_once(std::size_t bytes, cudaError_t error) {
  static std::once_flag once;
  std::call_once(once, [&] {
    std::cerr << "blockswap: WARNING: cannot pin " << bytes << " bytes of host memory ("
              << cudaGetErrorString(error)
              << "); using pageable memory: copies will run at about half speed\n";
  });
}

} // namespace

struct CudaDevice::State {
  CudaDeviceOptions options;
  cuda::StreamHandle copy;
  mutable std::mutex mutex;
  std::size_t device_bytes = 0;
  std::size_t peak_device_bytes = 0;
  bool pinned = true;

  cudaStream_t compute() const {
    return options.compute_stream ? options.compute_stream() : nullptr;
  }
  cudaStream_t stream(Stream s) const { return s == Stream::copy ? copy.get() : compute(); }
};

bool CudaDevice::available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

CudaDevice::CudaDevice(CudaDeviceOptions options) : state_(std::make_shared<State>()) {
  state_->options = std::move(options);
  int count = 0;
  BLOCKSWAP_CUDA_CHECK(cudaGetDeviceCount(&count));
  BLOCKSWAP_CHECK(state_->options.device >= 0 && state_->options.device < count,
                  "cuda:", state_->options.device, " does not exist: ", count,
                  " CUDA device(s) present");
  state_->copy = cuda::StreamHandle(state_->options.device);
}

// The copy stream finishes its copies, then goes (StreamHandle::reset logs what fails).
CudaDevice::~CudaDevice() {
  state_->copy.reset();
}

std::string CudaDevice::name() const {
  return "cuda:" + std::to_string(state_->options.device);
}

Buffer CudaDevice::allocate_host(std::size_t bytes) {
  DeviceScope scope(state_->options.device);
  const std::size_t size = std::max<std::size_t>(bytes, 1);
  void* data = nullptr;
  cudaError_t error = cudaHostAlloc(&data, size, cudaHostAllocPortable);
  if (error == cudaSuccess) {
    return Buffer(static_cast<std::byte*>(data), bytes,
                  [](std::byte* p, std::size_t) { BLOCKSWAP_CUDA_LOG(cudaFreeHost(p)); });
  }
  cudaGetLastError(); // clear it: the fallbacks below are the answer
  data = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
  if (data == nullptr)
    throw Error(detail::concat("cannot allocate ", bytes, " bytes of host memory"));
  error = cudaHostRegister(data, size, cudaHostRegisterPortable);
  if (error == cudaSuccess) {
    return Buffer(static_cast<std::byte*>(data), bytes, [](std::byte* p, std::size_t) {
      BLOCKSWAP_CUDA_LOG(cudaHostUnregister(p));
      std::free(p);
    });
  }
  cudaGetLastError();
  warn_pageable_once(bytes, error);
  {
    std::lock_guard lock(state_->mutex);
    state_->pinned = false;
  }
  return Buffer(static_cast<std::byte*>(data), bytes,
                [](std::byte* p, std::size_t) { std::free(p); });
}

Buffer CudaDevice::allocate_device(std::size_t bytes) {
  DeviceScope scope(state_->options.device);
  void* data = nullptr;
  const cudaError_t error = cudaMalloc(&data, std::max<std::size_t>(bytes, 1));
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    std::size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    std::lock_guard lock(state_->mutex);
    throw OutOfMemory(detail::concat("cuda:", state_->options.device,
                                     " out of memory: cannot allocate ", bytes, " bytes with ",
                                     free_bytes, " of ", total_bytes, " bytes free (",
                                     state_->device_bytes, " held by blockswap)"));
  }
  BLOCKSWAP_CUDA_CHECK(error);
  {
    std::lock_guard lock(state_->mutex);
    state_->device_bytes += bytes;
    state_->peak_device_bytes = std::max(state_->peak_device_bytes, state_->device_bytes);
  }
  // cudaFree synchronises the device, so no copy or computation can still use the memory. The
  // buffer may outlive this object: it shares the state.
  return Buffer(static_cast<std::byte*>(data), bytes,
                [state = state_](std::byte* p, std::size_t n) {
                  BLOCKSWAP_CUDA_LOG(cudaFree(p));
                  std::lock_guard lock(state->mutex);
                  state->device_bytes -= n;
                });
}

void CudaDevice::copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                                int64_t /*tag*/) {
  BLOCKSWAP_CUDA_CHECK(
      cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, state_->copy.get()));
}

void CudaDevice::copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                              int64_t /*tag*/) {
  BLOCKSWAP_CUDA_CHECK(
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, state_->copy.get()));
}

void CudaDevice::set_copy_observer(CopyObserver /*observer*/) {}

void CudaDevice::poison(std::byte* device, std::size_t bytes) {
  // 0xFF bytes are NaN in float32, float16 and bfloat16. A device memset runs at device memory
  // speed, far above the link's.
  if (bytes > 0) BLOCKSWAP_CUDA_CHECK(cudaMemsetAsync(device, 0xFF, bytes, state_->copy.get()));
}

std::unique_ptr<Event> CudaDevice::make_event() {
  return std::make_unique<CudaEvent>(state_->options.device);
}

void CudaDevice::record(Event& event, Stream stream) {
  CudaEvent& e = cuda_event(event);
  BLOCKSWAP_CUDA_CHECK(cudaEventRecord(e.handle.get(), state_->stream(stream)));
  e.recorded = true;
}

void CudaDevice::wait(Stream stream, const Event& event) {
  const CudaEvent& e = cuda_event(event);
  if (!e.recorded) return;
  BLOCKSWAP_CUDA_CHECK(cudaStreamWaitEvent(state_->stream(stream), e.handle.get(), 0));
}

void CudaDevice::synchronize(const Event& event) {
  const CudaEvent& e = cuda_event(event);
  if (!e.recorded) return;
  BLOCKSWAP_CUDA_CHECK(cudaEventSynchronize(e.handle.get()));
}

MemoryStats CudaDevice::memory() const {
  std::size_t free_bytes = 0, total_bytes = 0;
  {
    DeviceScope scope(state_->options.device);
    BLOCKSWAP_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  }
  std::lock_guard lock(state_->mutex);
  return MemoryStats{state_->device_bytes, state_->peak_device_bytes, total_bytes, state_->pinned};
}

} // namespace blockswap
