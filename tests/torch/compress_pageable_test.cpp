// Options::compress where the system caps page-locked memory (DeviceOptions::
// emulated_pinnable_bytes, as a low `ulimit -l` or WSL does): the blocks whose host copies are
// pageable are compressed too (Note [compressed host copies] in core/host_store.cpp), and every
// mode stays bitwise the run without blockswap: inference, LoRA training, and frozen weights
// assigned between passes. The emulated device only: CUDA's pinning is the system's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "blockswap/torch.hpp"
#include "test_model.hpp"

namespace blockswap {
namespace {

constexpr int64_t kBlocks = 6;
constexpr int kSteps = 3;

class CompressedPageable : public ::testing::Test {
protected:
  void SetUp() override {
    if (kDevice.is_cuda()) GTEST_SKIP() << "pinning is capped on the emulated device only";
  }
};

// Pinning capped at two blocks' worth (at least a slot's each): the staging ring's two buffers
// take it, and the blocks' host copies are pageable.
Options capped(int64_t k, bool training, const Model& model) {
  std::size_t block_bytes = 0;
  for (const auto& p : model.blocks[0]->parameters()) {
    block_bytes += (std::size_t(p.nbytes()) + 255) / 256 * 256;
  }
  Options o = options(k, training);
  o.compress = Compress::on;
  o.shared_device = Device::open("emulated", {.emulated_pinnable_bytes = 2 * block_bytes});
  return o;
}

// Every block compressed, the pageable ones included, and its loads staged and decoded.
void expect_pageable_compressed(const ModelOffloader& offloader) {
  EXPECT_GT(offloader.device()->host_memory().pageable_bytes, 0u);
  EXPECT_EQ(offloader.compression().blocks, kBlocks);
  EXPECT_GT(offloader.compression().compressed_bytes, 0u);
  EXPECT_GT(offloader.stats().staged_bytes, 0u);
  EXPECT_GT(offloader.stats().decoded_bytes, 0u);
}

// The model and its twin without blockswap in bf16, and bf16 inputs.
struct Bf16Run {
  Model reference{kBlocks}, model{kBlocks};
  torch::Tensor x, context;
  Bf16Run() {
    for (Model* m : {&reference, &model}) {
      for (auto& b : m->blocks) b->to(torch::kBFloat16);
    }
    const Inputs in;
    x = in.x.to(torch::kBFloat16);
    context = in.context.to(torch::kBFloat16);
  }
};

TEST_F(CompressedPageable, InferenceIsBitwiseTheRunWithoutBlockswap) {
  Bf16Run run;
  auto& [reference, model, x, context] = run;
  torch::NoGradGuard no_grad;
  const torch::Tensor expected = reference.forward(x, context);
  ModelOffloader offloader("blocks", model.modules(), capped(3, false, model));
  for (int pass = 0; pass < kSteps; ++pass) {
    offloader.prepare_block_devices_before_forward();
    expect_bitwise(forward_run_block(offloader, model, x, context), expected,
                   "pass " + std::to_string(pass));
  }
  expect_pageable_compressed(offloader);
}

TEST_F(CompressedPageable, LoraTrainingIsBitwiseTheRunWithoutBlockswap) {
  TrainingRun reference(kBlocks), swapped(kBlocks);
  reference.run(kSteps, [&](const torch::Tensor& x, const torch::Tensor& context) {
    return reference.model.forward(x, context);
  });
  ModelOffloader offloader("blocks", swapped.model.modules(), capped(2, true, swapped.model));
  swapped.run(kSteps, [&](const torch::Tensor& x, const torch::Tensor& context) {
    offloader.prepare_block_devices_before_forward();
    return forward_run_block(offloader, swapped.model, x, context);
  });
  expect_same_training(reference, swapped, "lora");
  expect_pageable_compressed(offloader);
}

// Note [changed compressed weights]: a frozen weight of a block off the device, assigned whole
// between passes, is encoded again, and the staging ring reads the block's new host copy.
TEST_F(CompressedPageable, FrozenWeightsAssignedBetweenPassesStayExact) {
  Bf16Run run;
  auto& [reference, model, x, context] = run;
  torch::NoGradGuard no_grad;
  ModelOffloader offloader("blocks", model.modules(), capped(3, false, model));
  offloader.prepare_block_devices_before_forward();
  expect_bitwise(forward_run_block(offloader, model, x, context), reference.forward(x, context),
                 "before");
  expect_pageable_compressed(offloader);
  for (int change = 0; change < 2; ++change) {
    int64_t off = 0;
    while (offloader.is_resident(off)) ++off;
    // Halved (exact in bf16): encoded again (or stored raw where it no longer fits the decode
    // buffers: exact either way), the block's host copy moved.
    const torch::Tensor assigned = reference.blocks[off]->fc1->weight.detach() * 0.5;
    reference.blocks[off]->fc1->weight.set_data(assigned.clone());
    model.blocks[off]->fc1->weight.set_data(assigned.clone());
    const torch::Tensor expected = reference.forward(x, context);
    for (int pass = 0; pass < 2; ++pass) {
      offloader.prepare_block_devices_before_forward();
      expect_bitwise(forward_run_block(offloader, model, x, context), expected,
                     "change " + std::to_string(change) + " pass " + std::to_string(pass));
    }
  }
}

} // namespace
} // namespace blockswap
