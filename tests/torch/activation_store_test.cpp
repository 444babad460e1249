// Options::offload_activations and ActivationScope as a C++ trainer uses them: what each block
// saves for backward goes to host memory and comes back for its backward; losses, gradients and
// trained weights bitwise those of the run without offloading, alone (K = 0) and with swapping.
// Compiled with BLOCKSWAP_TEST_CUDA (label gpu) the same runs on a GPU, with pinned memory and
// the two side streams.
#include "blockswap/torch.hpp"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>

#include "activation_store.hpp"
#include "blockswap/core/error.hpp"
#include "test_model.hpp"

namespace blockswap {
namespace {

// The test model's hidden state is 2 x 5 x 32 floats: threshold 0 offloads every saved storage.
Options offloading(int64_t k, std::size_t threshold = 0) {
  Options o = options(k, true);
  o.offload_activations = true;
  o.activation_threshold_bytes = threshold;
  return o;
}

TrainingRun reference_run(int64_t n, int steps = 3) {
  TrainingRun reference(n);
  reference.run(steps, [&](torch::Tensor x, const torch::Tensor& c) {
    return reference.model.forward(x, c);
  });
  return reference;
}

TEST(ActivationOffload, LoraTrainingIsBitwiseTheRunWithoutOffloading) {
  const TrainingRun reference = reference_run(6);
  for (int64_t k : {0, 2, 4}) {
    TrainingRun swapped(6);
    ModelOffloader offloader("blocks", swapped.model.modules(), offloading(k));
    offloader.reset_stats();
    swapped.run(3, [&](torch::Tensor x, const torch::Tensor& c) {
      offloader.prepare_block_devices_before_forward();
      return forward_run_block(offloader, swapped.model, x, c);
    });
    expect_same_training(reference, swapped, "K=" + std::to_string(k));
    const ActivationStats stats = offloader.activation_stats();
    EXPECT_GT(stats.offloaded_bytes, 0u) << k;
    EXPECT_EQ(stats.restored_bytes, stats.offloaded_bytes) << k;
    EXPECT_EQ(stats.device_bytes, 0u) << k; // every graph freed
  }
}

// Activations whose copies take longer than the kernels around them (1 MiB hidden states), and
// on a GPU the blocks computed on a stream of torch's pool, not the default one (the offloader's
// compute stream is torch's current stream): a copy not ordered by its events shows.
TEST(ActivationOffload, LargeActivationsOnTheCurrentStreamAreBitwise) {
  std::optional<c10::StreamGuard> side_stream;
  if (kDevice.is_cuda()) {
    const c10::impl::VirtualGuardImpl guard(kDevice.type());
    side_stream.emplace(guard.getStreamFromGlobalPool(kDevice));
  }
  const Inputs in(16, 512);
  TrainingRun reference(6);
  reference.run(
      2, [&](torch::Tensor x, const torch::Tensor& c) { return reference.model.forward(x, c); },
      in);
  for (int64_t k : {0, 3}) {
    TrainingRun swapped(6);
    ModelOffloader offloader("blocks", swapped.model.modules(), offloading(k));
    offloader.reset_stats();
    swapped.run(
        2,
        [&](torch::Tensor x, const torch::Tensor& c) {
          offloader.prepare_block_devices_before_forward();
          return forward_run_block(offloader, swapped.model, x, c);
        },
        in);
    expect_same_training(reference, swapped, "K=" + std::to_string(k));
    const ActivationStats stats = offloader.activation_stats();
    EXPECT_GT(stats.offloaded_bytes, std::size_t{6} << 20) << k;
    EXPECT_EQ(stats.restored_bytes, stats.offloaded_bytes) << k;
  }
}

TEST(ActivationOffload, TheDeviceHoldsAboutTwoBlocksOfActivationsWhateverN) {
  for (int64_t n : {8, 16}) {
    const auto peak = [n](bool offload) {
      TrainingRun run(n);
      // Without offloading, the same hooks count: a threshold no storage passes.
      ModelOffloader offloader("blocks", run.model.modules(),
                               offloading(0, offload ? 0 : SIZE_MAX));
      offloader.reset_stats();
      run.run(1, [&](torch::Tensor x, const torch::Tensor& c) {
        offloader.prepare_block_devices_before_forward();
        return forward_run_block(offloader, run.model, x, c);
      });
      return offloader.activation_stats().peak_device_bytes;
    };
    const double kept = double(peak(false)), offloaded = double(peak(true));
    const double per_block = kept / double(n);
    EXPECT_GT(kept, 0) << n;
    EXPECT_LE(offloaded, 2.5 * per_block) << n << ": " << kept << " kept, " << offloaded;
  }
}

// The store's copies run on torch's streams; the offloader's Device counts them (TransferStats):
// the host memory they hold while the graph lives, and every copy each way.
TEST(ActivationOffload, TheOffloadersDeviceCountsTheCopies) {
  const Inputs in;
  Model model(4);
  ModelOffloader offloader("blocks", model.modules(), offloading(2));
  offloader.reset_stats();
  const std::shared_ptr<Device> device = offloader.device();
  ASSERT_NE(device, nullptr);
  offloader.prepare_block_devices_before_forward();
  const torch::Tensor loss = forward_run_block(offloader, model, in.x, in.context).pow(2).mean();
  const ActivationStats out = offloader.activation_stats();
  ASSERT_GT(out.offloaded_bytes, 0u);
  EXPECT_EQ(device->transfers().bytes_d2h, out.offloaded_bytes);
  EXPECT_EQ(device->transfers().host_bytes, out.offloaded_bytes); // held while the graph lives
  loss.backward();
  const ActivationStats back = offloader.activation_stats();
  const TransferStats t = device->transfers();
  EXPECT_EQ(t.bytes_h2d, back.restored_bytes);
  EXPECT_EQ(t.peak_host_bytes, out.offloaded_bytes);
  EXPECT_EQ(t.host_bytes, 0u);                                              // the graph was freed
  EXPECT_EQ(device->memory().device_bytes, offloader.stats().device_bytes); // the slots alone
}

TEST(ActivationOffload, AccumulationAndTwoForwardsBeforeOneBackward) {
  const Inputs in;
  const auto run = [&](Model& model, ModelOffloader* offloader) {
    const auto forward = [&](const torch::Tensor& x) {
      if (offloader == nullptr) return model.forward(x, in.context);
      offloader->prepare_block_devices_before_forward();
      return forward_run_block(*offloader, model, x, in.context);
    };
    for (int micro = 0; micro < 2; ++micro) forward(in.x * (micro + 1)).pow(2).mean().backward();
    const torch::Tensor a = forward(in.x * 3).pow(2).mean();
    const torch::Tensor b = forward(in.x * 4).pow(2).mean();
    (a + b).backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : model.lora()) grads.push_back(p.grad().clone());
    return grads;
  };
  Model reference(5);
  const auto expected = run(reference, nullptr);
  for (int64_t k : {0, 2}) {
    Model model(5);
    ModelOffloader offloader("blocks", model.modules(), offloading(k));
    const auto got = run(model, &offloader);
    for (std::size_t p = 0; p < got.size(); ++p) {
      expect_bitwise(got[p], expected[p], "K=" + std::to_string(k) + " lora " + std::to_string(p));
    }
  }
}

TEST(ActivationOffload, AGraphKeptForASecondBackwardUnpacksAgain) {
  const Inputs in;
  Model reference(4), model(4);
  ModelOffloader offloader("blocks", model.modules(), offloading(0));
  const torch::Tensor expected = reference.forward(in.x, in.context).pow(2).mean();
  expected.backward({}, /*retain_graph=*/true);
  expected.backward();
  offloader.prepare_block_devices_before_forward();
  const torch::Tensor loss = forward_run_block(offloader, model, in.x, in.context).pow(2).mean();
  loss.backward({}, /*retain_graph=*/true);
  loss.backward();
  for (std::size_t p = 0; p < model.lora().size(); ++p) {
    expect_bitwise(model.lora()[p].grad(), reference.lora()[p].grad(), "lora " + std::to_string(p));
  }
}

TEST(ActivationOffload, ACheckpointAroundTheBlockOffloadsItsInputsInAScope) {
  const TrainingRun reference = reference_run(5);
  TrainingRun swapped(5);
  Options o = offloading(2);
  o.reentrant_activation_checkpointing = true;
  ModelOffloader offloader("blocks", swapped.model.modules(), o);
  offloader.reset_stats();
  swapped.run(3, [&](torch::Tensor x, const torch::Tensor& c) {
    offloader.prepare_block_devices_before_forward();
    for (int64_t i = 0; i < 5; ++i) {
      const ActivationScope scope(kDevice, "checkpoint " + std::to_string(i), {}, 0);
      x = Checkpoint::apply(x, c, &offloader, i, &swapped.model)[0];
    }
    return x;
  });
  expect_same_training(reference, swapped, "checkpointed");
  // Each checkpoint saves x and the context; the recompute, inside backward, keeps its own.
  EXPECT_GT(offloader.activation_stats().offloaded_bytes, 0u);
}

// A scope opened before the block's wait (here around run_block of an offloader without
// offload_activations): the weights it skips are where the wait binds them, so at K = N-2, whose
// slots are reloaded at once, no saved weight is copied as an activation (outside tester).
TEST(ActivationOffload, AScopeOpenedBeforeTheWaitSkipsTheWeightsWhereTheyRun) {
  for (int64_t n : {5, 6}) {
    const TrainingRun reference = reference_run(n);
    TrainingRun swapped(n);
    ModelOffloader offloader("blocks", swapped.model.modules(), options(n - 2, true));
    swapped.run(3, [&](torch::Tensor x, const torch::Tensor& c) {
      offloader.prepare_block_devices_before_forward();
      for (int64_t i = 0; i < n; ++i) {
        const ActivationScope scope(kDevice, "scope " + std::to_string(i),
                                    swapped.model.blocks[i]->parameters(), 0);
        x = offloader.run_block(i, {x, c}, swapped.model.fn(i))[0];
      }
      return x;
    });
    expect_same_training(reference, swapped, "N=" + std::to_string(n));
  }
}

TEST(ActivationOffload, FullFineTuningIsBitwiseTheRunWithoutOffloading) {
  const Inputs in;
  const auto train = [&](bool offload) {
    Model model(5);
    for (auto& b : model.blocks) {
      for (auto& p : b->parameters()) p.set_requires_grad(true);
    }
    Options o = offload ? offloading(2) : options(2, true);
    o.optimizer = FusedAdamW{1e-2};
    ModelOffloader offloader("blocks", model.modules(), o);
    for (int step = 0; step < 3; ++step) {
      offloader.prepare_block_devices_before_forward();
      forward_run_block(offloader, model, in.x, in.context).pow(2).mean().backward();
    }
    offloader.synchronize();
    std::vector<torch::Tensor> weights;
    for (auto& b : model.blocks) {
      for (auto& p : b->parameters()) weights.push_back(p.detach().clone());
    }
    return weights;
  };
  const auto expected = train(false), got = train(true);
  ASSERT_EQ(expected.size(), got.size());
  for (std::size_t p = 0; p < got.size(); ++p) {
    expect_bitwise(got[p], expected[p], "weight " + std::to_string(p));
  }
}

TEST(ActivationOffload, TwoBlockListsOnOneDeviceHandOver) {
  const Inputs in;
  Model reference_a(3), reference_b(4), a(3), b(4);
  const auto shared = open_device(kDevice);
  Options o = offloading(1);
  o.shared_device = shared;
  o.device = c10::kCPU;
  ModelOffloader first("double", a.modules(), o), second("single", b.modules(), o);
  for (int step = 0; step < 2; ++step) {
    reference_b.forward(reference_a.forward(in.x, in.context), in.context).pow(2).mean().backward();
    first.prepare_block_devices_before_forward();
    second.prepare_block_devices_before_forward();
    const torch::Tensor h = forward_run_block(first, a, in.x, in.context);
    forward_run_block(second, b, h, in.context).pow(2).mean().backward();
  }
  for (std::size_t p = 0; p < a.lora().size(); ++p) {
    expect_bitwise(a.lora()[p].grad(), reference_a.lora()[p].grad(), "double " + std::to_string(p));
  }
  for (std::size_t p = 0; p < b.lora().size(); ++p) {
    expect_bitwise(b.lora()[p].grad(), reference_b.lora()[p].grad(), "single " + std::to_string(p));
  }
  EXPECT_EQ(first.activation_stats().restored_bytes, first.activation_stats().offloaded_bytes);
}

TEST(ActivationOffload, AFailedCopyToHostIsAClearErrorAndLosesNothing) {
  TrainingRun reference(4);
  Model model(4);
  ModelOffloader offloader("blocks", model.modules(), offloading(2));
  torch_frontend::set_activation_host_allocator([](std::size_t, bool) -> at::Tensor {
    throw std::runtime_error("cudaHostAlloc: out of memory");
  });
  const Inputs in;
  offloader.prepare_block_devices_before_forward();
  expect_error([&] { forward_run_block(offloader, model, in.x, in.context); },
               "saved activations to host memory failed");
  torch_frontend::set_activation_host_allocator(nullptr);
  // The weights are intact and the next steps are exact.
  for (std::size_t b = 0; b < 4; ++b) {
    const auto got = model.blocks[b]->named_parameters(),
               want = reference.model.blocks[b]->named_parameters();
    for (const auto& item : want) expect_bitwise(got[item.key()], item.value(), item.key());
  }
  reference.run(
      2, [&](torch::Tensor x, const torch::Tensor& c) { return reference.model.forward(x, c); });
  TrainingRun swapped(4);
  swapped.model = model;
  swapped.run(2, [&](torch::Tensor x, const torch::Tensor& c) {
    offloader.prepare_block_devices_before_forward();
    return forward_run_block(offloader, model, x, c);
  });
  expect_same_training(reference, swapped, "after the failure");
}

TEST(ActivationOffload, AnActivationWrittenInPlaceAfterItWasSavedRaises) {
  const Inputs in;
  Model model(3);
  ModelOffloader offloader("blocks", model.modules(), offloading(0));
  torch::Tensor saved;
  offloader.prepare_block_devices_before_forward();
  torch::Tensor x = in.x.clone().requires_grad_(true);
  for (int64_t i = 0; i < 3; ++i) {
    x = offloader.run_block(i, {x, in.context}, [&, i](const variable_list& v) {
      saved = torch::sigmoid(v[0] * 2); // sigmoid saves its output
      return model.fn(i)({saved, v[1]});
    })[0];
  }
  {
    torch::NoGradGuard no_grad;
    saved.add_(1); // the last block's: still on the device
  }
  expect_error([&] { x.sum().backward(); }, "modified by an inplace operation");
}

#ifndef BLOCKSWAP_TEST_CUDA
TEST(ActivationOffload, ADeviceThisLibTorchLacksIsABlockswapError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  // Outside tester: LibTorch's own c10::Error escaped the scope's constructor.
  EXPECT_THROW(ActivationScope(c10::Device(c10::kCUDA, 0), "blocks.0", {}, 0), Error);
}
#endif

TEST(ActivationOffload, InferenceSavesNothing) {
  const Inputs in;
  Model model(4);
  ModelOffloader offloader("blocks", model.modules(), offloading(2));
  offloader.reset_stats();
  torch::NoGradGuard no_grad;
  offloader.prepare_block_devices_before_forward();
  forward_run_block(offloader, model, in.x, in.context);
  EXPECT_EQ(offloader.activation_stats().offloaded_bytes, 0u);
  EXPECT_EQ(offloader.activation_stats().peak_device_bytes, 0u);
}

} // namespace
} // namespace blockswap
