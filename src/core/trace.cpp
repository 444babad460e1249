#include "blockswap/core/trace.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

#include "blockswap/core/error.hpp"

namespace blockswap {

void Trace::add(std::string name, Track track, Clock::time_point start, Clock::time_point end) {
  std::lock_guard lock(mutex_);
  spans_.push_back(Span{std::move(name), track, start, end});
}

std::size_t Trace::size() const {
  std::lock_guard lock(mutex_);
  return spans_.size();
}

std::string Trace::to_chrome_json() const {
  std::lock_guard lock(mutex_);
  using nlohmann::json;
  json events = json::array();
  for (auto [tid, name] : {std::pair{1, "compute"}, std::pair{2, "copy"}}) {
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"name", name}}}});
  }
  Clock::time_point origin = Clock::time_point::max();
  for (const Span& s : spans_) origin = std::min(origin, s.start);
  auto micros = [&](Clock::duration d) {
    return std::chrono::duration<double, std::micro>(d).count();
  };
  for (const Span& s : spans_) {
    events.push_back({{"ph", "X"},
                      {"name", s.name},
                      {"pid", 1},
                      {"tid", s.track == Track::compute ? 1 : 2},
                      {"ts", micros(s.start - origin)},
                      {"dur", micros(s.end - s.start)}});
  }
  return json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

void Trace::write_chrome_json(const std::string& path) const {
  std::ofstream file(path, std::ios::trunc);
  BLOCKSWAP_CHECK(file.is_open(), "cannot write the trace to '", path, "'");
  file << to_chrome_json();
  BLOCKSWAP_CHECK(file.good(), "error while writing the trace to '", path, "'");
}

} // namespace blockswap
