// The host memory a Device page-locks, counted (HostAccount), and its pool of exact-size
// buffers for memory that comes and goes every step (HostPool). Implementer-only
// (src/device); Note [exact host memory] in host_memory.cpp.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "blockswap/core/backend.hpp"
#include "blockswap/device/device.hpp"

namespace blockswap::device_detail {

// The bytes the system locks for a buffer of `bytes`: whole pages.
std::size_t locked_bytes(std::size_t bytes);

// What the Device's host buffers hold and lock. Buffers it counted may outlive the Device: they
// share this account.
class HostAccount : public std::enable_shared_from_this<HostAccount> {
public:
  // `memory`, wrapped so that its bytes are counted until it is freed: as pinned (whole pages)
  // or pageable as the backend made it, and, with `kept`, as kept.
  Buffer count(Buffer memory, bool kept);
  // Bytes in buffers counted without `kept` that now hold (or no longer hold) data.
  void keep(std::size_t bytes);
  void drop(std::size_t bytes);
  HostMemoryStats stats() const;

private:
  void freed(std::size_t bytes, bool pageable, bool kept);

  mutable std::mutex mutex_;
  HostMemoryStats stats_;
};

// Exact-size host buffers that are reused: what one step frees, the next step of the same
// shapes takes again, without asking the system to lock memory again. It never holds more
// than the most its buffers have held at once (Note [exact host memory]).
class HostPool : public std::enable_shared_from_this<HostPool> {
public:
  using Allocate = std::function<Buffer(std::size_t bytes)>;
  HostPool(std::shared_ptr<HostAccount> account, Allocate allocate);

  // A buffer of exactly `bytes`, kept (HostAccount::keep) until it is reset, which gives it
  // back to the pool.
  Buffer take(std::size_t bytes);
  // Frees the buffers nobody holds.
  void trim();

  std::size_t idle_bytes() const;

private:
  void give_back(std::size_t bytes, std::shared_ptr<Buffer> memory);

  const std::shared_ptr<HostAccount> account_;
  const Allocate allocate_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, std::shared_ptr<Buffer>> idle_; // by size
  std::size_t idle_bytes_ = 0;
  std::size_t taken_bytes_ = 0;
  std::size_t high_water_ = 0; // the most ever taken at once
};

} // namespace blockswap::device_detail
