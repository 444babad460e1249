// The autograd wiring of src/torch, and the trap it exists for (Note [trap 1]).
#include "block_autograd.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace blockswap::torch_frontend {
namespace {

struct Recorder : BackwardEvents {
  std::vector<std::string> events;
  std::function<void()> on_wait;
  void wait_for_block(int64_t block) override {
    events.push_back("wait " + std::to_string(block));
    if (on_wait) on_wait();
  }
  void block_backward_done(int64_t block) override {
    events.push_back("done " + std::to_string(block));
  }
};

// A "slot": weights live in memory the test controls, as block weights live in device slots.
struct Slot {
  std::vector<float> memory;
  explicit Slot(const torch::Tensor& values)
      : memory(values.data_ptr<float>(), values.data_ptr<float>() + values.numel()) {}
  torch::Tensor view(torch::IntArrayRef sizes) { return torch::from_blob(memory.data(), sizes); }
  void overwrite(const torch::Tensor& values) {
    std::copy(values.data_ptr<float>(), values.data_ptr<float>() + values.numel(), memory.begin());
  }
};

struct Scenario {
  int seeded = (torch::manual_seed(3), 0);
  torch::Tensor w = torch::randn({8, 8}), other = torch::randn({8, 8}), x = torch::randn({4, 8});
  torch::Tensor reference_grad() {
    torch::Tensor xr = x.clone().requires_grad_(true);
    torch::linear(xr, w).sum().backward();
    return xr.grad();
  }
};

// Between forward and backward the block's slot receives another block's weights and the
// block itself comes back in another slot. Plain autograd reads the old slot.
TEST(BlockAutograd, TrapOneWithoutRecomputeReadsAnotherBlocksWeights) {
  Scenario s;
  Slot first(s.w), second(s.w);
  torch::Tensor weight = first.view({8, 8});
  torch::Tensor x = s.x.clone().requires_grad_(true);
  torch::Tensor loss = torch::linear(x, weight).sum();
  first.overwrite(s.other);             // the slot now holds another block
  weight.set_data(second.view({8, 8})); // the block is back, elsewhere
  loss.backward();
  EXPECT_FALSE(torch::equal(x.grad(), s.reference_grad()))
      << "saved views followed set_data: trap 1 no longer exists in this LibTorch";
}

TEST(BlockAutograd, RecomputeReadsTheBlocksCurrentWeights) {
  Scenario s;
  Slot first(s.w), second(s.w);
  torch::Tensor weight = first.view({8, 8});
  Recorder events;
  auto shared = std::shared_ptr<Recorder>(&events, [](Recorder*) {});
  events.on_wait = [&] { // the block is loaded into another slot just before its backward
    first.overwrite(s.other);
    weight.set_data(second.view({8, 8}));
  };
  torch::Tensor x = s.x.clone().requires_grad_(true);
  const auto out = run_with_recompute(shared, 4, {x}, [&](const variable_list& in) {
    return variable_list{torch::linear(in[0], weight)};
  });
  out[0].sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), s.reference_grad()));
  EXPECT_EQ(events.events, (std::vector<std::string>{"wait 4", "done 4"}));
}

TEST(BlockAutograd, RecomputeTrainsAdaptersWhenNoInputRequiresGrad) {
  torch::manual_seed(5);
  const torch::Tensor w = torch::randn({8, 8}), x = torch::randn({4, 8});
  torch::Tensor lora = torch::randn({8, 8}).requires_grad_(true);
  torch::linear(x, w + lora).pow(2).sum().backward();
  const torch::Tensor expected = lora.grad().clone();
  lora.mutable_grad().zero_();
  Recorder events;
  auto shared = std::shared_ptr<Recorder>(&events, [](Recorder*) {});
  const auto out = run_with_recompute(shared, 0, {x}, [&](const variable_list& in) {
    return variable_list{torch::linear(in[0], w + lora)};
  });
  ASSERT_TRUE(out[0].requires_grad());
  out[0].pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(lora.grad(), expected));
}

TEST(BlockAutograd, HookFiresAfterTheBlocksBackward) {
  torch::manual_seed(6);
  const torch::Tensor w = torch::randn({8, 8});
  const torch::Tensor context = torch::randn({4, 8}); // needs no gradient and gets none
  torch::Tensor x = torch::randn({4, 8}).requires_grad_(true);
  Recorder events;
  auto shared = std::shared_ptr<Recorder>(&events, [](Recorder*) {});
  torch::Tensor seen_grad;
  const auto out = run_with_backward_hook(shared, 2, {x, context}, [&](const variable_list& in) {
    EXPECT_FALSE(in[1].requires_grad());
    torch::Tensor y = torch::linear(in[0], w) + in[1];
    y.register_hook([&](torch::Tensor g) {
      seen_grad = g;
      events.events.push_back("block");
    });
    return variable_list{y};
  });
  out[0].sum().backward();
  EXPECT_EQ(events.events, (std::vector<std::string>{"block", "done 2"}));
  EXPECT_TRUE(x.grad().defined());
}

TEST(BlockAutograd, HookFiresWhenNoInputRequiresGrad) {
  torch::Tensor lora = torch::randn({8, 8}).requires_grad_(true);
  Recorder events;
  auto shared = std::shared_ptr<Recorder>(&events, [](Recorder*) {});
  const auto out =
      run_with_backward_hook(shared, 0, {torch::randn({4, 8})}, [&](const variable_list& in) {
        return variable_list{torch::linear(in[0], lora)};
      });
  out[0].sum().backward();
  EXPECT_EQ(events.events, (std::vector<std::string>{"done 0"}));
  EXPECT_TRUE(lora.grad().defined());
}

TEST(BlockAutograd, RecomputeAfterTheOffloaderIsGoneIsAClearError) {
  auto events = std::make_shared<Recorder>();
  torch::Tensor lora = torch::randn({8, 8}).requires_grad_(true);
  const auto out =
      run_with_recompute(events, 1, {torch::randn({4, 8})}, [lora](const variable_list& in) {
        return variable_list{torch::linear(in[0], lora)};
      });
  events.reset();
  try {
    out[0].sum().backward();
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("was destroyed"), std::string::npos) << e.what();
  }
}

} // namespace
} // namespace blockswap::torch_frontend
