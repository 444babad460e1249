// What the simulator (simulator.cpp) and the bound (step_bound.cpp) share: the checks of a
// step's lists and the times and sizes they read. Private to src/core.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/core/simulator.hpp"

namespace blockswap::simulated {

inline void check_list(const SimulatedList& list) {
  BLOCKSWAP_CHECK(list.schedule != nullptr && list.timing != nullptr,
                  "simulator: a list needs a schedule and a timing");
  const auto n = static_cast<std::size_t>(list.schedule->blocks());
  const BlockTiming& t = *list.timing;
  BLOCKSWAP_CHECK(t.forward_seconds.size() == n && t.bytes.size() == n, "simulator: ", n,
                  " blocks in the schedule but ", t.forward_seconds.size(), " forward times and ",
                  t.bytes.size(), " block sizes");
  BLOCKSWAP_CHECK(std::isfinite(t.backward_factor) && t.backward_factor >= 0,
                  "simulator: backward_factor must be finite and >= 0, got ", t.backward_factor);
  for (double s : t.forward_seconds) {
    BLOCKSWAP_CHECK(std::isfinite(s) && s >= 0,
                    "simulator: a forward time must be finite and >= 0, got ", s);
  }
  BLOCKSWAP_CHECK(t.from_file.empty() || t.from_file.size() == n, "simulator: ", n,
                  " blocks in the schedule but ", t.from_file.size(), " file-tier flags");
  BLOCKSWAP_CHECK(t.activation_bytes.empty() || t.activation_bytes.size() == n, "simulator: ", n,
                  " blocks in the schedule but ", t.activation_bytes.size(), " activation sizes");
  BLOCKSWAP_CHECK(t.compressed_bytes.empty() || t.compressed_bytes.size() == n, "simulator: ", n,
                  " blocks in the schedule but ", t.compressed_bytes.size(), " compressed sizes");
}

inline bool from_file(const BlockTiming& timing, int64_t block) {
  return !timing.from_file.empty() && timing.from_file[block];
}

inline bool decoded(const BlockTiming& timing, int64_t block) {
  return !timing.compressed_bytes.empty() && !from_file(timing, block);
}

// A load of `block` on the copy stream: its bytes over the link, compressed where they are
// (BlockTiming::compressed_bytes; the file's are not).
inline double copy_seconds(const BlockTiming& timing, int64_t block, const LinkModel& link) {
  return link.seconds(decoded(timing, block) ? timing.compressed_bytes[block]
                                             : timing.bytes[block]);
}

// Then their decode (0 for a raw load), on the decode stream (Note [a decode step]).
inline double decode_seconds(const BlockTiming& timing, int64_t block, const LinkModel& link) {
  return decoded(timing, block) ? link.decode_seconds(timing.bytes[block]) : 0.0;
}

// A load from its copy's start to its decode's end: the copy, then the decode.
inline double load_seconds(const BlockTiming& timing, int64_t block, const LinkModel& link) {
  return copy_seconds(timing, block, link) + decode_seconds(timing, block, link);
}

inline std::size_t activation_bytes(const BlockTiming& timing, int64_t block) {
  return timing.activation_bytes.empty() ? 0 : timing.activation_bytes[block];
}

inline bool reads_file(const SimulatedList& list) {
  const std::vector<bool>& f = list.timing->from_file;
  return std::find(f.begin(), f.end(), true) != f.end();
}

inline void check_lists(std::span<const SimulatedList> lists, const LinkModel& link) {
  BLOCKSWAP_CHECK(!lists.empty(), "simulator: no block list");
  BLOCKSWAP_CHECK(std::isfinite(link.bytes_per_second) && std::isfinite(link.latency_seconds) &&
                      link.bytes_per_second > 0 && link.latency_seconds >= 0,
                  "simulator: the link needs bytes_per_second > 0 and latency_seconds >= 0, got ",
                  link.bytes_per_second, " and ", link.latency_seconds);
  BLOCKSWAP_CHECK(std::isfinite(link.decode_bytes_per_second) && link.decode_bytes_per_second >= 0,
                  "simulator: decode_bytes_per_second must be >= 0 (0: decoding takes no time), "
                  "got ",
                  link.decode_bytes_per_second);
  for (const SimulatedList& list : lists) {
    check_list(list);
    BLOCKSWAP_CHECK(list.schedule->mode() == lists[0].schedule->mode(),
                    "simulator: every list of a step must be in the same mode");
    BLOCKSWAP_CHECK(!reads_file(list) ||
                        (std::isfinite(link.disk_bytes_per_second) &&
                         link.disk_bytes_per_second > 0 && link.staging_buffers >= 1),
                    "simulator: file-tier blocks need disk_bytes_per_second > 0 and "
                    "staging_buffers >= 1, got ",
                    link.disk_bytes_per_second, " and ", link.staging_buffers);
  }
}

inline double compute_seconds(const BlockTiming& timing, const Op& op) {
  const double forward = timing.forward_seconds[op.block];
  return op.kind == Op::Kind::backward ? forward * timing.backward_factor : forward;
}

} // namespace blockswap::simulated
