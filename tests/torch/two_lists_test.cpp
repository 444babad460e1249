// A model with two block lists (FLUX-like: double blocks, then wider single blocks), one
// offloader per list, both on one shared Device: training is bitwise the model's without
// swapping, the device holds exactly the slots the planner planned for both lists together,
// and every copy of both goes through one copy engine.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>

#include "test_model.hpp"

namespace blockswap {
namespace {

// A single block: wider than the double blocks (TestBlock), no context input, LoRA on fc1.
struct SingleBlockImpl : torch::nn::Module {
  torch::nn::LayerNorm norm{torch::nn::LayerNormOptions({kDim})};
  torch::nn::Linear fc1{kDim, 4 * kDim}, fc2{4 * kDim, kDim};
  torch::Tensor lora_a, lora_b;

  SingleBlockImpl() {
    register_module("norm", norm);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    for (auto& p : parameters()) p.set_requires_grad(false);
    lora_a = register_parameter("lora_a", torch::randn({kRank, kDim}) * 0.1);
    lora_b = register_parameter("lora_b", torch::randn({4 * kDim, kRank}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto y = norm(x);
    const auto z = fc1(y) + torch::matmul(torch::matmul(y, lora_a.t()), lora_b.t());
    return x + fc2(torch::gelu(z));
  }
};
TORCH_MODULE(SingleBlock);

constexpr int64_t kDoubles = 4;
constexpr int64_t kSingles = 6;

struct TwoListModel {
  Model doubles{kDoubles};
  std::vector<SingleBlock> singles;

  TwoListModel() {
    torch::manual_seed(23);
    for (int64_t i = 0; i < kSingles; ++i) {
      singles.emplace_back();
      singles.back()->to(kDevice);
    }
  }
  BlockList single_modules() const {
    BlockList out;
    for (const auto& b : singles) out.push_back(b.ptr());
    return out;
  }
  std::vector<torch::Tensor> lora() const {
    std::vector<torch::Tensor> out = doubles.lora();
    for (const auto& b : singles) {
      out.push_back(b->lora_a);
      out.push_back(b->lora_b);
    }
    return out;
  }
};

// Three SGD steps on the adapters; `forward` runs both lists.
template <typename Forward>
std::vector<torch::Tensor> train(TwoListModel& model, Forward&& forward, int steps = 3) {
  const Inputs in;
  std::vector<torch::Tensor> seen;
  for (int step = 0; step < steps; ++step) {
    torch::Tensor x = in.x.clone().requires_grad_(true);
    const torch::Tensor loss = forward(x, in.context).pow(2).mean();
    loss.backward();
    seen.push_back(loss.detach());
    seen.push_back(x.grad());
    torch::NoGradGuard no_grad;
    for (auto& p : model.lora()) {
      seen.push_back(p.grad().clone());
      p.sub_(p.grad() * 0.5);
      p.mutable_grad().zero_();
    }
  }
  return seen;
}

std::vector<torch::Tensor> train_without_swapping() {
  TwoListModel model;
  return train(model, [&](torch::Tensor h, const torch::Tensor& context) {
    h = model.doubles.forward(h, context);
    for (auto& b : model.singles) h = b->forward(h);
    return h;
  });
}

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    expect_bitwise(a[i], b[i], what + " #" + std::to_string(i));
}

// The trace's copy spans, as [start, end] in microseconds.
std::vector<std::pair<double, double>> copy_spans(const Trace& trace) {
  std::vector<std::pair<double, double>> spans;
  const auto json = nlohmann::json::parse(trace.to_chrome_json());
  for (const auto& e : json["traceEvents"]) {
    if (e.value("ph", "") == "X" && e["tid"] == 2) {
      spans.emplace_back(e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>());
    }
  }
  std::sort(spans.begin(), spans.end());
  return spans;
}

SwapPlan plan_for(const TwoListModel& model, std::size_t budget) {
  return plan_block_lists({model.doubles.modules(), model.single_modules()}, budget, Mode::training,
                          kDevice);
}

// A budget that forces both lists to swap: their slots at the largest K, plus half a slot.
std::size_t tight_budget(const TwoListModel& model) {
  const auto d = packed_block_bytes(model.doubles.modules(), kDevice);
  const auto s = packed_block_bytes(model.single_modules(), kDevice);
  return 2 * layout::slot_bytes(d) + 3 * layout::slot_bytes(s);
}

TEST(TwoLists, SharedDeviceTrainsBitwiseWithThePlannedPeakAndOneCopyEngine) {
  const auto expected = train_without_swapping();
  TwoListModel model;
  const std::size_t budget = tight_budget(model);
  const SwapPlan plan = plan_for(model, budget);
  ASSERT_GT(plan.lists[0].blocks_to_swap + plan.lists[1].blocks_to_swap, 0);

  auto device = open_device(kDevice, {.budget_bytes = budget, .emulated_link_gbps = 20});
  auto trace = std::make_shared<Trace>(); // both lists: one timeline
  Options o = options(plan.lists[0].blocks_to_swap, true);
  o.device = c10::kCPU; // the device is the shared one
  o.shared_device = device;
  o.trace = trace;
  ModelOffloader doubles("double_blocks", model.doubles.modules(), o);
  o.blocks_to_swap = plan.lists[1].blocks_to_swap;
  ModelOffloader singles("single_blocks", model.single_modules(), o);

  const auto got = train(model, [&](torch::Tensor h, const torch::Tensor& context) {
    doubles.prepare_block_devices_before_forward();
    singles.prepare_block_devices_before_forward();
    h = forward_run_block(doubles, model.doubles, h, context);
    for (int64_t i = 0; i < kSingles; ++i) {
      SingleBlock block = model.singles[i];
      h = singles.run_block(i, {h}, [block](const variable_list& in) mutable {
        return variable_list{block->forward(in[0])};
      })[0];
    }
    return h;
  });
  expect_same(expected, got, "two lists, shared device");

  EXPECT_EQ(device->memory().peak_device_bytes, plan.device_bytes);
  EXPECT_EQ(doubles.stats().peak_device_bytes, plan.lists[0].device_bytes);
  EXPECT_EQ(singles.stats().peak_device_bytes, plan.lists[1].device_bytes);
  EXPECT_LE(plan.device_bytes, budget);
  // Per step: 2K loads of each list.
  EXPECT_EQ(doubles.stats().moves, 3u * 2 * plan.lists[0].blocks_to_swap);
  EXPECT_EQ(singles.stats().moves, 3u * 2 * plan.lists[1].blocks_to_swap);
  // One copy engine: no two copies of either list ever overlap.
  const auto spans = copy_spans(*trace);
  ASSERT_FALSE(spans.empty());
  for (std::size_t i = 1; i < spans.size(); ++i) {
    EXPECT_LE(spans[i - 1].second, spans[i].first + 1) << "copies " << i - 1 << " and " << i;
  }
}

// The verbs by hand for one list and run_block for the other, forward-only passes in between.
TEST(TwoLists, VerbsByHandAndAnEvalPassInBetween) {
  const auto expected = train_without_swapping();
  TwoListModel model;
  const std::size_t budget = tight_budget(model); // planned before the offloaders pack the blocks
  const SwapPlan plan = plan_for(model, budget);
  auto device = open_device(kDevice, {.budget_bytes = budget});
  Options o = options(plan.lists[0].blocks_to_swap, true);
  o.device = c10::kCPU;
  o.shared_device = device;
  ModelOffloader doubles("double_blocks", model.doubles.modules(), o);
  o.blocks_to_swap = plan.lists[1].blocks_to_swap;
  ModelOffloader singles("single_blocks", model.single_modules(), o);

  auto forward = [&](torch::Tensor h, const torch::Tensor& context) {
    doubles.prepare_block_devices_before_forward();
    singles.prepare_block_devices_before_forward();
    for (int64_t i = 0; i < kDoubles; ++i) {
      doubles.wait_for_block(i);
      h = doubles.submit_move_blocks_forward(i, {model.doubles.blocks[i]->forward(h, context)})[0];
    }
    for (int64_t i = 0; i < kSingles; ++i) {
      singles.wait_for_block(i);
      h = singles.submit_move_blocks_forward(i, {model.singles[i]->forward(h)})[0];
    }
    return h;
  };
  const auto got = train(model, [&](torch::Tensor h, const torch::Tensor& context) {
    {
      torch::NoGradGuard no_grad; // an eval pass first, forward-only
      doubles.set_forward_only(true);
      singles.set_forward_only(true);
      forward(h, context);
      doubles.set_forward_only(false);
      singles.set_forward_only(false);
    }
    return forward(h, context);
  });
  expect_same(expected, got, "verbs by hand");
  EXPECT_LE(device->memory().peak_device_bytes, budget);
}

// The planner of several lists: the combination that moves the fewest bytes, tried against
// every combination of K.
TEST(TwoLists, PlanMovesTheFewestBytesOfEveryCombinationThatFits) {
  TwoListModel model;
  const auto d = packed_block_bytes(model.doubles.modules(), kDevice);
  const auto s = packed_block_bytes(model.single_modules(), kDevice);
  ASSERT_LT(layout::slot_bytes(d), layout::slot_bytes(s)) << "the lists should differ in size";
  // Training moves 2K blocks of a list per step, each counted at the list's average size.
  auto moved = [](const std::vector<std::size_t>& list, int64_t k) {
    const std::size_t total = std::accumulate(list.begin(), list.end(), std::size_t{0});
    return static_cast<std::size_t>(2 * k) * (total / list.size());
  };
  const std::size_t all = layout::slot_device_bytes(d, 0) + layout::slot_device_bytes(s, 0);
  for (std::size_t budget = tight_budget(model); budget <= all;
       budget += layout::slot_bytes(d) / 2) {
    const SwapPlan plan = plan_for(model, budget);
    std::size_t best = SIZE_MAX;
    for (int64_t kd = 0; kd <= kDoubles - 1; ++kd) {
      for (int64_t ks = 0; ks <= kSingles - 1; ++ks) {
        if (layout::slot_device_bytes(d, kd) + layout::slot_device_bytes(s, ks) > budget) continue;
        best = std::min(best, moved(d, kd) + moved(s, ks));
      }
    }
    EXPECT_EQ(plan.moved_bytes, best) << "budget " << budget;
    EXPECT_LE(plan.device_bytes, budget);
    EXPECT_EQ(plan.device_bytes, layout::slot_device_bytes(d, plan.lists[0].blocks_to_swap) +
                                     layout::slot_device_bytes(s, plan.lists[1].blocks_to_swap));
  }
}

TEST(TwoLists, AListThatDoesNotFitTheSharedBudgetIsAnErrorAndTheOtherRunsOn) {
  TwoListModel model;
  const auto d = packed_block_bytes(model.doubles.modules(), kDevice);
  auto device = open_device(kDevice, {.budget_bytes = layout::slot_device_bytes(d, 0)});
  Options o = options(0, true);
  o.device = c10::kCPU;
  o.shared_device = device;
  ModelOffloader doubles("double_blocks", model.doubles.modules(), o); // takes the whole budget
  const torch::Tensor before = model.singles[0]->fc1->weight.clone();
  o.blocks_to_swap = kSingles - 2;
  expect_error([&] { ModelOffloader("single_blocks", model.single_modules(), o); },
               "does not fit the device budget");
  // Nothing of the failed offloader stays: its weights are as they were, the budget as it was.
  expect_bitwise(model.singles[0]->fc1->weight, before, "single block weights");
  EXPECT_EQ(device->available_bytes(), 0u);
  o.blocks_to_swap = -1; // the planner: no budget left
  expect_error([&] { ModelOffloader("single_blocks", model.single_modules(), o); }, "cannot hold");
  const Inputs in;
  torch::NoGradGuard no_grad;
  doubles.prepare_block_devices_before_forward();
  expect_bitwise(forward_run_block(doubles, model.doubles, in.x, in.context),
                 model.doubles.forward(in.x, in.context), "the first list after the failure");
}

TEST(TwoLists, SharedDeviceOptionsMustNotContradictTheDevice) {
  TwoListModel model;
  auto device = open_device(c10::kCPU, {});
  Options o = options(1, true);
  o.device = c10::kCPU;
  o.shared_device = device;
  o.device_budget_bytes = 1 << 20;
  expect_error([&] { ModelOffloader("double_blocks", model.doubles.modules(), o); },
               "set them in DeviceOptions");
  o.device_budget_bytes = 0;
  o.blocks_to_swap = -1;
  expect_error([&] { ModelOffloader("double_blocks", model.doubles.modules(), o); },
               "needs a budget");
  expect_error([] { open_device(c10::Device(c10::kMeta), {}); }, "not one blockswap runs on");
}

} // namespace
} // namespace blockswap
