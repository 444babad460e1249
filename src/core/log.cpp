#include "blockswap/core/log.hpp"

#include <cstdio>
#include <mutex>
#include <utility>

namespace blockswap {
namespace {

struct Sink {
  std::mutex mutex;
  LogSink sink;
};

Sink& sink() {
  static Sink instance;
  return instance;
}

} // namespace

LogSink set_log_sink(LogSink next) {
  std::lock_guard lock(sink().mutex);
  return std::exchange(sink().sink, std::move(next));
}

void log_line(const std::string& line) noexcept {
  std::lock_guard lock(sink().mutex);
  try {
    if (sink().sink) {
      sink().sink(line);
      return;
    }
  } catch (...) { // a sink that throws loses its line to stderr
  }
  std::fprintf(stderr, "%s\n", line.c_str());
}

void warn(const std::string& label, const std::string& text) noexcept {
  try {
    log_line(label.empty() ? "blockswap: " + text : "[" + label + "] " + text);
  } catch (...) { // out of memory building the line
  }
}

} // namespace blockswap
