// The device memory account of the host-side devices (emulated, timed): what is held against a
// capacity, as a GPU's allocator would refuse. Implementer-only (src/device/host). Not locked:
// each device guards it with its own mutex.
#pragma once

#include <algorithm>
#include <cstddef>

#include "blockswap/core/error.hpp"

namespace blockswap::host {

struct DeviceAccount {
  std::size_t capacity = 0;
  std::size_t held = 0;
  std::size_t peak = 0;

  // Claims `size` bytes (the aligned size of a request for `requested`); throws OutOfMemory,
  // naming `device`, when they do not fit the capacity.
  void claim(std::size_t size, std::size_t requested, const char* device) {
    if (size > capacity || held > capacity - size) {
      throw OutOfMemory(detail::concat(device, " out of memory: cannot allocate ", requested,
                                       " bytes with ", held, " of ", capacity, " bytes in use"));
    }
    held += size;
    peak = std::max(peak, held);
  }
  void release(std::size_t size) { held -= size; }
};

} // namespace blockswap::host
