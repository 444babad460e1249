#include "blockswap/device/cuda.hpp"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <type_traits>

#include "cuda_handles.hpp"

namespace blockswap {
namespace {

// Note [a stream waiting for the host] (CudaDevice::wait_host).
void CUDART_CB run_host_function(void* data) {
  const std::unique_ptr<std::function<void()>> call(static_cast<std::function<void()>*>(data));
  (*call)();
}

using cuda::DeviceScope;

class CudaEvent final : public Event {
public:
  explicit CudaEvent(int device) : handle(device, /*timing=*/true) {}
  cuda::EventHandle handle;
  bool recorded = false;
};

template <typename E> auto& cuda_event(E& event) {
  auto* e =
      dynamic_cast<std::conditional_t<std::is_const_v<E>, const CudaEvent, CudaEvent>*>(&event);
  BLOCKSWAP_CHECK(e != nullptr, "cuda device: the event was not made by this backend");
  return *e;
}

// `then`: what blockswap does about it.
void warn_pageable_once(std::size_t bytes, cudaError_t error, const char* then) {
  static std::once_flag once;
  std::call_once(once, [&] {
    warn("", detail::concat("WARNING: cannot pin ", bytes, " bytes of host memory (",
                            cudaGetErrorString(error),
                            "; ulimit -l, WSL and Windows cap pinning): ", then));
  });
}

} // namespace

// Note [timed copies]
// With a copy observer set, each copy is bracketed by two timing events on the copy stream.
// A finished copy is reported from the next call that finds its end event complete: its
// start and end are the events' times after a reference event recorded when the observer was
// set, whose host time is known (the host waited for it).
struct TimedCopy {
  bool to_device = true;
  std::size_t bytes = 0;
  int64_t tag = -1;
  cuda::EventHandle start, end;
};

struct CudaDevice::State {
  CudaDeviceOptions options;
  cuda::StreamHandle copy;
  mutable std::mutex mutex;
  std::size_t device_bytes = 0;
  std::size_t peak_device_bytes = 0;
  bool pinned = true;
  // guarded by `mutex`: the copy observer and the copies it has yet to see
  CopyObserver observer;
  cuda::EventHandle reference;
  std::chrono::steady_clock::time_point reference_time;
  std::deque<TimedCopy> timed_copies;

  // Enqueues a copy, bracketed by timing events when someone observes copies.
  void copy_async(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, int64_t tag) {
    std::unique_lock lock(mutex);
    if (!observer) {
      lock.unlock();
      BLOCKSWAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, copy.get()));
      return;
    }
    TimedCopy timed{kind == cudaMemcpyHostToDevice, bytes, tag,
                    cuda::EventHandle(options.device, true),
                    cuda::EventHandle(options.device, true)};
    BLOCKSWAP_CUDA_CHECK(cudaEventRecord(timed.start.get(), copy.get()));
    BLOCKSWAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, copy.get()));
    BLOCKSWAP_CUDA_CHECK(cudaEventRecord(timed.end.get(), copy.get()));
    timed_copies.push_back(std::move(timed));
  }

  // Reports the copies that have completed, in order.
  void report_copies() {
    std::vector<CopyRecord> done;
    CopyObserver notify;
    {
      std::lock_guard lock(mutex);
      while (!timed_copies.empty() &&
             cudaEventQuery(timed_copies.front().end.get()) == cudaSuccess) {
        const TimedCopy& c = timed_copies.front();
        float start_ms = 0, end_ms = 0;
        if (cudaEventElapsedTime(&start_ms, reference.get(), c.start.get()) == cudaSuccess &&
            cudaEventElapsedTime(&end_ms, reference.get(), c.end.get()) == cudaSuccess) {
          auto at = [&](float ms) {
            return reference_time + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                        std::chrono::duration<double, std::milli>(ms));
          };
          done.push_back(CopyRecord{c.to_device, c.bytes, c.tag, at(start_ms), at(end_ms)});
        }
        timed_copies.pop_front();
      }
      cudaGetLastError(); // a query that said "not ready" is not an error
      notify = observer;
    }
    if (notify) {
      for (const CopyRecord& record : done) notify(record);
    }
  }

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
  try {
    state_->report_copies();
  } catch (const std::exception& e) {
    warn("", detail::concat("a copy observer failed at shutdown: ", e.what()));
  }
}

std::string CudaDevice::name() const {
  return "cuda:" + std::to_string(state_->options.device);
}

// Read-only registration: the pages are the node's shared copy, mapped copy-on-write
// (core/node_memory.hpp); pinning them for writing would make each process copy them.
Buffer CudaDevice::pin_host(std::byte* data, std::size_t bytes) {
  DeviceScope scope(state_->options.device);
  const cudaError_t error =
      cudaHostRegister(data, bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
  if (error != cudaSuccess) {
    cudaGetLastError();
    warn_pageable_once(bytes, error,
                       "the node-shared weights stay pageable; each copy from them makes the "
                       "host wait for the copy stream");
    return {};
  }
  return Buffer(data, bytes,
                [](std::byte* p, std::size_t) { BLOCKSWAP_CUDA_LOG(cudaHostUnregister(p)); });
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
  warn_pageable_once(bytes, error,
                     "using pageable memory; the engine stages loads from it through a few "
                     "pinned buffers");
  {
    std::lock_guard lock(state_->mutex);
    state_->pinned = false;
  }
  return Buffer(
      static_cast<std::byte*>(data), bytes, [](std::byte* p, std::size_t) { std::free(p); },
      Buffer::Pinning::pageable);
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
                                int64_t tag) {
  state_->copy_async(device, host, bytes, cudaMemcpyHostToDevice, tag);
}

void CudaDevice::copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                              int64_t tag) {
  state_->copy_async(host, device, bytes, cudaMemcpyDeviceToHost, tag);
}

void CudaDevice::set_copy_observer(CopyObserver observer) {
  state_->report_copies(); // the copies of the observer before
  std::lock_guard lock(state_->mutex);
  state_->observer = std::move(observer);
  state_->timed_copies.clear();
  if (!state_->observer) return;
  // The reference point: recorded on the copy stream and waited for, so its host time is now.
  if (!state_->reference) state_->reference = cuda::EventHandle(state_->options.device, true);
  BLOCKSWAP_CUDA_CHECK(cudaEventRecord(state_->reference.get(), state_->copy.get()));
  BLOCKSWAP_CUDA_CHECK(cudaEventSynchronize(state_->reference.get()));
  state_->reference_time = std::chrono::steady_clock::now();
}

void CudaDevice::poison(std::byte* device, std::size_t bytes) {
  // 0xFF bytes are NaN in float32, float16 and bfloat16. A device memset runs at device memory
  // speed, far above the link's.
  if (bytes > 0) BLOCKSWAP_CUDA_CHECK(cudaMemsetAsync(device, 0xFF, bytes, state_->copy.get()));
}

std::unique_ptr<Event> CudaDevice::make_event() {
  return std::make_unique<CudaEvent>(state_->options.device);
}

void CudaDevice::record(Event& event, Stream stream) {
  if (stream == Stream::copy) state_->report_copies();
  CudaEvent& e = cuda_event(event);
  BLOCKSWAP_CUDA_CHECK(cudaEventRecord(e.handle.get(), state_->stream(stream)));
  e.recorded = true;
}

void CudaDevice::wait(Stream stream, const Event& event) {
  const CudaEvent& e = cuda_event(event);
  if (!e.recorded) return;
  BLOCKSWAP_CUDA_CHECK(cudaStreamWaitEvent(state_->stream(stream), e.handle.get(), 0));
}

// Note [a stream waiting for the host]
// cudaLaunchHostFunc runs a function on a thread of the CUDA driver once the stream gets there,
// and the stream's later work waits until it returns. The function may block (the staging
// ring's copy waits so for the reader thread), but must call no CUDA function; the driver may
// run the host functions of every stream on one thread, so one that blocks delays the others
// (blockswap enqueues none elsewhere). It owns its std::function and frees it.
void CudaDevice::wait_host(Stream stream, std::function<void()> until) {
  auto call = std::make_unique<std::function<void()>>(std::move(until));
  BLOCKSWAP_CUDA_CHECK(cudaLaunchHostFunc(state_->stream(stream), &run_host_function, call.get()));
  call.release(); // run_host_function frees it
}

void CudaDevice::synchronize(const Event& event) {
  const CudaEvent& e = cuda_event(event);
  if (!e.recorded) return;
  BLOCKSWAP_CUDA_CHECK(cudaEventSynchronize(e.handle.get()));
  state_->report_copies();
}

std::optional<double> CudaDevice::elapsed_seconds(const Event& start, const Event& end) const {
  const CudaEvent& a = cuda_event(start);
  const CudaEvent& b = cuda_event(end);
  if (!a.recorded || !b.recorded) return std::nullopt;
  if (cudaEventQuery(b.handle.get()) != cudaSuccess ||
      cudaEventQuery(a.handle.get()) != cudaSuccess) {
    cudaGetLastError(); // "not ready" is an answer, not an error
    return std::nullopt;
  }
  float ms = 0;
  BLOCKSWAP_CUDA_CHECK(cudaEventElapsedTime(&ms, a.handle.get(), b.handle.get()));
  return static_cast<double>(ms) * 1e-3;
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
