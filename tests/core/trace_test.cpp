#include "blockswap/core/trace.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace blockswap {
namespace {

TEST(Trace, WritesChromeCompleteEventsOnTwoTracks) {
  Trace trace;
  const auto t0 = Trace::Clock::now();
  trace.add("forward 0", Track::compute, t0, t0 + std::chrono::milliseconds(2));
  trace.add("load block 3", Track::copy, t0 + std::chrono::milliseconds(1),
            t0 + std::chrono::milliseconds(4));
  const auto json = nlohmann::json::parse(trace.to_chrome_json());
  const auto& events = json.at("traceEvents");
  int complete = 0;
  for (const auto& e : events) {
    if (e.at("ph") != "X") continue;
    ++complete;
    if (e.at("name") == "load block 3") {
      EXPECT_EQ(e.at("tid"), 2);
      EXPECT_NEAR(e.at("ts").get<double>(), 1000, 1);
      EXPECT_NEAR(e.at("dur").get<double>(), 3000, 1);
    } else {
      EXPECT_EQ(e.at("tid"), 1);
      EXPECT_NEAR(e.at("ts").get<double>(), 0, 1);
    }
  }
  EXPECT_EQ(complete, 2);
}

} // namespace
} // namespace blockswap
