// The test model of the LibTorch front end's tests: a small transformer-like block with frozen
// weights, a buffer and a LoRA adapter, run with and without a ModelOffloader; and the
// comparisons the tests make (bitwise, on CPU).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/torch.hpp"

namespace blockswap {
namespace {

using torch::autograd::variable_list;

#ifdef BLOCKSWAP_TEST_CUDA
const torch::Device kDevice(torch::kCUDA, 0);
#else
const torch::Device kDevice(torch::kCPU);
#endif

constexpr int64_t kDim = 32;
constexpr int64_t kRank = 4;

// A small transformer-like block with a context input, a buffer, frozen weights and a LoRA
// adapter on fc1.
struct TestBlockImpl : torch::nn::Module {
  torch::nn::LayerNorm norm{torch::nn::LayerNormOptions({kDim})};
  torch::nn::Linear fc1{kDim, 2 * kDim}, fc2{2 * kDim, kDim}, context_proj{kDim, kDim};
  torch::Tensor scale, lora_a, lora_b;

  TestBlockImpl() {
    register_module("norm", norm);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("context_proj", context_proj);
    scale = register_buffer("scale", torch::rand({kDim}) + 0.5);
    for (auto& p : parameters()) p.set_requires_grad(false);
    lora_a = register_parameter("lora_a", torch::randn({kRank, kDim}) * 0.1);
    lora_b = register_parameter("lora_b", torch::randn({2 * kDim, kRank}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context) {
    auto y = norm(x) * scale + context_proj(context);
    auto z = fc1(y) + torch::matmul(torch::matmul(y, lora_a.t()), lora_b.t());
    return x + fc2(torch::gelu(z));
  }
};
TORCH_MODULE(TestBlock);

struct Model {
  std::vector<TestBlock> blocks;
  explicit Model(int64_t n) {
    torch::manual_seed(7);
    for (int64_t i = 0; i < n; ++i) {
      blocks.emplace_back();
      blocks.back()->to(kDevice);
    }
  }
  std::vector<std::shared_ptr<torch::nn::Module>> modules() const {
    std::vector<std::shared_ptr<torch::nn::Module>> out;
    for (const auto& b : blocks) out.push_back(b.ptr());
    return out;
  }
  std::vector<torch::Tensor> lora() const {
    std::vector<torch::Tensor> out;
    for (const auto& b : blocks) {
      out.push_back(b->lora_a);
      out.push_back(b->lora_b);
    }
    return out;
  }
  BlockFn fn(int64_t i) const {
    TestBlock block = blocks[i];
    return [block](const variable_list& in) mutable {
      return variable_list{block->forward(in[0], in[1])};
    };
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& context) {
    for (auto& b : blocks) x = b->forward(x, context);
    return x;
  }
};

// `batch` sequences of `tokens` tokens: a hidden state and a context.
struct Inputs {
  torch::Tensor x, context;
  explicit Inputs(int64_t batch = 2, int64_t tokens = 5) {
    static std::mutex seeding; // torch's generator is the process's (ranks as threads)
    std::lock_guard lock(seeding);
    torch::manual_seed(11);
    x = torch::randn({batch, tokens, kDim}).to(kDevice);
    context = torch::randn({batch, tokens, kDim}).to(kDevice);
  }
};

[[maybe_unused]] torch::Tensor forward_run_block(ModelOffloader& offloader, Model& model,
                                                 torch::Tensor x, const torch::Tensor& context) {
  for (int64_t i = 0; i < int64_t(model.blocks.size()); ++i) {
    x = offloader.run_block(i, {x, context}, model.fn(i))[0];
  }
  return x;
}

[[maybe_unused]] torch::Tensor forward_manual(ModelOffloader& offloader, Model& model,
                                              torch::Tensor x, const torch::Tensor& context) {
  for (int64_t i = 0; i < int64_t(model.blocks.size()); ++i) {
    offloader.wait_for_block(i);
    x = model.blocks[i]->forward(x, context);
    offloader.submit_move_blocks_forward(i);
  }
  return x;
}

[[maybe_unused]] void expect_bitwise(const torch::Tensor& a, const torch::Tensor& b,
                                     const std::string& what) {
  ASSERT_TRUE(a.defined() && b.defined()) << what;
  const torch::Tensor x = a.cpu(), y = b.cpu();
  EXPECT_TRUE(torch::equal(x, y)) << what << ": max diff " << (x - y).abs().max().item<double>();
}

[[maybe_unused]] Options options(int64_t k, bool training) {
  Options o;
  o.blocks_to_swap = k;
  o.supports_backward = training;
  o.device = kDevice;
  return o;
}

// LoRA-style training: frozen base weights swapped, adapters trained with SGD.
struct TrainingRun {
  Model model;
  std::vector<torch::Tensor> losses, x_grads;
  std::vector<std::vector<torch::Tensor>> lora_grads;

  explicit TrainingRun(int64_t n) : model(n) {}

  template <typename Forward> void run(int steps, Forward&& forward, const Inputs& in = Inputs()) {
    for (int step = 0; step < steps; ++step) {
      torch::Tensor x = in.x.clone().requires_grad_(true);
      const torch::Tensor loss = forward(x, in.context).pow(2).mean();
      loss.backward();
      losses.push_back(loss.detach());
      x_grads.push_back(x.grad());
      std::vector<torch::Tensor> grads;
      torch::NoGradGuard no_grad;
      for (auto& p : model.lora()) {
        grads.push_back(p.grad().clone());
        p.sub_(p.grad() * 0.5);
        p.mutable_grad().zero_();
      }
      lora_grads.push_back(grads);
    }
  }
};

[[maybe_unused]] void expect_same_training(const TrainingRun& a, const TrainingRun& b,
                                           const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (std::size_t s = 0; s < a.losses.size(); ++s) {
    const std::string at = what + " step " + std::to_string(s);
    expect_bitwise(a.losses[s], b.losses[s], at + " loss");
    expect_bitwise(a.x_grads[s], b.x_grads[s], at + " input grad");
    for (std::size_t p = 0; p < a.lora_grads[s].size(); ++p) {
      expect_bitwise(a.lora_grads[s][p], b.lora_grads[s][p],
                     at + " lora grad " + std::to_string(p));
    }
  }
}

[[maybe_unused]] void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << part << "'";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// The caller's own reentrant checkpointing: forward without a graph, recompute in backward.
struct Checkpoint : torch::autograd::Function<Checkpoint> {
  static variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               torch::Tensor context, ModelOffloader* offloader, int64_t block,
                               Model* model) {
    ctx->save_for_backward({x, context});
    ctx->saved_data["block"] = block;
    ctx->saved_data["offloader"] = reinterpret_cast<int64_t>(offloader);
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    return offloader->run_block(block, {x, context}, model->fn(block));
  }
  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    auto* offloader = reinterpret_cast<ModelOffloader*>(ctx->saved_data["offloader"].toInt());
    auto* model = reinterpret_cast<Model*>(ctx->saved_data["model"].toInt());
    const int64_t block = ctx->saved_data["block"].toInt();
    auto saved = ctx->get_saved_variables();
    torch::Tensor x = saved[0].detach().requires_grad_(true);
    torch::Tensor out;
    {
      torch::AutoGradMode grad(true); // the recompute pass: the verbs must do nothing
      offloader->wait_for_block(block);
      out = offloader->run_block(block, {x, saved[1]}, model->fn(block))[0];
      offloader->submit_move_blocks_forward(block);
    }
    torch::autograd::backward({out}, {grads[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

} // namespace
} // namespace blockswap
