#include "host_memory.hpp"

#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace blockswap::device_detail {

// Note [exact host memory]
// Host memory is what users run out of first, and page-locked memory cannot be swapped out.
// torch's caching pinned allocator rounds every buffer up to a power of two (1.67x and ~1.9x of
// the bytes asked were measured in two inference servers in 2026), so blockswap asks for no
// pinned memory through it: every page-locked buffer it makes (block copies and their spares,
// the staging ring, offloaded activations, a fine-tuner's host state and gradients) comes from
// a Device at exactly the size asked, and the Device counts it (Device::host_memory) as the
// system locks it: whole pages. Bytes "kept" are what those buffers hold; pinned per kept is the
// price of the pages.
//
// Offloaded activations come and go every step, and asking the system to lock memory for each
// would cost more than the copies (cudaHostAlloc maps and locks every page). They come from the
// Device's HostPool: buffers of the exact sizes asked, given back when their activations are
// freed and taken again by a later request of the same size. The pool never holds more than the
// most its buffers held at once (its high-water mark): before it locks a new buffer it frees
// idle ones until the new total fits that mark, so a change of shapes (another resolution
// bucket) costs new buffers, never more memory than the largest step needed. Reusing a buffer
// needs no event: only device->host copies on the activation store's one stream write into
// them, in order, and a host->device copy still reading a freed buffer reads for a storage
// nobody will use (Note [saved storages] in src/torch/activation_store.cpp).
std::size_t locked_bytes(std::size_t bytes) {
  static const std::size_t page = [] {
    const long size = ::sysconf(_SC_PAGESIZE);
    return size > 0 ? static_cast<std::size_t>(size) : std::size_t{4096};
  }();
  return (std::max<std::size_t>(bytes, 1) + page - 1) / page * page;
}

Buffer HostAccount::count(Buffer memory, bool kept) {
  const std::size_t bytes = memory.size();
  const bool pageable = memory.pageable();
  kept = kept && !pageable; // kept in page-locked memory
  {
    std::lock_guard lock(mutex_);
    if (pageable) {
      stats_.pageable_bytes += bytes;
    } else {
      stats_.pinned_bytes += locked_bytes(bytes);
      stats_.peak_pinned_bytes = std::max(stats_.peak_pinned_bytes, stats_.pinned_bytes);
    }
    if (kept) {
      stats_.kept_bytes += bytes;
      stats_.peak_kept_bytes = std::max(stats_.peak_kept_bytes, stats_.kept_bytes);
    }
  }
  std::byte* data = memory.data();
  return Buffer(
      data, bytes,
      [memory = std::make_shared<Buffer>(std::move(memory)), account = shared_from_this(), pageable,
       kept](std::byte*, std::size_t n) {
        memory->reset();
        account->freed(n, pageable, kept);
      },
      pageable ? Buffer::Pinning::pageable : Buffer::Pinning::pinned_or_device);
}

void HostAccount::freed(std::size_t bytes, bool pageable, bool kept) {
  std::lock_guard lock(mutex_);
  if (pageable) {
    stats_.pageable_bytes -= bytes;
  } else {
    stats_.pinned_bytes -= locked_bytes(bytes);
  }
  if (kept) stats_.kept_bytes -= bytes;
}

void HostAccount::keep(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  stats_.kept_bytes += bytes;
  stats_.peak_kept_bytes = std::max(stats_.peak_kept_bytes, stats_.kept_bytes);
}

void HostAccount::drop(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  stats_.kept_bytes -= std::min(bytes, stats_.kept_bytes);
}

HostMemoryStats HostAccount::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

HostPool::HostPool(std::shared_ptr<HostAccount> account, Allocate allocate)
    : account_(std::move(account)), allocate_(std::move(allocate)) {}

Buffer HostPool::take(std::size_t bytes) {
  std::shared_ptr<Buffer> memory;
  std::vector<std::shared_ptr<Buffer>> freed; // freed once the lock is let go
  {
    std::lock_guard lock(mutex_);
    if (const auto it = idle_.find(bytes); it != idle_.end()) {
      memory = std::move(it->second);
      idle_.erase(it);
      idle_bytes_ -= bytes;
    } else {
      const std::size_t mark = std::max(high_water_, taken_bytes_ + bytes);
      while (!idle_.empty() && idle_bytes_ + taken_bytes_ + bytes > mark) {
        const auto largest = std::prev(idle_.end());
        idle_bytes_ -= largest->first;
        freed.push_back(std::move(largest->second));
        idle_.erase(largest);
      }
    }
    taken_bytes_ += bytes; // claimed before allocating: two requests cannot pass the mark
    high_water_ = std::max(high_water_, taken_bytes_);
  }
  freed.clear();
  if (!memory) {
    try {
      memory = std::make_shared<Buffer>(allocate_(bytes));
    } catch (...) {
      std::lock_guard lock(mutex_);
      taken_bytes_ -= bytes;
      throw;
    }
  }
  const bool kept = !memory->pageable();
  if (kept) account_->keep(bytes);
  std::byte* data = memory->data();
  return Buffer(
      data, bytes,
      [memory, pool = std::weak_ptr<HostPool>(shared_from_this()), account = account_,
       kept](std::byte*, std::size_t n) mutable {
        if (kept) account->drop(n);
        if (const auto owner = pool.lock()) owner->give_back(n, std::move(memory));
      },
      memory->pageable() ? Buffer::Pinning::pageable : Buffer::Pinning::pinned_or_device);
}

void HostPool::give_back(std::size_t bytes, std::shared_ptr<Buffer> memory) {
  std::lock_guard lock(mutex_);
  taken_bytes_ -= bytes;
  idle_.emplace(bytes, std::move(memory));
  idle_bytes_ += bytes;
}

void HostPool::trim() {
  std::multimap<std::size_t, std::shared_ptr<Buffer>> freed;
  {
    std::lock_guard lock(mutex_);
    freed.swap(idle_);
    idle_bytes_ = 0;
    high_water_ = taken_bytes_;
  }
}

std::size_t HostPool::idle_bytes() const {
  std::lock_guard lock(mutex_);
  return idle_bytes_;
}

} // namespace blockswap::device_detail
