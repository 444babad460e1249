// Full fine-tuning (Options::optimizer), tried as a trainer would from the public header and
// docs/guide.md: weights trained with swapped blocks and the fused step are bitwise those of the
// same model trained without blockswap by LibTorch's own optimizers; the bytes moved per step
// are the loads plus the write-backs of changed blocks; a failed write-back loses no weight.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/device/emulated.hpp"
#include "blockswap/torch.hpp"
#include "test_model.hpp"

namespace blockswap {
namespace {

constexpr int64_t kBlocks = 6;
constexpr int kSteps = 5;

// The test model with its base weights training too: fc1, fc2 and the adapter train;
// the norm and context_proj stay frozen (one block mixes both kinds).
// torch::equal on the host: on a GPU a block's tensors are device or host tensors by where the
// block is, and the reference's are device tensors.
bool equal_on_host(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::equal(a.cpu(), b.cpu());
}

Model fine_tune_model() {
  Model model(kBlocks);
  for (auto& block : model.blocks) {
    for (auto& p : block->fc1->parameters()) p.set_requires_grad(true);
    for (auto& p : block->fc2->parameters()) p.set_requires_grad(true);
  }
  return model;
}

std::vector<torch::Tensor> trainable(const Model& model) {
  std::vector<torch::Tensor> out;
  for (const auto& block : model.blocks) {
    for (const auto& p : block->parameters()) {
      if (p.requires_grad()) out.push_back(p);
    }
  }
  return out;
}

std::vector<torch::Tensor> all_parameters(const Model& model) {
  std::vector<torch::Tensor> out;
  for (const auto& block : model.blocks) {
    for (const auto& p : block->parameters()) out.push_back(p.detach().clone());
  }
  return out;
}

// The micro-batches of every step.
std::vector<Inputs> micro_batches(int count) {
  std::vector<Inputs> out;
  for (int i = 0; i < count; ++i) {
    Inputs in;
    torch::manual_seed(100 + i);
    in.x = torch::randn({2, 5, kDim}).to(kDevice);
    out.push_back(in);
  }
  return out;
}

torch::Tensor loss_of(const torch::Tensor& y) {
  return y.pow(2).mean();
}

enum class Verbs { run_block, by_hand };

// Bytes: a block is its frozen weights, then its trainable parameters and their state.
std::size_t aligned(const torch::Tensor& t) {
  return layout::align_up(static_cast<std::size_t>(t.numel() * t.element_size()));
}

struct Trained {
  std::vector<torch::Tensor> losses;
  std::vector<torch::Tensor> parameters; // every parameter after the last step
};

// The reference: no blockswap, LibTorch's optimizer, .grad summed over `accumulation` backwards.
template <typename Optimizer, typename OptimizerOptions>
Trained train_reference(const OptimizerOptions& optimizer_options, int accumulation) {
  Model model = fine_tune_model();
  Optimizer optimizer(trainable(model), optimizer_options);
  const auto batches = micro_batches(kSteps * accumulation);
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    for (int m = 0; m < accumulation; ++m) {
      const Inputs& in = batches[step * accumulation + m];
      const torch::Tensor loss = loss_of(model.forward(in.x, in.context));
      loss.backward();
      out.losses.push_back(loss.detach());
    }
    optimizer.step();
    for (auto& p : trainable(model)) p.mutable_grad().reset();
  }
  out.parameters = all_parameters(model);
  return out;
}

torch::Tensor forward(ModelOffloader& offloader, Model& model, const Inputs& in, Verbs verbs) {
  offloader.prepare_block_devices_before_forward();
  torch::Tensor x = in.x;
  for (int64_t i = 0; i < kBlocks; ++i) {
    if (verbs == Verbs::run_block) {
      x = offloader.run_block(i, {x, in.context}, model.fn(i))[0];
    } else { // the seed's verbs, with the outputs passed through (training by hand)
      offloader.wait_for_block(i);
      x = model.blocks[i]->forward(x, in.context);
      x = offloader.submit_move_blocks_forward(i, {x})[0];
    }
  }
  return x;
}

// The step on the device unless a test says otherwise (automatic is the host's on the CPU).
Options fine_tune_options(int64_t k, FusedOptimizer optimizer, int accumulation,
                          StepOn step_on = StepOn::device) {
  Options o = options(k, true);
  o.optimizer = std::move(optimizer);
  o.gradient_accumulation_steps = accumulation;
  o.step_on = step_on;
  return o;
}

Trained train_swapped(int64_t k, const FusedOptimizer& optimizer, int accumulation, Verbs verbs,
                      Stats* stats = nullptr, StepOn step_on = StepOn::device) {
  Model model = fine_tune_model();
  const auto batches = micro_batches(kSteps * accumulation);
  Trained out;
  {
    ModelOffloader offloader("blocks", model.modules(),
                             fine_tune_options(k, optimizer, accumulation, step_on));
    for (int step = 0; step < kSteps; ++step) {
      if (step == 1) offloader.reset_stats(); // step 0 is the warm-up: prepare loads
      for (int m = 0; m < accumulation; ++m) {
        const Inputs& in = batches[step * accumulation + m];
        const torch::Tensor loss = loss_of(forward(offloader, model, in, verbs));
        loss.backward();
        out.losses.push_back(loss.detach());
      }
    }
    if (stats) *stats = offloader.stats();
    // Read while the offloader lives: every tensor reads its true values, on the device or not.
    out.parameters = all_parameters(model);
  }
  // And after it is gone, from the host tensors it leaves.
  const auto after = all_parameters(model);
  for (std::size_t i = 0; i < after.size(); ++i) {
    EXPECT_TRUE(equal_on_host(after[i].cpu(), out.parameters[i].cpu()))
        << "parameter " << i << " after destruction";
  }
  return out;
}

void expect_same(const Trained& expected, const Trained& got, const std::string& what) {
  ASSERT_EQ(expected.losses.size(), got.losses.size()) << what;
  for (std::size_t i = 0; i < expected.losses.size(); ++i) {
    expect_bitwise(expected.losses[i], got.losses[i], what + " loss " + std::to_string(i));
  }
  ASSERT_EQ(expected.parameters.size(), got.parameters.size()) << what;
  for (std::size_t i = 0; i < expected.parameters.size(); ++i) {
    expect_bitwise(expected.parameters[i], got.parameters[i],
                   what + " parameter " + std::to_string(i));
  }
}

std::string name(int64_t k, int accumulation, Verbs verbs) {
  return "K=" + std::to_string(k) + " accumulation " + std::to_string(accumulation) +
         (verbs == Verbs::run_block ? " run_block" : " by hand");
}

// With and without accumulation, every K, both ways of calling: bitwise LibTorch's `Optimizer`.
template <typename Optimizer, typename OptimizerOptions>
void expect_bitwise_for_every_k(const OptimizerOptions& options, const FusedOptimizer& fused,
                                const std::string& what) {
  for (int accumulation : {1, 2}) {
    const Trained expected = train_reference<Optimizer>(options, accumulation);
    for (int64_t k = 0; k <= kBlocks - 2; ++k) {
      for (Verbs verbs : {Verbs::run_block, Verbs::by_hand}) {
        expect_same(expected, train_swapped(k, fused, accumulation, verbs),
                    what + name(k, accumulation, verbs));
      }
    }
  }
}

TEST(FineTune, SgdWithMomentumIsBitwiseLibTorchsSgdForEveryK) {
  FusedSGD sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  sgd.dampening = 0.1;
  sgd.weight_decay = 0.01;
  const auto options =
      torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(0.01);
  expect_bitwise_for_every_k<torch::optim::SGD>(options, sgd, "SGD ");
}

// Note [host step]: the gradients go to host memory, the CPU steps the host copy; the same
// bits as LibTorch's optimizers on the CPU.
TEST(FineTune, TheStepOnTheHostIsBitwiseLibTorchsForEveryK) {
  // On a GPU the host step is the CPU's arithmetic, bitwise LibTorch's on the CPU (this test on
  // the emulated device), not the GPU's: measured 1 ulp apart on an H200 (docs/performance.md).
  if (kDevice.is_cuda())
    GTEST_SKIP() << "the CPU steps: bitwise the CPU's optimizer, not the GPU's";
  FusedAdamW adamw;
  adamw.lr = 0.01;
  adamw.weight_decay = 0.1;
  FusedSGD sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  sgd.weight_decay = 0.01;
  for (int accumulation : {1, 2}) {
    const Trained adamw_expected = train_reference<torch::optim::AdamW>(
        torch::optim::AdamWOptions(0.01).weight_decay(0.1), accumulation);
    const Trained sgd_expected = train_reference<torch::optim::SGD>(
        torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01), accumulation);
    for (int64_t k = 0; k <= kBlocks - 2; ++k) {
      for (Verbs verbs : {Verbs::run_block, Verbs::by_hand}) {
        expect_same(adamw_expected,
                    train_swapped(k, adamw, accumulation, verbs, nullptr, StepOn::host),
                    "host AdamW " + name(k, accumulation, verbs));
        expect_same(sgd_expected, train_swapped(k, sgd, accumulation, verbs, nullptr, StepOn::host),
                    "host SGD " + name(k, accumulation, verbs));
      }
    }
  }
}

// The host step moves the gradients out, the 2K loads of blocks without their optimizer state,
// and the weights of the blocks still on the device at the end of backward back in.
TEST(FineTune, TheStepOnTheHostMovesGradientsOutAndWeightsIn) {
  Model probe = fine_tune_model();
  std::size_t frozen = 0, trainable_params = 0, raw_params = 0;
  torch::Tensor last;
  for (const auto& p : probe.blocks[0]->parameters()) {
    (p.requires_grad() ? trainable_params : frozen) += aligned(p);
    if (p.requires_grad()) {
      last = p;
      raw_params += p.numel() * p.element_size();
    }
  }
  const std::size_t trainable_bytes =
      trainable_params - (aligned(last) - last.numel() * last.element_size());
  const std::size_t block_bytes = frozen + trainable_bytes;
  for (int64_t k = 0; k <= kBlocks - 2; ++k) {
    Stats stats;
    train_swapped(k, FusedAdamW{}, 1, Verbs::run_block, &stats, StepOn::host);
    const uint64_t steps = kSteps - 1;
    EXPECT_EQ(stats.d2h_bytes, steps * kBlocks * raw_params) << "K=" << k;
    EXPECT_EQ(stats.h2d_bytes, steps * (2 * k * block_bytes + (kBlocks - k) * trainable_bytes))
        << "K=" << k;
    EXPECT_EQ(stats.peak_device_bytes, (kBlocks - k) * layout::align_up(block_bytes)) << "K=" << k;
  }
}

// StepOn::automatic is the one measured faster for the device: on the emulated device, the
// host (docs/performance.md, "Full fine-tuning"). Same bytes as asking for it, same weights.
TEST(FineTune, TheAutomaticChoiceOnTheEmulatedDeviceIsTheStepOnTheHost) {
  if (kDevice.is_cuda()) GTEST_SKIP() << "the emulated device's own behaviour";
  const FusedAdamW adamw{1e-2, 0.9, 0.999, 1e-8, 0.01};
  Stats automatic, host;
  const Trained chosen =
      train_swapped(2, adamw, 1, Verbs::run_block, &automatic, StepOn::automatic);
  expect_same(train_swapped(2, adamw, 1, Verbs::run_block, &host, StepOn::host), chosen,
              "automatic against host");
  EXPECT_EQ(automatic.h2d_bytes, host.h2d_bytes);
  EXPECT_EQ(automatic.d2h_bytes, host.d2h_bytes);
  EXPECT_EQ(automatic.peak_device_bytes, host.peak_device_bytes);
  EXPECT_GT(automatic.d2h_bytes, 0u); // gradients go out
  Model model = fine_tune_model();
  EXPECT_EQ(
      ModelOffloader("blocks", model.modules(), fine_tune_options(2, adamw, 1, StepOn::automatic))
          .step_on(),
      StepOn::host);
  EXPECT_EQ(ModelOffloader("blocks", model.modules(), fine_tune_options(2, adamw, 1)).step_on(),
            StepOn::device);
}

TEST(FineTune, ReentrantCheckpointingIsExact) {
  // The caller's own reentrant checkpointing (every other block, not the first: its input
  // needs no gradient, so a reentrant checkpoint around it would have no backward at all): the
  // recompute's backward runs nested in the outer one, and each block steps there. With
  // accumulation, the nested backwards of one pass count as one micro-batch.
  FusedAdamW adamw;
  adamw.lr = 0.01;
  for (const int accumulation : {1, 2}) {
    const Trained expected =
        train_reference<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01), accumulation);
    for (int64_t k : {0, 2, 4}) {
      Model model = fine_tune_model();
      Options o = fine_tune_options(k, adamw, accumulation);
      o.reentrant_activation_checkpointing = true;
      Trained got;
      {
        ModelOffloader offloader("blocks", model.modules(), o);
        const auto batches = micro_batches(kSteps * accumulation);
        for (int pass = 0; pass < kSteps * accumulation; ++pass) {
          offloader.prepare_block_devices_before_forward();
          torch::Tensor h = batches[pass].x;
          for (int64_t i = 0; i < kBlocks; ++i) {
            h = i % 2 == 1 ? Checkpoint::apply(h, batches[pass].context, &offloader, i, &model)[0]
                           : offloader.run_block(i, {h, batches[pass].context}, model.fn(i))[0];
          }
          const torch::Tensor loss = loss_of(h);
          loss.backward();
          got.losses.push_back(loss.detach());
          EXPECT_EQ(offloader.accumulated_backwards(), (pass + 1) % accumulation);
        }
        got.parameters = all_parameters(model);
      }
      expect_same(expected, got,
                  "reentrant checkpointing K=" + std::to_string(k) + " accumulation " +
                      std::to_string(accumulation));
    }
  }
}

TEST(FineTune, NesterovSgdAndPlainSgdAreBitwiseLibTorchs) {
  FusedSGD nesterov;
  nesterov.lr = 0.02;
  nesterov.momentum = 0.8;
  nesterov.nesterov = true;
  expect_same(train_reference<torch::optim::SGD>(
                  torch::optim::SGDOptions(0.02).momentum(0.8).nesterov(true), 1),
              train_swapped(3, nesterov, 1, Verbs::run_block), "Nesterov K=3");
  FusedSGD plain;
  plain.lr = 0.1;
  expect_same(train_reference<torch::optim::SGD>(torch::optim::SGDOptions(0.1), 2),
              train_swapped(2, plain, 2, Verbs::by_hand), "plain SGD K=2");
}

TEST(FineTune, AdamWIsBitwiseLibTorchsAdamWForEveryK) {
  FusedAdamW adamw;
  adamw.lr = 0.01;
  adamw.weight_decay = 0.1;
  const auto options = torch::optim::AdamWOptions(0.01).weight_decay(0.1);
  expect_bitwise_for_every_k<torch::optim::AdamW>(options, adamw, "AdamW ");
}

TEST(FineTune, ACallbackStepsEachParameterWithItsState) {
  // Plain SGD with momentum written as a callback, against LibTorch's; on the host the
  // callback runs on the step's own thread.
  const Trained expected =
      train_reference<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9), 1);
  for (const StepOn where : {StepOn::device, StepOn::host}) {
    FusedCustom custom;
    custom.state_tensors = 1;
    std::map<std::string, int64_t> seen;
    custom.step = [&](const ParamStep& a) {
      ++seen[std::to_string(a.block) + "." + a.name];
      if (a.step == 1) {
        a.state[0].copy_(a.grad);
      } else {
        a.state[0].mul_(0.9).add_(a.grad, 1);
      }
      a.param.add_(a.state[0], -0.05);
    };
    const std::string what = where == StepOn::host ? "callback on the host" : "callback";
    expect_same(expected, train_swapped(2, custom, 1, Verbs::run_block, nullptr, where), what);
    EXPECT_EQ(seen.size(), static_cast<std::size_t>(kBlocks * 6)) << what; // fc1, fc2, lora
    for (const auto& [param, count] : seen) EXPECT_EQ(count, kSteps) << what << " " << param;
  }
}

TEST(FineTune, EachStepMovesTwoKLoadsAndWritesBackOnlyChangedBlocksTrainableBytes) {
  Model probe = fine_tune_model();
  std::size_t frozen = 0, trainable_params = 0;
  torch::Tensor last;
  for (const auto& p : probe.blocks[0]->parameters()) {
    (p.requires_grad() ? trainable_params : frozen) += aligned(p);
    if (p.requires_grad()) last = p;
  }
  // AdamW: the weights, then two moments each; the block ends where its last moment ends.
  const std::size_t trainable_bytes =
      3 * trainable_params - (aligned(last) - last.numel() * last.element_size());
  const std::size_t block_bytes = frozen + trainable_bytes;
  FusedAdamW adamw;
  for (int64_t k = 1; k <= kBlocks - 2; ++k) {
    Stats stats;
    train_swapped(k, adamw, 1, Verbs::run_block, &stats);
    const uint64_t steps = kSteps - 1; // after the warm-up
    // Every block is stepped in every backward. The K that leave in backward have changed;
    // of the K that leave in the next forward, those that stayed on the device since their
    // step (at most N-K: the others left and came back since, unchanged).
    const uint64_t write_backs = k + std::min(k, kBlocks - k);
    EXPECT_EQ(stats.h2d_bytes, steps * 2 * k * block_bytes) << "K=" << k;
    EXPECT_EQ(stats.d2h_bytes, steps * write_backs * trainable_bytes) << "K=" << k;
    const std::size_t slot = layout::align_up(block_bytes);
    EXPECT_EQ(stats.peak_device_bytes, (kBlocks - k) * slot) << "K=" << k;
  }
}

TEST(FineTune, NoStepNoWriteBack) {
  // Inference and frozen passes move no byte back.
  Model model = fine_tune_model();
  ModelOffloader offloader("blocks", model.modules(), fine_tune_options(2, FusedAdamW{}, 1));
  const auto before = all_parameters(model);
  offloader.set_forward_only(true);
  {
    torch::NoGradGuard no_grad;
    for (int pass = 0; pass < 3; ++pass) forward(offloader, model, Inputs{}, Verbs::run_block);
  }
  offloader.set_forward_only(false);
  // A training forward whose backward never runs changes nothing either.
  forward(offloader, model, Inputs{}, Verbs::run_block);
  forward(offloader, model, Inputs{}, Verbs::run_block);
  offloader.synchronize();
  EXPECT_EQ(offloader.stats().d2h_bytes, 0u);
  const auto after = all_parameters(model);
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(equal_on_host(before[i], after[i]));
}

TEST(FineTune, ParametersReadTheirTrueValuesBetweenSteps) {
  // A trainer saves checkpoints between steps: every parameter and every optimizer state
  // tensor reads the value the step gave it, on the device or not.
  FusedAdamW adamw;
  adamw.lr = 0.01;
  Model reference = fine_tune_model();
  torch::optim::AdamW optimizer(trainable(reference), torch::optim::AdamWOptions(0.01));
  Model model = fine_tune_model();
  ModelOffloader offloader("blocks", model.modules(), fine_tune_options(3, adamw, 1));
  const auto batches = micro_batches(3);
  for (int step = 0; step < 3; ++step) {
    const Inputs& in = batches[step];
    loss_of(reference.forward(in.x, in.context)).backward();
    optimizer.step();
    for (auto& p : trainable(reference)) p.mutable_grad().reset();
    loss_of(forward(offloader, model, in, Verbs::run_block)).backward();
    const auto expected = all_parameters(reference), got = all_parameters(model);
    for (std::size_t i = 0; i < got.size(); ++i) {
      expect_bitwise(expected[i], got[i],
                     "step " + std::to_string(step) + " parameter " + std::to_string(i));
    }
    for (int64_t b = 0; b < kBlocks; ++b) {
      const auto state = offloader.optimizer_state(b);
      ASSERT_EQ(state.size(), 12u); // 6 parameters, 2 moments each
      for (const auto& [name, tensor] : state) {
        const std::string param = name.substr(0, name.rfind('.'));
        const std::string moment = name.substr(name.rfind('.') + 1);
        const torch::Tensor p = model.blocks[b]->named_parameters()[param];
        const auto& ref_state = static_cast<torch::optim::AdamWParamState&>(*optimizer.state().at(
            reference.blocks[b]->named_parameters()[param].unsafeGetTensorImpl()));
        expect_bitwise(moment == "exp_avg" ? ref_state.exp_avg() : ref_state.exp_avg_sq(), tensor,
                       "block " + std::to_string(b) + " " + name);
        EXPECT_EQ(tensor.sizes(), p.sizes());
      }
      for (const auto& [param, steps] : offloader.optimizer_steps(b)) EXPECT_EQ(steps, step + 1);
    }
  }
}

// An evaluation pass after a step evicts blocks that changed in it: reading and writing the
// weights after that pass (a checkpoint, loading new weights) sees and keeps the latest values
// (Note [host copy after a pass]).
TEST(FineTune, WeightsReadAndWrittenAfterAnEvaluationPassAreTheLatest) {
  for (int eval = 0; eval < 8; ++eval) {
    const StepOn step_on = eval < 4 ? StepOn::device : StepOn::host;
    FusedSGD sgd;
    sgd.lr = 0.1;
    Model reference = fine_tune_model();
    torch::optim::SGD optimizer(trainable(reference), torch::optim::SGDOptions(0.1));
    Model model = fine_tune_model();
    ModelOffloader offloader("blocks", model.modules(), fine_tune_options(1, sgd, 1, step_on));
    const auto batches = micro_batches(3);
    auto step = [&](const Inputs& in) {
      loss_of(reference.forward(in.x, in.context)).backward();
      optimizer.step();
      for (auto& p : trainable(reference)) p.mutable_grad().reset();
      loss_of(forward(offloader, model, in, Verbs::run_block)).backward();
    };
    step(batches[0]);
    const std::string what = "evaluation " + std::to_string(eval);
    if (eval % 4 == 0) {
      c10::InferenceMode inference;
      forward(offloader, model, batches[1], Verbs::run_block);
    } else if (eval % 4 == 1) {
      offloader.set_forward_only(true);
      torch::NoGradGuard no_grad;
      forward(offloader, model, batches[1], Verbs::run_block);
    } else if (eval % 4 == 2) {
      torch::NoGradGuard no_grad; // a training-mode forward without a graph
      forward(offloader, model, batches[1], Verbs::by_hand);
    } else {
      // New weights for block 0 written while its write-back is still in flight (it has just
      // left the device, between two blocks of a pass): they stay.
      torch::NoGradGuard no_grad;
      offloader.prepare_block_devices_before_forward();
      torch::Tensor x = batches[1].x;
      for (int64_t i = 0; i < kBlocks; ++i) {
        x = offloader.run_block(i, {x, batches[1].context}, model.fn(i))[0];
        if (i == 0) {
          EXPECT_FALSE(offloader.is_resident(0));
          reference.blocks[0]->fc2->weight.fill_(-0.5);
          model.blocks[0]->fc2->weight.fill_(-0.5);
        }
      }
    }
    auto expected = all_parameters(reference), got = all_parameters(model);
    for (std::size_t i = 0; i < got.size(); ++i) {
      expect_bitwise(expected[i], got[i], what + " read, parameter " + std::to_string(i));
    }
    {
      torch::NoGradGuard no_grad; // new weights for block 0, as from a checkpoint
      reference.blocks[0]->fc1->weight.fill_(0.25);
      model.blocks[0]->fc1->weight.fill_(0.25);
    }
    offloader.set_forward_only(false);
    step(batches[2]);
    expected = all_parameters(reference);
    got = all_parameters(model);
    for (std::size_t i = 0; i < got.size(); ++i) {
      expect_bitwise(expected[i], got[i], what + " then written, parameter " + std::to_string(i));
    }
  }
}

TEST(FineTune, ALearningRateScheduleIsFollowed) {
  FusedSGD sgd;
  sgd.lr = 0.1;
  Model reference = fine_tune_model();
  torch::optim::SGD optimizer(trainable(reference), torch::optim::SGDOptions(0.1));
  Model model = fine_tune_model();
  ModelOffloader offloader("blocks", model.modules(), fine_tune_options(2, sgd, 1));
  const auto batches = micro_batches(3);
  for (int step = 0; step < 3; ++step) {
    const double lr = 0.1 / (step + 1);
    static_cast<torch::optim::SGDOptions&>(optimizer.param_groups()[0].options()).lr(lr);
    offloader.set_learning_rate(lr);
    loss_of(reference.forward(batches[step].x, batches[step].context)).backward();
    optimizer.step();
    for (auto& p : trainable(reference)) p.mutable_grad().reset();
    loss_of(forward(offloader, model, batches[step], Verbs::run_block)).backward();
  }
  const auto expected = all_parameters(reference), got = all_parameters(model);
  for (std::size_t i = 0; i < got.size(); ++i) {
    expect_bitwise(expected[i], got[i], "parameter " + std::to_string(i));
  }
}

TEST(FineTune, NewHyperParametersApplyFromTheNextStep) {
  FusedAdamW adamw;
  adamw.lr = 0.01;
  Model reference = fine_tune_model();
  torch::optim::AdamW optimizer(trainable(reference), torch::optim::AdamWOptions(0.01));
  Model model = fine_tune_model();
  ModelOffloader offloader("blocks", model.modules(), fine_tune_options(2, adamw, 1));
  const auto batches = micro_batches(3);
  for (int step = 0; step < 3; ++step) {
    adamw.beta1 = 0.9 - 0.1 * step;
    adamw.weight_decay = 0.05 * step;
    auto& o = static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups()[0].options());
    o.betas({adamw.beta1, adamw.beta2}).weight_decay(adamw.weight_decay);
    offloader.set_optimizer(adamw);
    loss_of(reference.forward(batches[step].x, batches[step].context)).backward();
    optimizer.step();
    for (auto& p : trainable(reference)) p.mutable_grad().reset();
    loss_of(forward(offloader, model, batches[step], Verbs::run_block)).backward();
  }
  const auto expected = all_parameters(reference), got = all_parameters(model);
  for (std::size_t i = 0; i < got.size(); ++i) {
    expect_bitwise(expected[i], got[i], "parameter " + std::to_string(i));
  }
  expect_error([&] { offloader.set_optimizer(FusedSGD{0.1}); }, "same kind");
  FusedAdamW bad = adamw;
  bad.beta2 = 1.5;
  expect_error([&] { offloader.set_optimizer(bad); }, "betas");
}

TEST(FineTune, PerParameterClippingIsClipGradNormOfEachParameterAlone) {
  FusedSGD sgd;
  sgd.lr = 0.5;
  Model reference = fine_tune_model();
  torch::optim::SGD optimizer(trainable(reference), torch::optim::SGDOptions(0.5));
  Model model = fine_tune_model();
  Options o = fine_tune_options(2, sgd, 1);
  o.max_grad_norm_per_parameter = 0.01;
  ModelOffloader offloader("blocks", model.modules(), o);
  const auto batches = micro_batches(2);
  int clipped = 0;
  for (int step = 0; step < 2; ++step) {
    loss_of(reference.forward(batches[step].x, batches[step].context)).backward();
    for (auto& p : trainable(reference)) {
      const double norm = torch::nn::utils::clip_grad_norm_({p}, 0.01);
      clipped += norm > 0.01;
    }
    optimizer.step();
    for (auto& p : trainable(reference)) p.mutable_grad().reset();
    loss_of(forward(offloader, model, batches[step], Verbs::run_block)).backward();
  }
  EXPECT_GT(clipped, 0); // the test clips something
  const auto expected = all_parameters(reference), got = all_parameters(model);
  for (std::size_t i = 0; i < got.size(); ++i) {
    expect_bitwise(expected[i], got[i], "parameter " + std::to_string(i));
  }
}

TEST(FineTune, FrozenWeightsNeverChangeAndGradIsNeverKept) {
  Model model = fine_tune_model();
  const torch::Tensor norm_before = model.blocks[4]->norm->weight.detach().clone();
  ModelOffloader offloader("blocks", model.modules(), fine_tune_options(2, FusedAdamW{}, 1));
  loss_of(forward(offloader, model, Inputs{}, Verbs::run_block)).backward();
  EXPECT_TRUE(equal_on_host(model.blocks[4]->norm->weight, norm_before));
  for (const auto& p : trainable(model)) EXPECT_FALSE(p.grad().defined());
}

TEST(FineTune, MistakesAreClearErrors) {
  Model model = fine_tune_model();
  Options no_backward = fine_tune_options(2, FusedAdamW{}, 1);
  no_backward.supports_backward = false;
  expect_error([&] { ModelOffloader o("blocks", model.modules(), no_backward); },
               "needs supports_backward");
  FusedAdamW bad_beta;
  bad_beta.beta1 = 1.0;
  expect_error(
      [&] { ModelOffloader o("blocks", model.modules(), fine_tune_options(2, bad_beta, 1)); },
      "betas");
  expect_error(
      [&] { ModelOffloader o("blocks", model.modules(), fine_tune_options(2, FusedSGD{}, 0)); },
      "gradient_accumulation_steps");
  Options accumulate_without = options(2, true);
  accumulate_without.gradient_accumulation_steps = 2;
  expect_error([&] { ModelOffloader o("blocks", model.modules(), accumulate_without); },
               "set Options::optimizer too");
  expect_error(
      [&] { ModelOffloader o("blocks", model.modules(), fine_tune_options(2, FusedCustom{}, 1)); },
      "needs a step function");
  // A gradient left over from an earlier backward would be summed into the first step.
  loss_of(model.forward(Inputs{}.x, Inputs{}.context)).backward();
  expect_error(
      [&] { ModelOffloader o("blocks", model.modules(), fine_tune_options(2, FusedSGD{}, 1)); },
      "has a gradient already");
  for (auto& p : trainable(model)) p.mutable_grad().reset();
  ModelOffloader offloader("blocks", model.modules(),
                           fine_tune_options(2, FusedCustom{0, [](const ParamStep&) {}}, 1));
  expect_error([&] { offloader.set_learning_rate(0.1); }, "keeps its own learning rate");
  expect_error([&] { offloader.optimizer_state(kBlocks); }, "out of range");
  expect_error([&] { offloader.set_optimizer_steps(0, "nope", 1); },
               "no trainable parameter 'nope'");
}

TEST(FineTune, AParameterUsedAlsoOutsideItsBlockIsExactAndOnlyOutsideIsRefused) {
  // A weight also used by the loss: autograd sums both uses before the step sees the gradient.
  const Inputs in;
  Model reference = fine_tune_model();
  torch::optim::SGD optimizer(trainable(reference), torch::optim::SGDOptions(0.1));
  const torch::Tensor y_ref = reference.forward(in.x, in.context);
  (loss_of(y_ref) + reference.blocks[5]->fc1->weight.pow(2).sum()).backward();
  optimizer.step();
  Model model = fine_tune_model();
  ModelOffloader offloader("blocks", model.modules(), fine_tune_options(2, FusedSGD{0.1}, 1));
  const torch::Tensor y = forward(offloader, model, in, Verbs::run_block);
  (loss_of(y) + model.blocks[5]->fc1->weight.pow(2).sum()).backward();
  const auto expected = all_parameters(reference), got = all_parameters(model);
  for (std::size_t i = 0; i < got.size(); ++i) {
    expect_bitwise(expected[i], got[i], "parameter " + std::to_string(i));
  }
  // A backward that reaches the weight but not its block: no step can be placed.
  const torch::Tensor block0 = model.blocks[0]->fc1->weight;
  expect_error([&] { block0.pow(2).sum().backward(); }, "outside its block's backward");
}

TEST(FineTune, ParametersMissingFromTheLastAccumulatingBackwardAreAnError) {
  // fc2's bias of every block gets a gradient in the first backward only.
  Model model = fine_tune_model();
  ModelOffloader offloader("blocks", model.modules(), fine_tune_options(1, FusedSGD{0.1}, 2));
  loss_of(forward(offloader, model, Inputs{}, Verbs::run_block)).backward();
  offloader.prepare_block_devices_before_forward();
  torch::Tensor x = Inputs{}.x;
  for (int64_t i = 0; i < kBlocks; ++i) {
    TestBlock block = model.blocks[i];
    x = offloader.run_block(i, {x}, [block](const variable_list& in) {
      return variable_list{in[0] + torch::linear(in[0], block->fc1->weight).sum()};
    })[0];
  }
  expect_error([&] { loss_of(x).backward(); }, "got gradients in earlier accumulating backwards");
}

// The first `blocks` blocks of a pass; the loss on the last one's output.
torch::Tensor loss_through(Model& model, const Inputs& in, int64_t blocks,
                           ModelOffloader* offloader) {
  if (offloader != nullptr) offloader->prepare_block_devices_before_forward();
  torch::Tensor x = in.x;
  for (int64_t i = 0; i < blocks; ++i) {
    x = offloader != nullptr ? offloader->run_block(i, {x, in.context}, model.fn(i))[0]
                             : model.blocks[i]->forward(x, in.context);
  }
  return loss_of(x);
}

// torch::optim steps every parameter with a .grad after the n-th micro-batch, whichever
// micro-batches reached it: here the first micro-batch's loss is on block 3's output, so
// blocks 4 and 5 get their gradient from the last backward only. The fused step counts
// backward calls, not backwards per block (Note [accumulation] in src/torch/fine_tune.cpp).
TEST(FineTune, AccumulationStepsInTheNthBackwardWhicheverBlocksEachMicroBatchReached) {
  torch::optim::SGDOptions sgd_options(0.05);
  sgd_options.momentum(0.9);
  FusedSGD sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  const auto batches = micro_batches(2 * 3);
  const int64_t reach[2] = {4, kBlocks}; // blocks each micro-batch goes through
  Model reference = fine_tune_model();
  torch::optim::SGD optimizer(trainable(reference), sgd_options);
  for (int step = 0; step < 3; ++step) {
    for (int m = 0; m < 2; ++m) {
      loss_through(reference, batches[step * 2 + m], reach[m], nullptr).backward();
    }
    optimizer.step();
    for (auto& p : trainable(reference)) p.mutable_grad().reset();
  }
  const auto expected = all_parameters(reference);
  for (const StepOn step_on : {StepOn::device, StepOn::host}) {
    Model model = fine_tune_model();
    ModelOffloader offloader("blocks", model.modules(), fine_tune_options(2, sgd, 2, step_on));
    for (int step = 0; step < 3; ++step) {
      for (int m = 0; m < 2; ++m) {
        loss_through(model, batches[step * 2 + m], reach[m], &offloader).backward();
        EXPECT_EQ(offloader.accumulated_backwards(), m == 0 ? 1 : 0);
      }
    }
    for (int64_t b = 0; b < kBlocks; ++b) {
      for (const auto& [name, steps] : offloader.optimizer_steps(b)) {
        EXPECT_EQ(steps, 3) << "block " << b << " " << name;
      }
    }
    const auto got = all_parameters(model);
    for (std::size_t i = 0; i < got.size(); ++i) {
      expect_bitwise(expected[i], got[i], "parameter " + std::to_string(i));
    }
  }
}

// The other way round the step cannot follow torch::optim: blocks 4 and 5 have summed
// gradients when the last backward, where every step runs, does not reach them.
TEST(FineTune, BlocksTheLastAccumulatingBackwardDoesNotReachAreNamed) {
  Model model = fine_tune_model();
  ModelOffloader offloader("blocks", model.modules(), fine_tune_options(2, FusedSGD{0.1}, 2));
  const auto batches = micro_batches(2);
  loss_through(model, batches[0], kBlocks, &offloader).backward();
  expect_error([&] { loss_through(model, batches[1], 4, &offloader).backward(); },
               "'fc1.weight' of block 4");
  EXPECT_EQ(offloader.accumulated_backwards(), 0); // the next step starts anew
}

// A block stepped in backward that the next forward evicts: once it has left, its parameters
// read the stepped values at once, in the middle of that pass (a weight tied into the loss, a
// hook that logs a norm), and a loss through them is exact.
// Note [device change] in block_binder.cpp: once its block has left, a parameter is a view of
// its host copy, on another device than the one autograd saw in the block (on a GPU, the
// host's). Reading it gives the stepped value; using it in the loss gives it a gradient of its
// own, outside the block's backward, which raises instead of stepping twice.
TEST(FineTune, ABlockParameterReadInThePassAfterItsBlockLeftIsTheSteppedValue) {
  const auto batches = micro_batches(3);
  for (const int64_t k : {1, 2}) {
    Model reference = fine_tune_model();
    torch::optim::SGD optimizer(trainable(reference), torch::optim::SGDOptions(0.1));
    Model model = fine_tune_model();
    ModelOffloader offloader("blocks", model.modules(), fine_tune_options(k, FusedSGD{0.1}, 1));
    for (int step = 0; step < 3; ++step) {
      const Inputs& in = batches[step];
      torch::Tensor x_ref = in.x;
      torch::Tensor x = in.x;
      offloader.prepare_block_devices_before_forward();
      for (int64_t i = 0; i < kBlocks; ++i) {
        x_ref = reference.blocks[i]->forward(x_ref, in.context);
        x = offloader.run_block(i, {x, in.context}, model.fn(i))[0];
        if (i != 1) continue;
        ASSERT_FALSE(offloader.is_resident(0)) << "K=" << k; // block 0 left after its forward
        expect_bitwise(reference.blocks[0]->fc1->weight.detach(),
                       model.blocks[0]->fc1->weight.detach(),
                       "K=" + std::to_string(k) + " step " + std::to_string(step));
      }
      loss_of(x_ref).backward();
      optimizer.step();
      for (auto& p : trainable(reference)) p.mutable_grad().reset();
      loss_of(x).backward();
    }
    const auto expected = all_parameters(reference), got = all_parameters(model);
    for (std::size_t i = 0; i < got.size(); ++i) {
      expect_bitwise(expected[i], got[i],
                     "K=" + std::to_string(k) + " parameter " + std::to_string(i));
    }
    offloader.prepare_block_devices_before_forward();
    torch::Tensor x = batches[0].x;
    torch::Tensor tied;
    for (int64_t i = 0; i < kBlocks; ++i) {
      x = offloader.run_block(i, {x, batches[0].context}, model.fn(i))[0];
      if (i == 1) tied = model.blocks[0]->fc1->weight.pow(2).sum();
    }
    expect_error([&] { (loss_of(x) + tied).backward(); }, "'fc1.weight' of block 0");
  }
}

// A copy failing during a step on the host (a gradient going out, a block coming in): every
// parameter is wholly its old or its new value, and the error says which step failed.
TEST(FineTune, AFailedCopyDuringTheHostStepLosesNoWeight) {
  if (kDevice.is_cuda()) GTEST_SKIP() << "the emulated device's own behaviour";
  FusedSGD sgd;
  sgd.lr = 0.5;
  Model reference = fine_tune_model();
  const auto old_values = all_parameters(reference);
  torch::optim::SGD optimizer(trainable(reference), torch::optim::SGDOptions(0.5));
  const Inputs in;
  loss_of(reference.forward(in.x, in.context)).backward();
  optimizer.step();
  const auto new_values = all_parameters(reference);
  int named = 0;
  for (std::size_t nth = 0; nth < 40; nth += 3) {
    Model model = fine_tune_model();
    auto emulated = std::make_shared<EmulatedDevice>();
    Options o = fine_tune_options(2, sgd, 1, StepOn::host);
    o.shared_device = std::make_shared<Device>(emulated);
    o.device = c10::kCPU;
    std::optional<std::string> error;
    {
      ModelOffloader offloader("blocks", model.modules(), o);
      const torch::Tensor loss = loss_of(forward(offloader, model, in, Verbs::run_block));
      emulated->fail_copy(nth, 64);
      try {
        loss.backward();
        offloader.synchronize();
      } catch (const Error& e) {
        error = e.what();
      }
    }
    if (!error) continue;
    if (error->find("the step on the host failed for parameter") != std::string::npos) ++named;
    const auto got = all_parameters(model);
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(equal_on_host(got[i], old_values[i]) || equal_on_host(got[i], new_values[i]))
          << "copy " << nth << ": parameter " << i << " is a mix; " << *error;
    }
  }
  EXPECT_GT(named, 0) << "no injected failure hit a gradient's copy";
}

// Note [atomic write-back]: a copy that fails while blocks are written back leaves every
// trainable tensor's host copy wholly old or wholly new, and the error names the blocks.
TEST(FineTune, AFailedWriteBackLosesNoWeight) {
  if (kDevice.is_cuda()) GTEST_SKIP() << "the emulated device's own behaviour";
  FusedSGD sgd;
  sgd.lr = 0.5;
  Model reference = fine_tune_model();
  const auto old_values = all_parameters(reference);
  torch::optim::SGD optimizer(trainable(reference), torch::optim::SGDOptions(0.5));
  const Inputs in;
  loss_of(reference.forward(in.x, in.context)).backward();
  optimizer.step();
  const auto new_values = all_parameters(reference);
  int named = 0;
  for (std::size_t nth = 0; nth < 12; ++nth) {
    for (bool half : {false, true}) {
      Model model = fine_tune_model();
      auto emulated = std::make_shared<EmulatedDevice>();
      Options o = options(2, true);
      o.optimizer = sgd;
      o.step_on = StepOn::device; // its write-backs (the host's: AFailedCopyDuringTheHostStep…)
      o.shared_device = std::make_shared<Device>(emulated);
      o.device = c10::kCPU;
      std::optional<std::string> error;
      {
        ModelOffloader offloader("blocks", model.modules(), o);
        const torch::Tensor loss = loss_of(forward(offloader, model, in, Verbs::run_block));
        emulated->fail_copy(nth, half ? 1000 : 0);
        try {
          loss.backward();
          offloader.synchronize();
        } catch (const Error& e) {
          error = e.what();
        }
      }
      if (!error) continue;
      if (error->find("written back from block(s)") != std::string::npos) ++named;
      const auto got = all_parameters(model);
      for (std::size_t i = 0; i < got.size(); ++i) {
        const bool is_old = equal_on_host(got[i], old_values[i]);
        const bool is_new = equal_on_host(got[i], new_values[i]);
        EXPECT_TRUE(is_old || is_new) << "copy " << nth << (half ? " half-way" : "")
                                      << ": parameter " << i << " is a mix; " << *error;
      }
    }
  }
  EXPECT_GT(named, 0) << "no injected failure hit a write-back";
}

// A backward that fails part-way (here a hook on block 2's output): the blocks whose backward
// ran before it were stepped, and those steps stand, with the step on the device as on the
// host. What the next pass computes is what the parameters read: no block computes with
// weights other than those its parameters show, and training goes on.
TEST(FineTune, ABackwardThatFailsPartWayKeepsTheStepsItTookEverywhere) {
  for (const StepOn where : {StepOn::device, StepOn::host}) {
    const std::string what = where == StepOn::host ? "host" : "device";
    Model model = fine_tune_model();
    const auto before = all_parameters(model);
    ModelOffloader offloader("blocks", model.modules(),
                             fine_tune_options(2, FusedSGD{0.1}, 1, where));
    const Inputs in;
    offloader.prepare_block_devices_before_forward();
    torch::Tensor x = in.x;
    for (int64_t i = 0; i < kBlocks; ++i) {
      x = offloader.run_block(i, {x, in.context}, model.fn(i))[0];
      if (i == 2) {
        x.register_hook([](const torch::Tensor&) -> torch::Tensor {
          throw std::runtime_error("boom in backward");
        });
      }
    }
    EXPECT_THROW(loss_of(x).backward(), std::exception) << what;

    torch::Tensor evaluated;
    {
      torch::NoGradGuard no_grad;
      evaluated = forward(offloader, model, in, Verbs::run_block);
    }
    const auto now = all_parameters(model);
    // Blocks 3..5 (their backward ran) changed in every trainable parameter; 0..2 did not.
    std::size_t index = 0;
    for (int64_t b = 0; b < kBlocks; ++b) {
      for (const auto& p : model.blocks[b]->parameters()) {
        const bool same = equal_on_host(now[index], before[index]);
        EXPECT_EQ(same, b <= 2 || !p.requires_grad()) << what << " block " << b << " " << index;
        ++index;
      }
    }
    Model plain = fine_tune_model();
    {
      torch::NoGradGuard no_grad;
      std::size_t i = 0;
      for (auto& block : plain.blocks) {
        for (auto& p : block->parameters()) p.copy_(now[i++]);
      }
      expect_bitwise(plain.forward(in.x, in.context), evaluated, what + ": the next pass");
    }
    const torch::Tensor loss = loss_of(forward(offloader, model, in, Verbs::run_block));
    EXPECT_NO_THROW(loss.backward()) << what;
    for (const auto& p : all_parameters(model)) EXPECT_TRUE(p.isfinite().all().item<bool>());
  }
}

} // namespace
} // namespace blockswap
