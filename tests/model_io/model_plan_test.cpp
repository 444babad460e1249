#include "blockswap/model_io/model_plan.hpp"

#include <gtest/gtest.h>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

TensorInfo tensor(std::string name, uint64_t bytes) {
  static uint64_t offset = 0;
  TensorInfo t{std::move(name), "U8", {static_cast<int64_t>(bytes)}, offset, offset + bytes};
  offset += bytes;
  return t;
}

TEST(ParseSize, AcceptsTheDocumentedForms) {
  EXPECT_EQ(parse_size("12GiB"), 12ull << 30);
  EXPECT_EQ(parse_size("12G"), 12ull << 30);
  EXPECT_EQ(parse_size("12000MB"), 12'000'000'000ull);
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("1.5 gib"), 3ull << 29);
  EXPECT_EQ(parse_size("512B"), 512u);
  for (const char* bad : {"", "GiB", "-1GiB", "12XB", "1.2.3G", "1e400"}) {
    EXPECT_THROW(parse_size(bad), Error) << bad;
  }
}

TEST(FormatBytes, PicksAUnit) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(12ull << 30), "12.00 GiB");
}

TEST(GroupBlocks, FindsEachGroupAndTheRest) {
  const std::vector<TensorInfo> tensors{
      tensor("img_in.weight", 100),
      tensor("double_blocks.0.img_attn.qkv.weight", 10),
      tensor("double_blocks.0.img_mlp.0.weight", 20),
      tensor("double_blocks.1.img_attn.qkv.weight", 30),
      tensor("single_blocks.0.linear1.weight", 5),
      tensor("model.layers.3.mlp.weight", 7),
      tensor("final_layer.linear.weight", 1),
  };
  const ModelLayout layout = group_blocks(tensors);
  EXPECT_EQ(layout.non_block_bytes, 101u);
  ASSERT_EQ(layout.groups.size(), 3u);
  EXPECT_EQ(layout.groups[0].name, "double_blocks");
  EXPECT_EQ(layout.groups[0].block_bytes, (std::vector<uint64_t>{30, 30}));
  EXPECT_EQ(layout.groups[1].name, "single_blocks");
  EXPECT_EQ(layout.groups[2].name, "model.layers");
}

ModelLayout two_groups() {
  // 10 blocks of 1 MiB and 20 of 0.5 MiB, 3 MiB outside them.
  ModelLayout layout{3 << 20,
                     {{"big", std::vector<uint64_t>(10, 1 << 20), {}},
                      {"small", std::vector<uint64_t>(20, 1 << 19), {}}}};
  return layout;
}

TEST(PlanModel, EverythingFitsMeansNoSwap) {
  const ModelPlan plan = plan_model(two_groups(), 100 << 20, Mode::training);
  EXPECT_EQ(plan.groups[0].blocks_to_swap, 0);
  EXPECT_EQ(plan.groups[1].blocks_to_swap, 0);
  EXPECT_EQ(plan.device_bytes, 23u << 20);
  EXPECT_EQ(plan.moved_bytes, 0u);
}

TEST(PlanModel, FitsTheBudgetMovingTheFewestBytes) {
  for (Mode mode : {Mode::training, Mode::forward_only}) {
    for (uint64_t budget_mib : {22, 18, 12, 8, 6}) {
      const ModelPlan plan = plan_model(two_groups(), budget_mib << 20, mode);
      EXPECT_LE(plan.device_bytes, budget_mib << 20) << budget_mib;
      // No single group could swap one block fewer and still fit.
      for (const GroupPlan& g : plan.groups) {
        if (g.blocks_to_swap == 0) continue;
        EXPECT_GT(plan.device_bytes + g.block_bytes, budget_mib << 20)
            << g.name << " " << budget_mib;
      }
    }
  }
}

TEST(PlanModel, TooSmallABudgetNamesTheSmallestThatWorks) {
  // Training keeps 1 slot per group (K = N-1): 3 MiB + 1 MiB + 0.5 MiB = 4.5 MiB.
  try {
    plan_model(two_groups(), 4 << 20, Mode::training);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the smallest budget that works is 4.50 MiB"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(plan_model(ModelLayout{}, 1 << 30, Mode::training), Error);
}

} // namespace
} // namespace blockswap
