#include "blockswap/core/planner.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

TEST(Planner, ChoosesTheSmallestKThatFits) {
  const std::vector<std::size_t> blocks(10, 1024);
  EXPECT_EQ(plan_blocks_to_swap(blocks, 10 * 1024, Mode::training), 0);
  EXPECT_EQ(plan_blocks_to_swap(blocks, 10 * 1024 - 1, Mode::training), 1);
  EXPECT_EQ(plan_blocks_to_swap(blocks, 4 * 1024 + 100, Mode::forward_only), 6);
  EXPECT_EQ(plan_blocks_to_swap(blocks, 1024, Mode::forward_only), 9);
}

TEST(Planner, BudgetTooSmallNamesTheSmallestThatWorks) {
  const std::vector<std::size_t> blocks(10, 1024);
  try {
    plan_blocks_to_swap(blocks, 1024, Mode::training);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("smallest budget that works is 2048 bytes"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(plan_blocks_to_swap(std::vector<std::size_t>{}, 1 << 20, Mode::training), Error);
}

} // namespace
} // namespace blockswap
