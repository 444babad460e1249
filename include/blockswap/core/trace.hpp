// A timeline of compute and copies, written as Chrome trace events (open the file in
// https://ui.perfetto.dev or chrome://tracing). Thread-safe: the copy thread adds spans too.
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

namespace blockswap {

enum class Track { compute, copy };

class Trace {
public:
  using Clock = std::chrono::steady_clock;

  Trace() = default;
  void add(std::string name, Track track, Clock::time_point start, Clock::time_point end);
  std::size_t size() const;
  // Chrome trace JSON: one process, a "compute" and a "copy" thread, a complete ("X") event
  // per span, times in microseconds from the first span.
  std::string to_chrome_json() const;
  // Throws Error when the file cannot be written.
  void write_chrome_json(const std::string& path) const;

private:
  struct Span {
    std::string name;
    Track track;
    Clock::time_point start, end;
  };
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
};

} // namespace blockswap
