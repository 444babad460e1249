// blockswap's one path for what it says without throwing: warnings (pageable host memory, an
// error caught in a destructor, a rank that could not be told) and the seed's debug lines. Each
// line goes to the process's sink, stderr unless one is set. An engine's own
// EngineOptions::log, when set, takes that engine's debug lines instead.
#pragma once

#include <functional>
#include <string>

namespace blockswap {

using LogSink = std::function<void(const std::string& line)>;

// Where lines go from now on (empty: stderr); returns the sink before. Thread-safe; the sink
// is called from whichever thread logs, one line at a time, and must not throw.
LogSink set_log_sink(LogSink sink);

// One line to the sink. Never throws.
void log_line(const std::string& line) noexcept;
// "[label] text" (or "blockswap: text" without a label) to the sink. Never throws.
void warn(const std::string& label, const std::string& text) noexcept;

} // namespace blockswap
