// The autograd wiring of src/torch, and the trap it exists for (Note [trap 1]).
#include "block_autograd.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"

namespace blockswap::torch_frontend {
namespace {

struct Recorder : BackwardEvents {
  std::vector<std::string> events;
  std::function<void()> on_start;
  void block_backward_starts(int64_t block, const Buffer*) override {
    events.push_back("starts " + std::to_string(block));
    if (on_start) on_start();
  }
  std::vector<torch::Tensor> grads_seen;
  torch::Tensor watched;
  void gradient_ready(int64_t block, std::size_t param) override {
    events.push_back("gradient " + std::to_string(block) + "." + std::to_string(param));
    grads_seen.push_back(watched.grad().clone());
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

// The block's slot holds another block when its backward comes; the exit node's callback
// puts the block back into that very slot before the block's backward reads it.
TEST(BlockAutograd, ExitNodeRunsBeforeTheBlocksBackward) {
  Scenario s;
  Slot first(s.w);
  torch::Tensor weight = first.view({8, 8});
  auto events = std::make_shared<Recorder>();
  events->on_start = [&] { first.overwrite(s.w); };
  torch::Tensor x = s.x.clone().requires_grad_(true);
  torch::Tensor y = torch::linear(x, weight);
  y.register_hook([&](torch::Tensor g) {
    events->events.push_back("block");
    return g;
  });
  const auto out = exit_block(events, 4, nullptr, "block 4", {y});
  first.overwrite(s.other); // another block takes the slot
  out[0].sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), s.reference_grad()));
  EXPECT_EQ(events->events, (std::vector<std::string>{"starts 4", "block"}));
}

// A tensor used inside and outside a block: the exit node does not change how autograd sums
// its gradients, so they stay bitwise those of the plain model.
TEST(BlockAutograd, GradientsAreSummedAsWithoutTheNode) {
  torch::manual_seed(8);
  const torch::Tensor w = torch::randn({8, 8}) * 3, x0 = torch::randn({4, 8});
  auto events = std::make_shared<Recorder>();
  auto run = [&](bool bracketed) {
    torch::Tensor x = x0.clone().requires_grad_(true);
    torch::Tensor h = torch::linear(x, w).tanh();
    if (bracketed) h = exit_block(events, 0, nullptr, "b", {h})[0];
    torch::Tensor a = torch::linear(h, w).sin(), b = h * 1.7, c = torch::linear(h, w * 0.3);
    (a.sum() + b.pow(2).sum() + c.cos().sum()).backward();
    return x.grad();
  };
  EXPECT_TRUE(torch::equal(run(false), run(true)));
}

TEST(BlockAutograd, UndefinedAndIntegerTensorsPassThrough) {
  auto events = std::make_shared<Recorder>();
  torch::Tensor x = torch::randn({4, 8}).requires_grad_(true);
  const torch::Tensor ids = torch::arange(4);
  const auto out = exit_block(events, 1, nullptr, "block 1", {x * 2, torch::Tensor(), ids});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_FALSE(out[1].defined());
  EXPECT_TRUE(torch::equal(out[2], ids));
  EXPECT_FALSE(out[2].requires_grad());
  out[0].sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), torch::full({4, 8}, 2.0)));
}

TEST(BlockAutograd, NoExitNodeWhenNothingRequiresGrad) {
  auto events = std::make_shared<Recorder>();
  const torch::Tensor y = torch::randn({4, 8});
  const auto out = exit_block(events, 1, nullptr, "block 1", {y});
  EXPECT_TRUE(out[0].is_same(y));
}

TEST(BlockAutograd, BackwardAfterTheOffloaderIsGoneIsAClearError) {
  auto events = std::make_shared<Recorder>();
  torch::Tensor lora = torch::randn({8, 8}).requires_grad_(true);
  const auto out = exit_block(events, 1, nullptr, "[blocks] block 1",
                              {torch::linear(torch::randn({4, 8}), lora)});
  events.reset();
  try {
    out[0].sum().backward();
    FAIL() << "no error";
  } catch (const Error& e) { // autograd keeps the exception's type
    EXPECT_NE(std::string(e.what()).find("[blocks] block 1's backward runs after its "
                                         "ModelOffloader was destroyed"),
              std::string::npos)
        << e.what();
  }
}

// Note [fused step]: the hook sees the gradient summed over every use of the parameter in the
// backward, once, after it was accumulated into .grad, and before the backward of what came
// earlier in the forward.
TEST(BlockAutograd, GradientHookFiresOnceAfterTheWholeGradientIsAccumulated) {
  auto events = std::make_shared<Recorder>();
  torch::Tensor w = torch::randn({8, 8}).requires_grad_(true);
  events->watched = w;
  const auto accumulator = on_gradient(w, events, 3, 1);
  torch::Tensor x = torch::randn({4, 8}).requires_grad_(true);
  torch::Tensor x3 = x * 3;
  x3.register_hook([&](torch::Tensor g) {
    events->events.push_back("before the block");
    return g;
  });
  torch::Tensor h = torch::linear(x3, w);
  h.register_hook([&](torch::Tensor g) {
    events->events.push_back("input of the second use");
    return g;
  });
  torch::Tensor y = torch::linear(h, w); // w used twice
  y.sum().backward();
  ASSERT_EQ(events->grads_seen.size(), 1u);
  EXPECT_TRUE(torch::equal(events->grads_seen[0], w.grad()));
  const std::vector<std::string> order = events->events;
  const auto at = [&](const std::string& e) { return std::find(order.begin(), order.end(), e); };
  EXPECT_NE(at("gradient 3.1"), order.end());
  EXPECT_LT(at("gradient 3.1"), at("before the block"));
  // The same accumulator, the same hook, next time.
  EXPECT_TRUE(compat::grad_accumulator(w) == accumulator);
}

} // namespace
} // namespace blockswap::torch_frontend
