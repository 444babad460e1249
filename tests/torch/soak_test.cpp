// Soak: 10,000 steps mixing inference and LoRA training, with swapping disabled and enabled
// and forward-only flipped along the way. Every step must equal the unswapped model bitwise,
// memory must not grow, and the whole run must finish in bounded time.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <fstream>

#include "blockswap/torch.hpp"

namespace blockswap {
namespace {

using torch::autograd::variable_list;

struct SmallBlockImpl : torch::nn::Module {
  torch::nn::Linear fc{8, 8};
  torch::Tensor lora;
  SmallBlockImpl() {
    register_module("fc", fc);
    for (auto& p : parameters()) p.set_requires_grad(false);
    lora = register_parameter("lora", torch::randn({8, 8}) * 0.05);
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(fc(x) + x.matmul(lora)); }
};
TORCH_MODULE(SmallBlock);

struct Model {
  std::vector<SmallBlock> blocks;
  explicit Model(int n) {
    torch::manual_seed(3);
    for (int i = 0; i < n; ++i) blocks.emplace_back();
  }
};

std::size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

TEST(Soak, TenThousandMixedStepsStayExactWithoutGrowing) {
  constexpr int kSteps = 10'000, kBlocks = 4;
  const auto start = std::chrono::steady_clock::now();
  Model reference(kBlocks), model(kBlocks);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (auto& b : model.blocks) modules.push_back(b.ptr());
  Options options;
  options.blocks_to_swap = 2;
  options.supports_backward = true;
  ModelOffloader offloader("blocks", modules, options);
  const torch::Tensor input = torch::randn({3, 8});

  std::size_t rss_early = 0;
  int mismatches = 0;
  for (int step = 0; step < kSteps; ++step) {
    const bool train = step % 3 != 0;
    if (step % 7 == 0) offloader.disable_block_swap();
    if (step % 7 == 3) offloader.enable_block_swap();
    offloader.set_forward_only(!train);
    offloader.prepare_block_devices_before_forward();

    torch::AutoGradMode grad(train);
    torch::Tensor expected = input, got = input;
    for (auto& b : reference.blocks) expected = b->forward(expected);
    for (int64_t i = 0; i < kBlocks; ++i) {
      got = offloader.run_block(i, {got}, [b = model.blocks[i]](const variable_list& in) mutable {
        return variable_list{b->forward(in[0])};
      })[0];
    }
    mismatches += !torch::equal(expected, got);
    if (train) {
      expected.pow(2).mean().backward();
      got.pow(2).mean().backward();
      torch::NoGradGuard no_grad;
      for (int b = 0; b < kBlocks; ++b) {
        auto& r = reference.blocks[b]->lora;
        auto& m = model.blocks[b]->lora;
        mismatches += !torch::equal(r.grad(), m.grad());
        r.sub_(r.grad() * 1e-3);
        m.sub_(m.grad() * 1e-3);
        r.mutable_grad().zero_();
        m.mutable_grad().zero_();
      }
    }
    if (step == 1000) rss_early = resident_bytes();
  }
  offloader.synchronize();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(mismatches, 0);
#ifndef __SANITIZE_ADDRESS__
  // (AddressSanitizer keeps freed memory in quarantine; its leak checker covers that build.)
  EXPECT_LT(resident_bytes(), rss_early + (16u << 20)) << "memory grew during the soak";
#endif
  EXPECT_LT(seconds, 240.0) << "10,000 small steps should take seconds";
  RecordProperty("seconds", std::to_string(seconds));
}

} // namespace
} // namespace blockswap
