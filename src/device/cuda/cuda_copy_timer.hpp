// The copy observer of the CUDA backend (Backend::set_copy_observer): each copy timed with
// events on the copy stream. Implementer-only (src/device/cuda).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "blockswap/core/backend.hpp"
#include "cuda_handles.hpp"

namespace blockswap::cuda {

// Note [timed copies]
// With a copy observer set, each copy is bracketed by two timing events on the copy stream.
// A finished copy is reported from the next call that finds its end event complete: its
// start and end are the events' times after a reference event recorded when the observer was
// set, whose host time is known (the host waited for it). The pairs of a reported copy go back
// to a pool that the next copies take from, so that a steady stream of copies creates no event.
// Every call is made with the device current (Note [device scope] in cuda_device.cpp).
class CopyTimer {
public:
  explicit CopyTimer(int device) : device_(device) {}

  // Enqueues a copy on `stream`, bracketed by timing events when someone observes copies.
  void copy_async(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, int64_t tag,
                  cudaStream_t stream) {
    std::unique_lock lock(mutex_);
    if (!observer_) {
      lock.unlock();
      BLOCKSWAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream));
      return;
    }
    Timed timed{kind == cudaMemcpyHostToDevice, bytes, tag, take_pair()};
    BLOCKSWAP_CUDA_CHECK(cudaEventRecord(timed.events.start.get(), stream));
    BLOCKSWAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    BLOCKSWAP_CUDA_CHECK(cudaEventRecord(timed.events.end.get(), stream));
    timed_.push_back(std::move(timed));
  }

  // Reports the last observer's finished copies, then observes with `observer` (none: nullptr)
  // from a reference recorded on `stream` now.
  void observe(CopyObserver observer, cudaStream_t stream) {
    report();
    std::lock_guard lock(mutex_);
    observer_ = std::move(observer);
    for (Timed& c : timed_) spare_.push_back(std::move(c.events));
    timed_.clear();
    if (!observer_) return;
    // The reference point: recorded on the copy stream and waited for, so its host time is now.
    if (!reference_) reference_ = EventHandle(device_, true);
    BLOCKSWAP_CUDA_CHECK(cudaEventRecord(reference_.get(), stream));
    BLOCKSWAP_CUDA_CHECK(cudaEventSynchronize(reference_.get()));
    reference_time_ = std::chrono::steady_clock::now();
  }

  // Reports the copies that have completed, in order, to the observer.
  void report() {
    std::vector<CopyRecord> done;
    CopyObserver notify;
    {
      std::lock_guard lock(mutex_);
      while (!timed_.empty() && cudaEventQuery(timed_.front().events.end.get()) == cudaSuccess) {
        Timed& c = timed_.front();
        float start_ms = 0, end_ms = 0;
        if (cudaEventElapsedTime(&start_ms, reference_.get(), c.events.start.get()) ==
                cudaSuccess &&
            cudaEventElapsedTime(&end_ms, reference_.get(), c.events.end.get()) == cudaSuccess) {
          done.push_back(CopyRecord{c.to_device, c.bytes, c.tag, at(start_ms), at(end_ms)});
        }
        spare_.push_back(std::move(c.events));
        timed_.pop_front();
      }
      cudaGetLastError(); // a query that said "not ready" is not an error
      notify = observer_;
    }
    if (notify) {
      for (const CopyRecord& record : done) notify(record);
    }
  }

private:
  struct EventPair {
    EventHandle start, end;
  };
  struct Timed {
    bool to_device = true;
    std::size_t bytes = 0;
    int64_t tag = -1;
    EventPair events;
  };

  // A pair of timing events from the pool, or two new ones. Under `mutex_`.
  EventPair take_pair() {
    if (spare_.empty()) return EventPair{EventHandle(device_, true), EventHandle(device_, true)};
    EventPair pair = std::move(spare_.back());
    spare_.pop_back();
    return pair;
  }

  std::chrono::steady_clock::time_point at(float ms) const {
    return reference_time_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double, std::milli>(ms));
  }

  int device_;
  std::mutex mutex_; // guards what follows: the observer and the copies it has yet to see
  CopyObserver observer_;
  EventHandle reference_;
  std::chrono::steady_clock::time_point reference_time_;
  std::deque<Timed> timed_;
  std::vector<EventPair> spare_;
};

} // namespace blockswap::cuda
