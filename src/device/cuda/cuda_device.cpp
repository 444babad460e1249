#include "blockswap/device/cuda.hpp"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda_copy_timer.hpp"
#include "cuda_handles.hpp"
#if BLOCKSWAP_HAS_CODEC_CUDA
#include "codec_decode.hpp"
#endif

#ifndef BLOCKSWAP_HAS_CODEC_CUDA
#define BLOCKSWAP_HAS_CODEC_CUDA 0
#endif

namespace blockswap {
namespace {

// Note [a stream waiting for the host] (CudaDevice::wait_host).
void CUDART_CB run_host_function(void* data) {
  const std::unique_ptr<std::function<void()>> call(static_cast<std::function<void()>*>(data));
  (*call)();
}

using cuda::DeviceScope;

// Note [untimed events]
// make_event's events are for ordering only and are made with cudaEventDisableTiming: the
// driver takes no timestamp when it records them, and a host that synchronizes on one need not
// wait for a timestamp write. Only make_timed_event's (the engine's stall timers) and the copy
// observer's pairs can be timed; elapsed_seconds refuses the others with an Error rather than
// cudaErrorInvalidResourceHandle.
class CudaEvent final : public Event {
public:
  CudaEvent(int device, bool timed) : handle(device, timed), timing(timed) {}
  cuda::EventHandle handle;
  bool timing;
  bool recorded = false;
};

template <typename E> auto& cuda_event(E& event) {
  auto* e =
      dynamic_cast<std::conditional_t<std::is_const_v<E>, const CudaEvent, CudaEvent>*>(&event);
  BLOCKSWAP_CHECK(e != nullptr, "cuda device: the event was not made by this backend");
  return *e;
}

// `why`: what refused; `then`: what blockswap does about it. One warning per `once`.
void warn_pageable_once(std::once_flag& once, std::size_t bytes, const std::string& why,
                        const char* then) {
  std::call_once(once, [&] {
    warn("", detail::concat("WARNING: cannot pin ", bytes, " bytes of host memory (", why,
                            "): ", then));
  });
}

std::string refused(cudaError_t error) {
  return detail::concat(cudaGetErrorString(error), "; ulimit -l, WSL and Windows cap pinning");
}

std::once_flag allocated_pageable, shared_pageable;

} // namespace

struct CudaDevice::State {
  CudaDeviceOptions options;
  cuda::StreamHandle copy;
  cuda::StreamHandle decode; // Stream::decode (Note [decoding on the decode stream])
  mutable std::mutex mutex;
  std::size_t device_bytes = 0;
  std::size_t peak_device_bytes = 0;
  bool pinned = true;
  std::optional<cuda::CopyTimer> copies; // Note [timed copies] in cuda_copy_timer.hpp
  // Note [decoding on the decode stream]: the decoder's workspace (device), the damage word of
  // the last decode (page-locked host memory) and the first damage its check found.
  Buffer decode_workspace;
  uint32_t* damage_word = nullptr;
  std::exception_ptr decode_error; // under `mutex`
  void rethrow_decode_error() {
    std::exception_ptr error;
    {
      std::lock_guard lock(mutex);
      error = std::exchange(decode_error, nullptr);
    }
    if (error) std::rethrow_exception(error);
  }

  cudaStream_t compute() const {
    return options.compute_stream ? options.compute_stream() : nullptr;
  }
  cudaStream_t stream(Stream s) const {
    switch (s) {
    case Stream::copy:
      return copy.get();
    case Stream::decode:
      return decode.get();
    case Stream::compute:
      break;
    }
    return compute();
  }
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
  state_->decode = cuda::StreamHandle(state_->options.device);
  state_->copies.emplace(state_->options.device);
}

// The decode and copy streams finish their work, then go (StreamHandle::reset logs what fails).
CudaDevice::~CudaDevice() {
  try {
    DeviceScope scope(state_->options.device);
    state_->decode.reset();
    state_->copy.reset();
    state_->copies->report();
    state_->decode_workspace.reset();
    if (state_->damage_word != nullptr) BLOCKSWAP_CUDA_LOG(cudaFreeHost(state_->damage_word));
  } catch (const std::exception& e) {
    warn("", detail::concat("cuda device shutdown: ", e.what()));
  }
}

std::string CudaDevice::name() const {
  return "cuda:" + std::to_string(state_->options.device);
}

// Read-only registration: the pages are the node's shared copy, mapped copy-on-write
// (core/node_memory.hpp); pinning them for writing would make each process copy them, so where
// the device cannot register read-only they stay pageable. (Whether a read-only long-term pin
// of a copy-on-write page still makes the kernel copy it is measured on a GPU:
// node_sharing_cuda_test, Note [pinning shares].)
Buffer CudaDevice::pin_host(std::byte* data, std::size_t bytes) {
  DeviceScope scope(state_->options.device);
  const char* const then =
      "the node-shared weights stay pageable; each copy from them makes the host wait for the "
      "copy stream";
  auto pageable = [&](const std::string& why) {
    warn_pageable_once(shared_pageable, bytes, why, then);
    std::lock_guard lock(state_->mutex);
    state_->pinned = false;
    return Buffer();
  };
  int read_only = 0;
  if (cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported,
                             state_->options.device) != cudaSuccess) {
    cudaGetLastError();
    read_only = 0;
  }
  if (read_only == 0) {
    return pageable(detail::concat("cuda:", state_->options.device,
                                   " cannot register host memory read-only "
                                   "(cudaDevAttrHostRegisterReadOnlySupported is 0), and "
                                   "registering it for writing would copy every page"));
  }
  const cudaError_t error =
      cudaHostRegister(data, bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return pageable(detail::concat("cudaHostRegister, read-only: ", refused(error)));
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
  warn_pageable_once(allocated_pageable, bytes, refused(error),
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

// Note [slots beside torch's allocator]
// Slots come from cudaMalloc, not from torch's caching allocator. What that costs: torch's
// memory_allocated() does not count them (blockswap reports them: memory(), Stats), and memory
// torch keeps cached is not theirs to take; so on cudaErrorMemoryAllocation the owner of that
// cache is asked to give it back (CudaDeviceOptions::release_cached_memory: the LibTorch front
// end empties torch's cache) and the allocation is tried once more. Why not raw_alloc from
// torch's allocator: (1) cudaFree synchronizes the device, which is what lets a slot go while
// the copy stream or a compute stream may still touch it; raw_delete returns the block to the
// allocation stream's pool at once, and recordStream, which would hold it for the other
// streams' work, takes only allocate()'s DataPtr (c10/cuda/CUDACachingAllocator.h, 2.7-2.14):
// every release would need its own events or a device synchronize; (2) a slot lives as long as
// its offloader and is as large as a block: carved out of a segment of torch's pool, it keeps
// that whole segment from emptyCache and fragments the pool torch's own tensors come from,
// while outside it torch's OOM path sees it as memory in use, which it is; (3) core and
// device stay free of torch (DESIGN.md, section 3), and the CUDA backend runs without torch
// (the C++ API, the blockswap tool's emulated and GPU paths).
Buffer CudaDevice::allocate_device(std::size_t bytes) {
  DeviceScope scope(state_->options.device);
  void* data = nullptr;
  const std::size_t size = std::max<std::size_t>(bytes, 1);
  cudaError_t error = cudaMalloc(&data, size);
  std::string others; // what the release hook says the other allocator holds
  if (error == cudaErrorMemoryAllocation && state_->options.release_cached_memory) {
    cudaGetLastError();
    try {
      others = state_->options.release_cached_memory();
    } catch (const std::exception& e) { // still an OutOfMemory, which says so
      others = detail::concat("releasing it failed: ", e.what());
    }
    error = cudaMalloc(&data, size);
  }
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    std::size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    std::lock_guard lock(state_->mutex);
    const std::size_t used = total_bytes - std::min(free_bytes, total_bytes);
    throw OutOfMemory(detail::concat(
        "cuda:", state_->options.device, " out of memory: cannot allocate ", bytes, " bytes with ",
        free_bytes, " of ", total_bytes, " bytes free (", state_->device_bytes,
        " held by blockswap; ", used - std::min(used, state_->device_bytes),
        " by the rest of this process and others",
        others.empty()
            ? std::string()
            : detail::concat(", after releasing cached memory and trying again: ", others),
        ")"));
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

// Note [device scope]
// Every call that enqueues, records or waits runs with this backend's device current: the
// legacy default stream (a compute stream of nullptr), cudaMemsetAsync and the events all
// belong to the current device, and the caller's thread may have another one current
// (torch.cuda.set_device(1) with an offloader on cuda:0). DeviceScope costs a cudaGetDevice
// where the device is current already.
void CudaDevice::copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                                int64_t tag) {
  DeviceScope scope(state_->options.device);
  state_->copies->copy_async(device, host, bytes, cudaMemcpyHostToDevice, tag, state_->copy.get());
}

void CudaDevice::copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                              int64_t tag) {
  DeviceScope scope(state_->options.device);
  state_->copies->copy_async(host, device, bytes, cudaMemcpyDeviceToHost, tag, state_->copy.get());
}

void CudaDevice::set_copy_observer(CopyObserver observer) {
  DeviceScope scope(state_->options.device);
  state_->copies->observe(std::move(observer), state_->copy.get());
}

void CudaDevice::poison(std::byte* device, std::size_t bytes) {
  // 0xFF bytes are NaN in float32, float16 and bfloat16. A device memset runs at device memory
  // speed, far above the link's.
  if (bytes == 0) return;
  DeviceScope scope(state_->options.device);
  BLOCKSWAP_CUDA_CHECK(cudaMemsetAsync(device, 0xFF, bytes, state_->copy.get()));
}

// Note [untimed events]
std::unique_ptr<Event> CudaDevice::make_event() {
  return std::make_unique<CudaEvent>(state_->options.device, false);
}

std::unique_ptr<Event> CudaDevice::make_timed_event() {
  return std::make_unique<CudaEvent>(state_->options.device, true);
}

void CudaDevice::record(Event& event, Stream stream) {
  DeviceScope scope(state_->options.device);
  if (stream == Stream::copy) state_->copies->report();
  CudaEvent& e = cuda_event(event);
  BLOCKSWAP_CUDA_CHECK(cudaEventRecord(e.handle.get(), state_->stream(stream)));
  e.recorded = true;
}

void CudaDevice::wait(Stream stream, const Event& event) {
  const CudaEvent& e = cuda_event(event);
  if (!e.recorded) return;
  DeviceScope scope(state_->options.device);
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
  DeviceScope scope(state_->options.device);
  BLOCKSWAP_CUDA_CHECK(cudaLaunchHostFunc(state_->stream(stream), &run_host_function, call.get()));
  call.release(); // run_host_function frees it
}

void CudaDevice::synchronize(const Event& event) {
  const CudaEvent& e = cuda_event(event);
  if (!e.recorded) return;
  DeviceScope scope(state_->options.device);
  BLOCKSWAP_CUDA_CHECK(cudaEventSynchronize(e.handle.get()));
  state_->copies->report();
  state_->rethrow_decode_error();
}

// Note [decoding on the decode stream]
// A compressed block (core/codec.hpp) is decoded where it lands: the codec's kernels
// (codec_decode.cu) run on the decode stream, a non-blocking stream of their own, after the
// copy of its compressed bytes (an event of the copy stream the load pipeline makes the decode
// stream wait for, Note [a decode step] in load_pipeline.cpp), so that they overlap the next
// copy; the block's load event, recorded after them on the decode stream, orders compute after
// the decode as after a copy. The kernels leave a damage word in the workspace; the decode
// stream then fills a damaged block's slot with NaN (a computation that reads it before the
// host hears of it reads NaN, never a wrong weight), copies the word to page-locked host memory
// and, in a host function, turns a word that is not 0 into the Error that the host's next
// synchronize() throws. The GPU's
// compute stream does not make the host wait, so on CUDA that Error comes at the next host
// synchronisation (the engine's synchronize or prepare, the host step), not at the block's
// wait as on the emulated device. One workspace and one word: the decode stream runs in order.
void CudaDevice::decode(std::byte* out, const std::byte* compressed, std::size_t bytes,
                        const codec::Parsed& parsed, int64_t tag) {
#if BLOCKSWAP_HAS_CODEC_CUDA
  (void)bytes;
  DeviceScope scope(state_->options.device);
  const std::size_t workspace = cuda_codec::workspace_bytes(parsed);
  if (state_->decode_workspace.size() < workspace) {
    // The old one may be in use by a decode in flight: freed after the decode stream is done.
    BLOCKSWAP_CUDA_CHECK(cudaStreamSynchronize(state_->decode.get()));
    state_->decode_workspace = allocate_device(workspace);
  }
  if (state_->damage_word == nullptr) {
    void* word = nullptr;
    BLOCKSWAP_CUDA_CHECK(cudaMallocHost(&word, sizeof(uint32_t)));
    state_->damage_word = static_cast<uint32_t*>(word);
  }
  void* ws = state_->decode_workspace.data();
  cudaStream_t stream = state_->decode.get();
  cuda_codec::decode_async(parsed, compressed, out, ws, stream);
  cuda_codec::poison_if_damaged_async(ws, out, parsed.decoded_bytes, stream);
  BLOCKSWAP_CUDA_CHECK(
      cudaMemcpyAsync(state_->damage_word, ws, sizeof(uint32_t), cudaMemcpyDeviceToHost, stream));
  wait_host(Stream::decode, [state = state_, tag] {
    const uint32_t damage = *state->damage_word;
    if (damage == 0) return;
    try {
      cuda_codec::check_damage(damage);
    } catch (const std::exception& e) {
      std::lock_guard lock(state->mutex);
      if (!state->decode_error) {
        state->decode_error = std::make_exception_ptr(
            Error(detail::concat(e.what(), " (the load tagged ", tag, ")")));
      }
    }
  });
#else
  Backend::decode(out, compressed, bytes, parsed, tag);
#endif
}

bool CudaDevice::can_decode() const {
  return BLOCKSWAP_HAS_CODEC_CUDA != 0;
}

std::optional<double> CudaDevice::elapsed_seconds(const Event& start, const Event& end) const {
  const CudaEvent& a = cuda_event(start);
  const CudaEvent& b = cuda_event(end);
  BLOCKSWAP_CHECK(a.timing && b.timing, "cuda:", state_->options.device,
                  ": elapsed_seconds needs events from make_timed_event; make_event's are made "
                  "without timing (Note [untimed events])");
  if (!a.recorded || !b.recorded) return std::nullopt;
  DeviceScope scope(state_->options.device);
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
