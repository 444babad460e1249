// The call patterns a trainer uses, tried as an outside user would from the public header and
// docs/guide.md: every pattern gives results bitwise equal to the model run without
// blockswap, or raises blockswap::Error at the first call that makes it impossible.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <set>
#include <sstream>

#include "blockswap/core/error.hpp"
#include "blockswap/torch.hpp"
#include "test_model.hpp"

namespace blockswap {
namespace {

constexpr int64_t kBlocks = 8;

// One training step's results: loss, input gradient, adapter gradients.
struct Step {
  torch::Tensor loss, x_grad;
  std::vector<torch::Tensor> lora_grads;
};

Step collect(Model& model, const torch::Tensor& loss, const torch::Tensor& x) {
  Step step{loss.detach(), x.grad(), {}};
  for (auto& p : model.lora()) {
    step.lora_grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  return step;
}

void expect_same(const Step& a, const Step& b, const std::string& what) {
  expect_bitwise(a.loss, b.loss, what + " loss");
  if (a.x_grad.defined() || b.x_grad.defined()) expect_bitwise(a.x_grad, b.x_grad, what + " x");
  ASSERT_EQ(a.lora_grads.size(), b.lora_grads.size());
  for (std::size_t p = 0; p < a.lora_grads.size(); ++p) {
    expect_bitwise(a.lora_grads[p], b.lora_grads[p], what + " lora " + std::to_string(p));
  }
}

// `forward(model, x, context, offloader)` returns the loss; offloader is null for the reference.
template <typename Forward>
void expect_exact(const std::vector<int64_t>& ks, bool supports_backward, Forward&& forward,
                  const std::string& what, int steps = 2) {
  const Inputs in;
  Model reference(kBlocks);
  std::vector<Step> expected;
  for (int s = 0; s < steps; ++s) {
    torch::Tensor x = in.x.clone().requires_grad_(true);
    const torch::Tensor loss = forward(reference, x, in.context, nullptr);
    expected.push_back(collect(reference, loss, x));
  }
  for (int64_t k : ks) {
    Model model(kBlocks);
    ModelOffloader offloader("blocks", model.modules(), options(k, supports_backward));
    for (int s = 0; s < steps; ++s) {
      torch::Tensor x = in.x.clone().requires_grad_(true);
      const torch::Tensor loss = forward(model, x, in.context, &offloader);
      expect_same(expected[s], collect(model, loss, x),
                  what + " K=" + std::to_string(k) + " step " + std::to_string(s));
    }
  }
}

// Blocks 0..last through the offloader (or plainly), returning each block's output.
std::vector<torch::Tensor> run_blocks(Model& model, ModelOffloader* offloader, torch::Tensor x,
                                      const torch::Tensor& context, int64_t count = kBlocks) {
  std::vector<torch::Tensor> outs;
  for (int64_t i = 0; i < count; ++i) {
    x = offloader ? offloader->run_block(i, {x, context}, model.fn(i))[0]
                  : model.blocks[i]->forward(x, context);
    outs.push_back(x);
  }
  return outs;
}

void prepare(ModelOffloader* offloader) {
  if (offloader) offloader->prepare_block_devices_before_forward();
}

// Case 1: the seed's verbs by hand in training, through the overload that sees the outputs.
TEST(CallPatterns, VerbsByHandInTrainingAreExactThroughTheOverload) {
  expect_exact(
      {1, 3, 6}, true,
      [](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
        prepare(o);
        for (int64_t i = 0; i < kBlocks; ++i) {
          if (!o) {
            x = m.blocks[i]->forward(x, c);
            continue;
          }
          o->wait_for_block(i);
          x = o->submit_move_blocks_forward(i, {m.blocks[i]->forward(x, c)})[0];
        }
        const torch::Tensor loss = x.pow(2).mean();
        loss.backward();
        return loss;
      },
      "overload");
}

// Case 1: the plain verbs cannot see backward: with grad mode on they raise at the first move.
TEST(CallPatterns, PlainVerbsWithGradModeOnRaise) {
  const Inputs in;
  for (bool training : {true, false}) {
    Model model(kBlocks);
    ModelOffloader offloader("blocks", model.modules(), options(3, training));
    offloader.prepare_block_devices_before_forward();
    offloader.wait_for_block(0);
    const torch::Tensor y = model.blocks[0]->forward(in.x, in.context);
    expect_error([&] { offloader.submit_move_blocks_forward(0); },
                 "submit_move_blocks_forward(0) with grad mode on");
    expect_error([&] { offloader.submit_move_blocks_forward(0); }, "torch::NoGradGuard");
    expect_error([&] { offloader.submit_move_blocks_forward(8); }, "block index 8 is out of range");
    expect_error([&] { offloader.submit_move_blocks_forward(-1, {y}); },
                 "block index -1 is out of range");
    // Nothing moved: the block is still usable and the next pass works.
    EXPECT_TRUE(offloader.is_resident(0));
    torch::NoGradGuard no_grad;
    offloader.prepare_block_devices_before_forward();
    expect_bitwise(forward_manual(offloader, model, in.x, in.context),
                   Model(kBlocks).forward(in.x, in.context), "after the error");
  }
}

// Case 2: an offloader in forward-only mode while the caller trains: exact (blocks are brought
// back on demand in backward).
TEST(CallPatterns, TrainingThroughAForwardOnlyOffloaderIsExact) {
  auto step = [](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
    prepare(o);
    const torch::Tensor loss = run_blocks(m, o, x, c).back().pow(2).mean();
    loss.backward();
    return loss;
  };
  expect_exact({1, 3, 7}, false, step, "supports_backward=false");
  // set_forward_only(true) left on after sampling
  expect_exact(
      {1, 3, 6}, true,
      [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
        if (o) o->set_forward_only(true);
        return step(m, x, c, o);
      },
      "set_forward_only(true)");
}

// Case 3: a loss on an intermediate block, the later blocks run but not in the graph.
TEST(CallPatterns, LossOnAnIntermediateBlockIsExact) {
  for (int64_t target : {0, 2, 5}) {
    expect_exact(
        {1, 3, 6}, true,
        [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
          prepare(o);
          const torch::Tensor loss = run_blocks(m, o, x, c)[target].pow(2).mean();
          loss.backward();
          return loss;
        },
        "loss on block " + std::to_string(target));
  }
  // An intermediate output in the loss and also feeding the later blocks.
  expect_exact(
      {3}, true,
      [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
        prepare(o);
        const auto outs = run_blocks(m, o, x, c);
        const torch::Tensor loss = outs[2].pow(2).mean() + outs.back().pow(2).mean();
        loss.backward();
        return loss;
      },
      "loss on blocks 2 and 7");
  // Only the first blocks run at all.
  expect_exact(
      {3}, true,
      [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
        prepare(o);
        const torch::Tensor loss = run_blocks(m, o, x, c, 5).back().pow(2).mean();
        loss.backward();
        return loss;
      },
      "five blocks of eight");
}

// Two forward passes, then one backward through both; and backward twice.
TEST(CallPatterns, TwoForwardsThenOneBackwardAndBackwardTwiceAreExact) {
  expect_exact(
      {1, 3, 6}, true,
      [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
        prepare(o);
        const torch::Tensor first = run_blocks(m, o, x, c).back().pow(2).mean();
        prepare(o);
        const torch::Tensor second = run_blocks(m, o, x * 0.5, c).back().abs().mean();
        const torch::Tensor loss = first + second;
        loss.backward();
        return loss;
      },
      "two forwards");
  expect_exact(
      {1, 3, 6}, true,
      [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
        prepare(o);
        const torch::Tensor loss = run_blocks(m, o, x, c).back().pow(2).mean();
        loss.backward({}, /*retain_graph=*/true);
        loss.backward();
        return loss;
      },
      "backward twice");
}

// Case 6: reentrant checkpointing with the option forgotten is named in the error.
TEST(CallPatterns, ReentrantCheckpointingWithoutTheOptionRaises) {
  const Inputs in;
  for (int64_t k : {1, 3, 6}) {
    Model model(kBlocks);
    ModelOffloader offloader("blocks", model.modules(), options(k, true));
    offloader.prepare_block_devices_before_forward();
    torch::Tensor x = in.x.clone().requires_grad_(true);
    for (int64_t i = 0; i < kBlocks; ++i) {
      x = Checkpoint::apply(x, in.context, &offloader, i, &model)[0];
    }
    try {
      x.pow(2).mean().backward();
      ADD_FAILURE() << "K=" << k << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("reentrant_activation_checkpointing = true"),
                std::string::npos)
          << e.what();
    }
  }
}

// Case 7 and mode changes between a step's forward and its backward.
TEST(CallPatterns, ModeChangesBetweenForwardAndBackwardAreExact) {
  using Change = std::function<void(ModelOffloader&)>;
  const std::vector<std::pair<std::string, Change>> changes{
      {"disable", [](ModelOffloader& o) { o.disable_block_swap(); }},
      {"disable+prepare",
       [](ModelOffloader& o) {
         o.disable_block_swap();
         o.prepare_block_devices_before_forward();
       }},
      {"forward-only+prepare",
       [](ModelOffloader& o) {
         o.set_forward_only(true);
         o.prepare_block_devices_before_forward();
       }},
      {"prepare", [](ModelOffloader& o) { o.prepare_block_devices_before_forward(); }},
  };
  for (const auto& [name, change] : changes) {
    expect_exact(
        {1, 3, 6}, true,
        [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
          if (o) {
            o->enable_block_swap();
            o->set_forward_only(false);
          }
          prepare(o);
          const torch::Tensor loss = run_blocks(m, o, x, c).back().pow(2).mean();
          if (o) change(*o);
          loss.backward();
          return loss;
        },
        name);
  }
  // Forward with swapping disabled, backward after enabling it again.
  expect_exact(
      {3}, true,
      [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
        if (o) o->disable_block_swap();
        prepare(o);
        const torch::Tensor loss = run_blocks(m, o, x, c).back().pow(2).mean();
        if (o) o->enable_block_swap();
        prepare(o);
        loss.backward();
        return loss;
      },
      "forward disabled, backward enabled");
}

// An optional input left undefined, in training and inference.
TEST(CallPatterns, UndefinedOptionalInputsWork) {
  for (bool grad : {true, false}) {
    expect_exact(
        {3}, true,
        [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
          torch::AutoGradMode mode(grad);
          prepare(o);
          for (int64_t i = 0; i < kBlocks; ++i) {
            TestBlock block = m.blocks[i];
            auto fn = [block, c](const variable_list& in) mutable {
              return variable_list{block->forward(in[0], in[1].defined() ? in[1] : c)};
            };
            x = o ? o->run_block(i, {x, torch::Tensor()}, fn)[0] : fn({x, torch::Tensor()})[0];
          }
          const torch::Tensor loss = x.pow(2).mean();
          if (grad) loss.backward();
          return loss;
        },
        grad ? "training" : "inference", 1);
  }
}

// Case 5: backward after the offloader is gone raises, never reads freed memory; with blocks
// of 2 MiB (where it used to crash) too.
TEST(CallPatterns, BackwardAfterDestructionRaises) {
  const Inputs in;
  for (int64_t k : {1, 3, 6}) {
    Model model(kBlocks);
    torch::Tensor loss;
    {
      ModelOffloader offloader("blocks", model.modules(), options(k, true));
      offloader.prepare_block_devices_before_forward();
      loss = forward_run_block(offloader, model, in.x, in.context).pow(2).mean();
    }
    expect_error([&] { loss.backward(); }, "backward runs after its ModelOffloader was destroyed");
  }
  torch::manual_seed(1);
  std::vector<std::shared_ptr<torch::nn::Module>> big;
  for (int i = 0; i < 4; ++i) {
    auto linear = torch::nn::Linear(1024, 512);
    linear->weight.set_requires_grad(false);
    linear->bias.set_requires_grad(false);
    big.push_back(linear.ptr());
  }
  torch::Tensor x = torch::randn({4, 1024}).requires_grad_(true);
  torch::Tensor loss;
  {
    ModelOffloader offloader("big", big, options(2, true));
    offloader.prepare_block_devices_before_forward();
    torch::Tensor h = x;
    for (int64_t i = 0; i < 4; ++i) {
      auto block = std::dynamic_pointer_cast<torch::nn::LinearImpl>(big[i]);
      h = offloader.run_block(i, {h}, [block](const variable_list& v) {
        return variable_list{block->forward(v[0]).narrow(1, 0, 512).repeat({1, 2})};
      })[0];
    }
    loss = h.sum();
  }
  expect_error([&] { loss.backward(); }, "destroyed");
}

// Without swapping (K = 0) the blocks never move: a backward after destruction still works.
TEST(CallPatterns, BackwardAfterDestructionWithoutSwappingIsExact) {
  const Inputs in;
  Model reference(kBlocks), model(kBlocks);
  reference.forward(in.x, in.context).pow(2).mean().backward();
  torch::Tensor loss;
  {
    ModelOffloader offloader("blocks", model.modules(), options(0, true));
    offloader.prepare_block_devices_before_forward();
    loss = forward_run_block(offloader, model, in.x, in.context).pow(2).mean();
  }
  loss.backward();
  for (std::size_t p = 0; p < model.lora().size(); ++p) {
    expect_bitwise(model.lora()[p].grad(), reference.lora()[p].grad(), "lora " + std::to_string(p));
  }
}

// Case 4: buffers the forward updates in place are kept across evictions and destruction.
struct CountingBlockImpl : torch::nn::Module {
  torch::nn::Linear fc{kDim, kDim};
  torch::Tensor running, calls;
  CountingBlockImpl() {
    register_module("fc", fc);
    running = register_buffer("running", torch::zeros({kDim}));
    calls = register_buffer("calls", torch::zeros({1}, torch::kLong));
    for (auto& p : parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = fc(x);
    running.mul_(0.9).add_(y.detach().mean(std::vector<int64_t>{0, 1}) * 0.1);
    calls.add_(1);
    return y + running;
  }
};
TORCH_MODULE(CountingBlock);

TEST(CallPatterns, BuffersUpdatedInForwardAreKept) {
  const Inputs in;
  auto make = [] {
    torch::manual_seed(3);
    std::vector<CountingBlock> blocks(kBlocks);
    return blocks;
  };
  std::vector<CountingBlock> reference = make();
  torch::NoGradGuard no_grad;
  torch::Tensor expected;
  for (int pass = 0; pass < 4; ++pass) {
    expected = in.x;
    for (auto& b : reference) expected = b->forward(expected);
  }
  for (bool training : {false, true}) {
    for (int64_t k : {1, 3, 6}) {
      std::vector<CountingBlock> blocks = make();
      std::vector<std::shared_ptr<torch::nn::Module>> modules;
      for (auto& b : blocks) modules.push_back(b.ptr());
      torch::Tensor out;
      {
        ModelOffloader offloader("counting", modules, options(k, training));
        for (int pass = 0; pass < 4; ++pass) {
          offloader.prepare_block_devices_before_forward();
          out = in.x;
          for (int64_t i = 0; i < kBlocks; ++i) {
            CountingBlock block = blocks[i];
            out = offloader.run_block(i, {out}, [block](const variable_list& v) mutable {
              return variable_list{block->forward(v[0])};
            })[0];
          }
        }
        const std::string what =
            std::string(training ? "training" : "inference") + " K=" + std::to_string(k);
        expect_bitwise(out, expected, what + " output");
        for (int64_t i = 0; i < kBlocks; ++i) { // while swapped: their true values
          expect_bitwise(blocks[i]->calls, reference[i]->calls, what + " calls (swapped)");
        }
      }
      for (int64_t i = 0; i < kBlocks; ++i) { // after destruction
        expect_bitwise(blocks[i]->running, reference[i]->running, "running after destruction");
        expect_bitwise(blocks[i]->calls, reference[i]->calls, "calls after destruction");
      }
    }
  }
}

// Case 8: weights loaded into the blocks while the offloader holds them, with copy_ and with
// torch::load, resident or not.
TEST(CallPatterns, WeightsLoadedWhileSwappedAreUsed) {
  torch::NoGradGuard no_grad;
  const Inputs in;
  torch::manual_seed(99);
  Model fresh(kBlocks); // the weights to load
  for (auto& b : fresh.blocks) {
    for (auto& p : b->parameters()) p.add_(torch::randn_like(p) * 0.1);
    b->scale.mul_(2);
  }
  const torch::Tensor expected = fresh.forward(in.x, in.context);
  for (bool with_load : {false, true}) {
    for (int64_t k : {1, 3, 7}) {
      Model model(kBlocks);
      torch::Tensor out;
      {
        ModelOffloader offloader("blocks", model.modules(), options(k, false));
        offloader.prepare_block_devices_before_forward();
        forward_run_block(offloader, model, in.x, in.context); // some blocks mid-rotation
        for (int64_t b = 0; b < kBlocks; ++b) {
          if (with_load) {
            std::stringstream file;
            torch::save(fresh.blocks[b], file);
            torch::load(model.blocks[b], file);
          } else {
            auto source = fresh.blocks[b]->named_parameters();
            for (auto& item : model.blocks[b]->named_parameters()) {
              item.value().copy_(source[item.key()]);
            }
            model.blocks[b]->scale.copy_(fresh.blocks[b]->scale);
          }
        }
        const std::string what =
            std::string(with_load ? "torch::load" : "copy_") + " K=" + std::to_string(k);
        for (int pass = 0; pass < 3; ++pass) {
          offloader.prepare_block_devices_before_forward();
          expect_bitwise(forward_run_block(offloader, model, in.x, in.context), expected,
                         what + " pass " + std::to_string(pass));
        }
      }
      expect_bitwise(model.forward(in.x, in.context), expected, "after destruction");
    }
  }
}

// The constructor is all or nothing: a bad tensor in a late block leaves every tensor as it
// was, claims nothing, and only blockswap::Error escapes.
TEST(CallPatterns, AFailedConstructorChangesNothing) {
  const Inputs in;
  struct Bad {
    std::string name, error;
    std::function<void(TestBlock&)> spoil;
  };
  const std::vector<Bad> cases{
      {"meta", "is a meta tensor",
       [](TestBlock& b) { b->register_buffer("extra", torch::empty({kDim}, torch::kMeta)); }},
      {"sparse", "is not a dense tensor",
       [](TestBlock& b) { b->register_buffer("extra", torch::randn({4}).to_sparse()); }},
      {"not contiguous", "is not contiguous",
       [](TestBlock& b) {
         b->register_parameter("extra", torch::randn({4, 4}).t(), /*requires_grad=*/false);
       }},
  };
  for (const Bad& bad : cases) {
    Model model(kBlocks);
    bad.spoil(model.blocks[6]);
    std::vector<std::pair<torch::Tensor, torch::Tensor>> before; // tensor, its value
    for (int64_t b = 0; b < 5; ++b) {
      for (auto& t : model.blocks[b]->parameters()) before.emplace_back(t, t.clone());
      for (auto& t : model.blocks[b]->buffers()) before.emplace_back(t, t.clone());
    }
    std::vector<const void*> data;
    for (auto& [t, v] : before) data.push_back(t.data_ptr());
    try {
      ModelOffloader offloader("blocks", model.modules(), options(3, true));
      ADD_FAILURE() << bad.name << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("of block 6 " + bad.error), std::string::npos)
          << e.what();
    }
    for (std::size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(before[i].first.data_ptr(), data[i]) << bad.name;
      expect_bitwise(before[i].first, before[i].second, bad.name + " tensor unchanged");
    }
    // Nothing stays claimed: the good blocks can be managed now.
    const auto modules = model.modules();
    const std::vector<std::shared_ptr<torch::nn::Module>> good(modules.begin(),
                                                               modules.begin() + 5);
    EXPECT_NO_THROW(ModelOffloader("blocks", good, options(2, true))) << bad.name;
  }
}

// Note [inference mode] in block_binder.cpp: a sampling pass under InferenceMode in the middle
// of training leaves the blocks' tensors usable by autograd afterwards.
TEST(CallPatterns, InferenceModePassesInTheMiddleOfTrainingAreExact) {
  expect_exact(
      {1, 3, 6}, true,
      [&](Model& m, torch::Tensor x, const torch::Tensor& c, ModelOffloader* o) {
        {
          c10::InferenceMode inference;
          if (o) o->set_forward_only(true);
          prepare(o);
          run_blocks(m, o, x.detach(), c);
          if (o) o->set_forward_only(false);
        }
        prepare(o);
        const torch::Tensor loss = run_blocks(m, o, x, c).back().pow(2).mean();
        loss.backward();
        return loss;
      },
      "InferenceMode sampling");
}

// LibTorch's batch_norm updates running statistics without bumping their version counter:
// buffers stay on the device, so nothing can drop them. Training, NoGradGuard, InferenceMode.
struct NormBlockImpl : torch::nn::Module {
  torch::nn::Linear fc{kDim, kDim};
  torch::nn::BatchNorm1d norm{kDim};
  torch::Tensor lora;
  NormBlockImpl() {
    register_module("fc", fc);
    register_module("norm", norm);
    for (auto& p : parameters()) p.set_requires_grad(false);
    lora = register_parameter("lora", torch::randn({kDim, kDim}) * 0.01);
  }
  torch::Tensor forward(const torch::Tensor& x) { return norm(fc(x) + torch::matmul(x, lora)); }
};
TORCH_MODULE(NormBlock);

TEST(CallPatterns, BatchNormRunningStatisticsAreKept) {
  auto make = [] {
    torch::manual_seed(4);
    return std::vector<NormBlock>(4);
  };
  const torch::Tensor x0 = torch::randn({16, kDim});
  enum class Mode { grad, no_grad, inference };
  for (Mode mode : {Mode::grad, Mode::no_grad, Mode::inference}) {
    auto run = [&](std::vector<NormBlock>& blocks, ModelOffloader* o) {
      for (int pass = 0; pass < 3; ++pass) {
        std::optional<torch::NoGradGuard> no_grad;
        std::optional<c10::InferenceMode> inference;
        if (mode == Mode::no_grad) no_grad.emplace();
        if (mode == Mode::inference) inference.emplace();
        prepare(o);
        torch::Tensor h = x0;
        for (int64_t i = 0; i < 4; ++i) {
          NormBlock block = blocks[i];
          auto fn = [block](const variable_list& v) mutable {
            return variable_list{block->forward(v[0])};
          };
          h = o ? o->run_block(i, {h}, fn)[0] : fn({h})[0];
        }
        if (mode == Mode::grad) h.pow(2).mean().backward();
      }
    };
    std::vector<NormBlock> reference = make(), blocks = make();
    run(reference, nullptr);
    for (int64_t k : {1, 2}) {
      blocks = make();
      std::vector<std::shared_ptr<torch::nn::Module>> modules;
      for (auto& b : blocks) modules.push_back(b.ptr());
      {
        ModelOffloader offloader("norm", modules, options(k, true));
        run(blocks, &offloader);
        for (int64_t i = 0; i < 4; ++i) {
          expect_bitwise(blocks[i]->norm->running_mean, reference[i]->norm->running_mean,
                         "running_mean while held, K=" + std::to_string(k));
        }
      }
      for (int64_t i = 0; i < 4; ++i) {
        expect_bitwise(blocks[i]->norm->running_mean, reference[i]->norm->running_mean,
                       "running_mean after destruction");
        expect_bitwise(blocks[i]->norm->running_var, reference[i]->norm->running_var,
                       "running_var after destruction");
        expect_bitwise(blocks[i]->norm->num_batches_tracked,
                       reference[i]->norm->num_batches_tracked, "num_batches_tracked");
      }
    }
  }
}

// A gradient penalty differentiates the graph that backward builds, which saves views of
// weights that no bracket covers: it raises at the first backward, before any wrong gradient.
TEST(CallPatterns, DoubleBackwardRaises) {
  const Inputs in;
  Model model(kBlocks);
  ModelOffloader offloader("blocks", model.modules(), options(3, true));
  offloader.prepare_block_devices_before_forward();
  const torch::Tensor loss = forward_run_block(offloader, model, in.x, in.context).pow(2).mean();
  expect_error(
      [&] {
        torch::autograd::grad({loss}, {model.blocks[0]->lora_a}, {}, true, /*create_graph=*/true);
      },
      "create_graph=true");
}

// An output that views the block's weights would read another block after the slot is reused.
TEST(CallPatterns, OutputsThatViewTheWeightsRaise) {
  const Inputs in;
  for (bool training : {false, true}) {
    Model model(kBlocks);
    ModelOffloader offloader("blocks", model.modules(), options(3, training));
    std::optional<torch::NoGradGuard> no_grad;
    if (!training) no_grad.emplace();
    offloader.prepare_block_devices_before_forward();
    TestBlock block = model.blocks[0];
    expect_error(
        [&] {
          offloader.run_block(0, {in.x, in.context}, [block](const variable_list& v) mutable {
            return variable_list{block->forward(v[0], v[1]), block->fc1->weight.t()};
          });
        },
        "output 1 of block 0 is a view of the block's own weights");
  }
}

// Checkpointing only some blocks with reentrant_activation_checkpointing = true: the blocks
// run with grad mode on are computed normally, the checkpointed ones recomputed.
TEST(CallPatterns, CheckpointingEveryOtherBlockIsExact) {
  const Inputs in;
  Model reference(kBlocks);
  torch::Tensor xr = in.x.clone().requires_grad_(true);
  const torch::Tensor expected = reference.forward(xr, in.context).pow(2).mean();
  expected.backward();
  for (int64_t k : {1, 3, 6}) {
    Model model(kBlocks);
    Options o = options(k, true);
    o.reentrant_activation_checkpointing = true;
    ModelOffloader offloader("blocks", model.modules(), o);
    for (int step = 0; step < 2; ++step) {
      offloader.prepare_block_devices_before_forward();
      torch::Tensor x = in.x.clone().requires_grad_(true);
      torch::Tensor h = x;
      for (int64_t i = 0; i < kBlocks; ++i) {
        h = i % 2 == 0 ? Checkpoint::apply(h, in.context, &offloader, i, &model)[0]
                       : offloader.run_block(i, {h, in.context}, model.fn(i))[0];
      }
      const torch::Tensor loss = h.pow(2).mean();
      loss.backward();
      const std::string what = "K=" + std::to_string(k) + " step " + std::to_string(step);
      expect_bitwise(loss, expected, what + " loss");
      expect_bitwise(x.grad(), xr.grad(), what + " x");
      for (std::size_t p = 0; p < model.lora().size(); ++p) {
        expect_bitwise(model.lora()[p].grad(), reference.lora()[p].grad(), what + " lora");
        model.lora()[p].mutable_grad().zero_();
      }
    }
  }
}

TEST(CallPatterns, AFrozenWeightMadeTrainableLaterRaises) {
  Model model(kBlocks);
  ModelOffloader offloader("blocks", model.modules(), options(3, true));
  model.blocks[2]->fc1->weight.set_requires_grad(true);
  expect_error([&] { offloader.prepare_block_devices_before_forward(); },
               "parameter 'fc1.weight' of block 2 was made trainable after the ModelOffloader "
               "was built");
}

TEST(CallPatterns, KOutOfRangeInTrainingIsATrainingError) {
  Model model(kBlocks);
  for (int64_t k : {8, 20}) {
    expect_error([&] { ModelOffloader("blocks", model.modules(), options(k, true)); },
                 "K=" + std::to_string(k) +
                     " is out of range for N=8 blocks in training mode: expected 0 <= K <= 7");
  }
}

TEST(CallPatterns, ASkippedBlockIsSubmittedWithoutItsWait) {
  // musubi-tuner's skip-layer guidance: a block neither waited for nor run, but submitted.
  torch::NoGradGuard no_grad;
  const Inputs in;
  Model model(kBlocks), reference(kBlocks);
  Options o = options(3, false);
  o.strict_residency = true;
  ModelOffloader offloader("blocks", model.modules(), o);
  for (const std::set<int64_t>& skip : {std::set<int64_t>{3}, {0, 5}, {}, {1, 2, 3, 4}}) {
    offloader.prepare_block_devices_before_forward();
    torch::Tensor x = in.x, expected = in.x;
    for (int64_t i = 0; i < kBlocks; ++i) {
      if (!skip.contains(i)) {
        offloader.wait_for_block(i);
        x = model.blocks[i]->forward(x, in.context);
        expected = reference.blocks[i]->forward(expected, in.context);
      }
      offloader.submit_move_blocks_forward(i);
    }
    EXPECT_TRUE(torch::equal(x, expected)) << skip.size();
  }
}

} // namespace
} // namespace blockswap
