// ModelOffloader compared bitwise with the same model run without it: on the emulated device,
// and, compiled with BLOCKSWAP_TEST_CUDA (label gpu), on a GPU.
#include "blockswap/torch.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "blockswap/core/error.hpp"
#include "test_model.hpp"

namespace blockswap {
namespace {

TEST(ModelOffloader, InferenceEqualsUnswappedBitwise) {
  torch::NoGradGuard no_grad;
  const Inputs in;
  Model reference(8);
  const torch::Tensor expected = reference.forward(in.x, in.context);
  for (int64_t k : {1, 3, 7}) {
    for (bool manual : {false, true}) {
      Model model(8);
      ModelOffloader offloader("blocks", model.modules(), options(k, false));
      for (int pass = 0; pass < 3; ++pass) {
        offloader.prepare_block_devices_before_forward();
        const torch::Tensor out = manual ? forward_manual(offloader, model, in.x, in.context)
                                         : forward_run_block(offloader, model, in.x, in.context);
        expect_bitwise(out, expected, "K=" + std::to_string(k) + " pass " + std::to_string(pass));
      }
    }
  }
}

TEST(ModelOffloader, LoraTrainingEqualsUnswappedBitwise) {
  TrainingRun reference(8);
  reference.run(
      3, [&](torch::Tensor x, const torch::Tensor& c) { return reference.model.forward(x, c); });
  for (int64_t k : {1, 3, 6}) {
    TrainingRun swapped(8);
    ModelOffloader offloader("blocks", swapped.model.modules(), options(k, true));
    swapped.run(3, [&](torch::Tensor x, const torch::Tensor& c) {
      offloader.prepare_block_devices_before_forward();
      return forward_run_block(offloader, swapped.model, x, c);
    });
    expect_same_training(reference, swapped, "K=" + std::to_string(k));
    // After a whole step, the blocks are where the seed puts them before a forward.
    for (int64_t b = 0; b < 8; ++b) EXPECT_EQ(offloader.is_resident(b), b < 8 - k) << b;
  }
}

TEST(ModelOffloader, LoraTrainingOfTheFirstBlockOnlyHasNoInputGradient) {
  // No input requires grad: the first block's backward must still run (its adapter trains).
  const Inputs in;
  Model reference(4), model(4);
  ModelOffloader offloader("blocks", model.modules(), options(2, true));
  reference.forward(in.x, in.context).pow(2).mean().backward();
  offloader.prepare_block_devices_before_forward();
  forward_run_block(offloader, model, in.x, in.context).pow(2).mean().backward();
  for (std::size_t p = 0; p < model.lora().size(); ++p) {
    expect_bitwise(model.lora()[p].grad(), reference.lora()[p].grad(), "lora " + std::to_string(p));
  }
}

TEST(ModelOffloader, ReentrantCheckpointingGivesEqualGradients) {
  TrainingRun reference(8);
  reference.run(
      2, [&](torch::Tensor x, const torch::Tensor& c) { return reference.model.forward(x, c); });
  TrainingRun swapped(8);
  Options o = options(3, true);
  o.reentrant_activation_checkpointing = true;
  ModelOffloader offloader("blocks", swapped.model.modules(), o);
  swapped.run(2, [&](torch::Tensor x, const torch::Tensor& c) {
    offloader.prepare_block_devices_before_forward();
    for (int64_t i = 0; i < 8; ++i) {
      x = Checkpoint::apply(x, c, &offloader, i, &swapped.model)[0];
    }
    return x;
  });
  expect_same_training(reference, swapped, "reentrant K=3");
}

// The seed's rules (DESIGN.md section 1), independently: which blocks are on the device.
std::vector<bool> seed_after_forward(std::vector<bool> on, int64_t n, int64_t k, int64_t i,
                                     bool forward_only) {
  if (k == 0 || (!forward_only && i >= k)) return on;
  on[i] = false;
  on[(n - k + i) % n] = true;
  return on;
}

TEST(ModelOffloader, ResidencyFollowsTheSeedAfterEveryVerb) {
  torch::NoGradGuard no_grad;
  const Inputs in;
  const int64_t n = 8, k = 3;
  for (bool forward_only : {true, false}) {
    Model model(n);
    Options o = options(k, !forward_only);
    o.rotating_slots = n - k; // the seed's cyclic scheme for forward-only
    ModelOffloader offloader("blocks", model.modules(), o);
    for (int64_t b = 0; b < n; ++b) EXPECT_FALSE(offloader.is_resident(b));
    std::vector<bool> seed(n);
    for (int64_t b = 0; b < n; ++b) seed[b] = b < n - k;
    for (int pass = 0; pass < 2; ++pass) {
      if (!forward_only) {
        for (int64_t b = 0; b < n; ++b) seed[b] = b < n - k;
      }
      offloader.prepare_block_devices_before_forward();
      for (int64_t b = 0; b < n; ++b) ASSERT_EQ(offloader.is_resident(b), bool(seed[b])) << b;
      torch::Tensor x = in.x;
      for (int64_t i = 0; i < n; ++i) {
        offloader.wait_for_block(i);
        x = model.blocks[i]->forward(x, in.context);
        offloader.submit_move_blocks_forward(i);
        seed = seed_after_forward(seed, n, k, i, forward_only);
        for (int64_t b = 0; b < n; ++b) {
          ASSERT_EQ(offloader.is_resident(b), bool(seed[b])) << "after block " << i << ": " << b;
        }
      }
    }
  }
}

TEST(ModelOffloader, TrainingStepStats) {
  const Inputs in;
  Model model(8);
  ModelOffloader offloader("blocks", model.modules(), options(3, true));
  offloader.prepare_block_devices_before_forward();
  offloader.reset_stats();
  forward_run_block(offloader, model, in.x, in.context).pow(2).mean().backward();
  const Stats stats = offloader.stats();
  // One block's packed bytes: every frozen parameter at a 256-byte aligned offset (buffers stay
  // on the device).
  std::size_t block_bytes = 0;
  TestBlock fresh;
  for (const auto& t : fresh->parameters()) {
    if (!t.requires_grad()) block_bytes = (block_bytes + 255) / 256 * 256 + t.nbytes();
  }
  EXPECT_EQ(stats.h2d_bytes, 6 * block_bytes);
  EXPECT_EQ(stats.d2h_bytes, 0u);
  EXPECT_EQ(stats.moves, 6u);
  EXPECT_LE(stats.peak_device_bytes, 5 * ((block_bytes + 255) / 256 * 256));
  EXPECT_GE(stats.peak_device_bytes, 5 * block_bytes);
}

TEST(ModelOffloader, PlannerChoosesKFromTheBudget) {
  Model model(8);
  Options o = options(-1, true);
  {
    ModelOffloader probe("blocks", model.modules(), options(0, true));
    o.device_budget_bytes = probe.stats().device_bytes / 8 * 5; // room for 5 slots
  }
  {
    ModelOffloader offloader("blocks", model.modules(), o);
    EXPECT_EQ(offloader.blocks_to_swap(), 3);
    expect_error([&] { ModelOffloader("blocks", model.modules(), o); },
                 "already managed by another ModelOffloader");
  }
  o.device_budget_bytes = 1000;
  expect_error([&] { ModelOffloader("blocks", model.modules(), o); },
               "the smallest budget that works is");
}

TEST(ModelOffloader, MisuseRaisesClearErrors) {
  torch::NoGradGuard no_grad;
  const Inputs in;
  Model model(8);
  expect_error([&] { ModelOffloader("blocks", model.modules(), options(8, true)); },
               "K=8 is out of range for N=8 blocks in training mode");
  expect_error([&] { ModelOffloader("blocks", model.modules(), options(8, false)); },
               "K=8 is out of range");
  expect_error(
      [&] {
        ModelOffloader("blocks", std::vector<std::shared_ptr<torch::nn::Module>>{},
                       options(0, false));
      },
      "at least one block");
  expect_error(
      [&] {
        ModelOffloader("blocks", BlockList{model.blocks[0].ptr(), model.blocks[0].ptr()},
                       options(0, false));
      },
      "block 1 is the same module as block 0");
  {
    Model shared(2); // two modules holding one tensor
    shared.blocks[1]->fc2->register_parameter("tied", shared.blocks[0]->fc2->weight, false);
    expect_error([&] { ModelOffloader("blocks", shared.modules(), options(0, false)); },
                 "tensor 'fc2.tied' of block 1 is shared with block 0");
  }
  Options o = options(3, false);
  o.rotating_slots = 5;
  ModelOffloader offloader("blocks", model.modules(), o);
  offloader.prepare_block_devices_before_forward();
  expect_error(
      [&] {
        offloader.run_block(8, {in.x, in.context}, model.fn(0));
      },
      "block index 8 is out of range");
  expect_error(
      [&] {
        offloader.run_block(5, {in.x, in.context}, model.fn(5));
      },
      "block 5 is not on the device");
  expect_error([&] { offloader.set_forward_only(false); }, "supports_backward");
}

// Off the device, a block's tensors read as their true values (a checkpoint saved while
// swapping is complete); with strict_residency they have no elements, so computing with one
// fails instead of reading the host copy.
TEST(ModelOffloader, NonResidentTensorsReadTheirTrueValues) {
  torch::NoGradGuard no_grad;
  const Inputs in;
  Model reference(8);
  for (bool strict : {false, true}) {
    Model model(8);
    Options o = options(3, false);
    o.strict_residency = strict;
    ModelOffloader offloader("blocks", model.modules(), o);
    offloader.prepare_block_devices_before_forward();
    int64_t away = 0;
    while (offloader.is_resident(away)) ++away;
    if (strict) {
      EXPECT_ANY_THROW(model.blocks[away]->forward(in.x, in.context));
      continue;
    }
    for (int64_t b = 0; b < 8; ++b) {
      const auto expected = reference.blocks[b]->named_parameters();
      for (const auto& item : model.blocks[b]->named_parameters()) {
        expect_bitwise(item.value(), expected[item.key()],
                       "block " + std::to_string(b) + " " + item.key());
      }
      expect_bitwise(model.blocks[b]->scale, reference.blocks[b]->scale, "scale");
    }
    // On the emulated device a block off the device still computes (its host tensors are on
    // the same torch device); on a GPU they are host tensors, and computing raises.
    if (!kDevice.is_cuda()) {
      expect_bitwise(model.blocks[away]->forward(in.x, in.context),
                     reference.blocks[away]->forward(in.x, in.context), "a block off the device");
    }
    // torch::save of a block while it is off the device writes its weights.
    std::stringstream saved;
    torch::save(model.blocks[away], saved);
    TestBlock loaded;
    torch::load(loaded, saved);
    expect_bitwise(loaded->fc1->weight, reference.blocks[away]->fc1->weight, "saved fc1.weight");
  }
}

TEST(ModelOffloader, ExceptionInABlockLeavesItUsable) {
  torch::NoGradGuard no_grad;
  const Inputs in;
  Model reference(8);
  const torch::Tensor expected = reference.forward(in.x, in.context);
  Model model(8);
  ModelOffloader offloader("blocks", model.modules(), options(3, false));
  offloader.prepare_block_devices_before_forward();
  torch::Tensor x = in.x;
  for (int64_t i = 0; i < 4; ++i) x = offloader.run_block(i, {x, in.context}, model.fn(i))[0];
  expect_error(
      [&] {
        offloader.run_block(4, {x, in.context}, [](const variable_list&) -> variable_list {
          throw std::runtime_error("boom");
        });
      },
      "boom");
  for (int pass = 0; pass < 2; ++pass) {
    offloader.prepare_block_devices_before_forward();
    expect_bitwise(forward_run_block(offloader, model, in.x, in.context), expected, "after error");
  }
}

TEST(ModelOffloader, DestructorLeavesOrdinaryHostTensorsWithTheOriginalValues) {
  Model reference(8);
  Model model(8);
  {
    ModelOffloader offloader("blocks", model.modules(), options(3, true));
    offloader.prepare_block_devices_before_forward();
    const Inputs in;
    forward_run_block(offloader, model, in.x, in.context).pow(2).mean().backward();
    offloader.prepare_block_devices_before_forward();
    offloader.run_block(0, {in.x, in.context}, model.fn(0)); // a move in flight at the end
  }
  for (std::size_t b = 0; b < 8; ++b) {
    const auto got = model.blocks[b]->named_parameters();
    const auto want = reference.blocks[b]->named_parameters();
    for (const auto& item : want) {
      if (item.value().requires_grad()) continue;
      const torch::Tensor& t = got[item.key()];
      EXPECT_TRUE(t.device().is_cpu());
      expect_bitwise(t, item.value(), "block " + std::to_string(b) + " " + item.key());
    }
    expect_bitwise(model.blocks[b]->scale, reference.blocks[b]->scale, "buffer");
  }
  if (!kDevice.is_cpu()) return; // on a GPU the adapters stay on the device
  const Inputs in;
  torch::NoGradGuard no_grad;
  expect_bitwise(model.blocks[3]->forward(in.x, in.context),
                 reference.blocks[3]->forward(in.x, in.context), "restored block computes");
}

TEST(ModelOffloader, DisableSwapRunsEverythingResident) {
  torch::NoGradGuard no_grad;
  const Inputs in;
  Model reference(6);
  Model model(6);
  ModelOffloader offloader("blocks", model.modules(), options(4, true));
  offloader.disable_block_swap();
  offloader.prepare_block_devices_before_forward();
  for (int64_t b = 0; b < 6; ++b) EXPECT_TRUE(offloader.is_resident(b));
  offloader.reset_stats();
  expect_bitwise(forward_run_block(offloader, model, in.x, in.context),
                 reference.forward(in.x, in.context), "disabled");
  EXPECT_EQ(offloader.stats().moves, 0u);
  offloader.enable_block_swap();
  offloader.prepare_block_devices_before_forward();
  EXPECT_EQ(offloader.is_resident(5), false);
  expect_bitwise(forward_run_block(offloader, model, in.x, in.context),
                 reference.forward(in.x, in.context), "enabled again");
}

} // namespace
} // namespace blockswap

namespace blockswap {
namespace {

// Blocks may differ in dtype and hold tensors of several dtypes: each block is packed at
// aligned offsets and a slot fits the largest.
TEST(ModelOffloader, BlocksWithDifferentDtypes) {
  torch::NoGradGuard no_grad;
  auto make = [] {
    torch::manual_seed(5);
    std::vector<torch::nn::Linear> layers{torch::nn::Linear(6, 6), torch::nn::Linear(6, 6),
                                          torch::nn::Linear(6, 6)};
    layers[1]->to(torch::kFloat64);
    layers[2]->register_buffer("counter", torch::arange(5, torch::kLong));
    for (auto& l : layers) l->to(kDevice);
    return layers;
  };
  auto run = [](std::vector<torch::nn::Linear>& layers, ModelOffloader* offloader) {
    torch::Tensor x = torch::ones({2, 6}).to(kDevice);
    for (int64_t i = 0; i < 3; ++i) {
      auto fn = [layer = layers[i]](const variable_list& in) mutable {
        const auto dtype = layer->weight.scalar_type();
        return variable_list{layer->forward(in[0].to(dtype)).to(torch::kFloat32)};
      };
      x = offloader ? offloader->run_block(i, {x}, fn)[0] : fn({x})[0];
    }
    return x;
  };
  auto reference = make();
  auto layers = make();
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (auto& l : layers) modules.push_back(l.ptr());
  ModelOffloader offloader("layers", modules, options(1, false));
  for (int pass = 0; pass < 3; ++pass) {
    offloader.prepare_block_devices_before_forward();
    expect_bitwise(run(layers, &offloader), run(reference, nullptr), "mixed dtypes");
  }
}

TEST(ModelOffloader, PlannerWithoutABudgetIsAnError) {
  Model model(4);
  Options o = options(-1, false);
  try {
    ModelOffloader offloader("blocks", model.modules(), o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a budget: device_budget_bytes"), std::string::npos)
        << e.what();
  }
}

} // namespace
} // namespace blockswap
