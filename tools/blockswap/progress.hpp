// A one-line progress display on a terminal; silent when stderr is not a terminal.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <string>

namespace blockswap::tool {

class Progress {
public:
  Progress() : enabled_(isatty(fileno(stderr)) != 0) {}
  ~Progress() { done(); }
  void update(const std::string& what, int current, int total) {
    if (!enabled_) return;
    std::fprintf(stderr, "\r\033[K%s %d/%d", what.c_str(), current, total);
    std::fflush(stderr);
    shown_ = true;
  }
  void done() {
    if (!shown_) return;
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    shown_ = false;
  }

private:
  bool enabled_;
  bool shown_ = false;
};

} // namespace blockswap::tool
