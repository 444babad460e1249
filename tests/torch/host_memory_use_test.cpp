// Host memory at exactly what is kept there (Note [exact host memory] in
// src/device/host_memory.cpp): for inference, LoRA training and full fine-tuning with offloaded
// activations, every page-locked buffer blockswap makes is counted by the Device, and it locks
// at most 1.05 bytes per byte it holds. The counts are checked against what must be held, so
// that a buffer made elsewhere (torch's caching pinned allocator, which rounds up to powers of
// two) fails the test by going uncounted.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "blockswap/device/device.hpp"
#include "blockswap/torch.hpp"

namespace blockswap {
namespace {

#ifdef BLOCKSWAP_TEST_CUDA
const torch::Device kDevice(torch::kCUDA, 0);
#else
const torch::Device kDevice(torch::kCPU);
#endif

// Blocks of a real shape at a small width: 2 MiB of frozen weights, a LoRA adapter on fc1, and
// saved activations of 256 KiB and more for 64 tokens.
constexpr int64_t kHidden = 256, kTokens = 64, kRank = 8, kBlocks = 6;

struct MlpBlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{kHidden, 4 * kHidden}, fc2{4 * kHidden, kHidden};
  torch::Tensor lora_a, lora_b;
  // `trained`: every weight trains (full fine-tuning); else the weights are frozen, and with
  // `lora` an adapter trains.
  MlpBlockImpl(bool trained, bool lora) {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    if (trained) return;
    for (auto& p : parameters()) p.set_requires_grad(false);
    if (!lora) return;
    lora_a = register_parameter("lora_a", torch::randn({kRank, kHidden}) * 0.05);
    lora_b = register_parameter("lora_b", torch::randn({4 * kHidden, kRank}) * 0.05);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = fc1(x);
    if (lora_a.defined()) h = h + torch::matmul(torch::matmul(x, lora_a.t()), lora_b.t());
    return x + fc2(torch::gelu(h));
  }
};
TORCH_MODULE(MlpBlock);

enum class Mode { inference, lora, finetune };

std::string name(Mode mode) {
  return mode == Mode::inference ? "inference" : mode == Mode::lora ? "LoRA" : "fine-tuning";
}

struct Measured {
  HostMemoryStats host;
  TransferStats activations;
  std::size_t weight_bytes = 0, trainable_bytes = 0;
  std::size_t pinned_after_second_step = 0;
  std::vector<torch::Tensor> outputs;
};

// Three steps of `mode` with K = 3 of 6 blocks swapped; with `offloader` false, the model run
// plainly (the reference).
Measured run(Mode mode, bool offloader) {
  torch::manual_seed(3);
  torch::nn::ModuleList blocks;
  for (int64_t i = 0; i < kBlocks; ++i)
    blocks->push_back(MlpBlock(mode == Mode::finetune, mode == Mode::lora));
  blocks->to(kDevice);
  Measured out;
  for (const auto& p : blocks->parameters()) { // an adapter (LoRA) stays on the device
    const std::size_t bytes = p.numel() * p.element_size();
    if (mode == Mode::finetune || !p.requires_grad()) out.weight_bytes += bytes;
    if (mode == Mode::finetune) out.trainable_bytes += bytes;
  }
  Options options;
  options.blocks_to_swap = 3;
  options.device = kDevice;
  options.shared_device = Device::open(kDevice.is_cuda() ? "cuda" : "emulated");
  options.supports_backward = mode != Mode::inference;
  options.offload_activations = mode != Mode::inference;
  options.activation_threshold_bytes = 64 << 10;
  if (mode == Mode::finetune) {
    options.optimizer = FusedAdamW{1e-3};
    options.step_on = StepOn::host;
  }
  std::unique_ptr<ModelOffloader> swapper;
  if (offloader) swapper = std::make_unique<ModelOffloader>("blocks", blocks, options);
  torch::manual_seed(5);
  const torch::Tensor input = torch::randn({2, kTokens, kHidden}).to(kDevice);
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor x0 = input.clone().requires_grad_(mode != Mode::inference);
    torch::Tensor x = x0;
    const std::optional<torch::NoGradGuard> no_grad =
        mode == Mode::inference ? std::optional<torch::NoGradGuard>(std::in_place) : std::nullopt;
    if (swapper) swapper->prepare_block_devices_before_forward();
    for (int64_t i = 0; i < kBlocks; ++i) {
      auto block = blocks[i]->as<MlpBlockImpl>();
      if (swapper) {
        x = swapper->run_block(i, {x}, [block](const std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{block->forward(in[0])};
        })[0];
      } else {
        x = block->forward(x);
      }
    }
    out.outputs.push_back(x.detach().cpu());
    if (mode != Mode::inference) {
      x.pow(2).mean().backward();
      out.outputs.push_back(x0.grad().cpu());
    }
    if (mode == Mode::lora) {
      torch::NoGradGuard no_grad_step;
      for (auto& p : blocks->parameters()) {
        if (!p.requires_grad() || !p.grad().defined()) continue;
        out.outputs.push_back(p.grad().cpu());
        p.sub_(p.grad() * 0.1);
        p.mutable_grad().zero_();
      }
    }
    if (step == 1) out.pinned_after_second_step = options.shared_device->host_memory().pinned_bytes;
  }
  if (swapper) swapper->synchronize();
  out.host = options.shared_device->host_memory();
  out.activations = options.shared_device->transfers();
  if (mode == Mode::finetune) {
    std::vector<torch::Tensor> trained; // the weights the host steps changed, read back
    for (const auto& p : blocks->parameters()) trained.push_back(p.detach().cpu().clone());
    out.outputs.insert(out.outputs.end(), trained.begin(), trained.end());
  }
  return out;
}

class HostMemoryUse : public ::testing::TestWithParam<Mode> {};

TEST_P(HostMemoryUse, LocksAtMostFivePercentOverWhatItKeepsAndCountsAllOfIt) {
  const Mode mode = GetParam();
  const Measured m = run(mode, /*offloader=*/true);
  const std::string what = name(mode);
  // Exact, and it moved: the host copies and the activations really were used.
  if (mode != Mode::finetune) {
    const Measured plain = run(mode, /*offloader=*/false);
    ASSERT_EQ(plain.outputs.size(), m.outputs.size()) << what;
    for (std::size_t i = 0; i < m.outputs.size(); ++i)
      EXPECT_TRUE(torch::equal(plain.outputs[i], m.outputs[i])) << what << " output " << i;
  }
  if (mode != Mode::inference) EXPECT_GT(m.activations.bytes_d2h, 0u) << what;

  // What must be kept: every block's host copy (its weights; fine-tuning also AdamW's two
  // moments in the block), the offloaded activations at their peak, and fine-tuning's gradients
  // and state on the host.
  std::size_t must_keep = m.weight_bytes;
  if (mode == Mode::finetune) must_keep += 3 * m.trainable_bytes; // gradient, exp_avg, exp_avg_sq
  must_keep += m.activations.peak_host_bytes;
  EXPECT_GE(m.host.peak_kept_bytes, must_keep) << what << ": a host buffer went uncounted";
  EXPECT_GT(m.host.peak_pinned_bytes, 0u) << what;
  EXPECT_LE(m.host.pinned_per_kept(), 1.05)
      << what << ": " << m.host.peak_pinned_bytes << " bytes locked for " << m.host.peak_kept_bytes;
  EXPECT_GE(m.host.pinned_per_kept(), 1.0) << what;
  EXPECT_EQ(m.host.pageable_bytes, 0u) << what;
  // The third step locked nothing new: the activations' buffers were the second step's.
  EXPECT_EQ(m.host.pinned_bytes, m.pinned_after_second_step) << what;
}

INSTANTIATE_TEST_SUITE_P(EveryMode, HostMemoryUse,
                         ::testing::Values(Mode::inference, Mode::lora, Mode::finetune),
                         [](const auto& info) {
                           return std::string(info.param == Mode::inference ? "Inference"
                                              : info.param == Mode::lora    ? "Lora"
                                                                            : "FineTuning");
                         });

} // namespace
} // namespace blockswap
