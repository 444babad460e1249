#include "blockswap/core/log.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

// Every warning and debug line goes through one sink: set one, and it gets the engine's debug
// lines (without EngineOptions::log) and warnings with their label.
TEST(Log, OneSinkTakesWarningsAndDebugLines) {
  std::vector<std::string> lines;
  const LogSink before = set_log_sink([&](const std::string& line) { lines.push_back(line); });
  warn("blocks", "a warning");
  warn("", "no label");
  {
    Engine engine(std::make_shared<EmulatedDevice>(), {64, 64, 64},
                  {.blocks_to_swap = 1, .debug = true}, "double_blocks");
    engine.prepare();
    for (int64_t b = 0; b < 3; ++b) {
      engine.wait_for_block(b);
      engine.after_forward(b);
    }
  }
  set_log_sink(before);
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(lines[0], "[blocks] a warning");
  EXPECT_EQ(lines[1], "blockswap: no label");
  EXPECT_EQ(lines[2].rfind("[double_blocks] Move block", 0), 0u) << lines[2];
}

TEST(Log, ASinkThatThrowsLosesNothingAndThrowsNothing) {
  const LogSink before = set_log_sink([](const std::string&) { throw 1; });
  testing::internal::CaptureStderr();
  warn("blocks", "still told");
  const std::string err = testing::internal::GetCapturedStderr();
  set_log_sink(before);
  EXPECT_NE(err.find("[blocks] still told"), std::string::npos) << err;
}

} // namespace
} // namespace blockswap
