// Written only from the public contract (DESIGN.md section 4): inference and LoRA training
// through ModelOffloader equal the same model without it, and a training step's stats.
#include <blockswap/torch.hpp>
#include <torch/torch.h>

#include <cstdio>

namespace {

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear base{16, 16};
  torch::Tensor lora;
  BlockImpl() {
    register_module("base", base);
    for (auto& p : parameters()) p.set_requires_grad(false);
    lora = register_parameter("lora", torch::randn({16, 16}) * 0.01);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + torch::tanh(base(x) + x.matmul(lora));
  }
};
TORCH_MODULE(Block);

struct Model {
  std::vector<Block> blocks;
  Model() {
    torch::manual_seed(1);
    for (int i = 0; i < 8; ++i) blocks.emplace_back();
  }
  std::vector<std::shared_ptr<torch::nn::Module>> modules() {
    std::vector<std::shared_ptr<torch::nn::Module>> out;
    for (auto& b : blocks) out.push_back(b.ptr());
    return out;
  }
};

int failures = 0;
void check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  failures += ok ? 0 : 1;
}

} // namespace

int main() {
  const torch::Tensor input = torch::randn({4, 16});

  // Inference with the seed's manual loop.
  {
    torch::NoGradGuard no_grad;
    Model reference, model;
    torch::Tensor expected = input;
    for (auto& b : reference.blocks) expected = b->forward(expected);
    blockswap::Options options;
    options.blocks_to_swap = 3;
    blockswap::ModelOffloader offloader("blocks", model.modules(), options);
    bool equal = true;
    for (int pass = 0; pass < 3; ++pass) {
      offloader.prepare_block_devices_before_forward();
      torch::Tensor x = input;
      for (int64_t i = 0; i < 8; ++i) {
        offloader.wait_for_block(i);
        x = model.blocks[i]->forward(x);
        offloader.submit_move_blocks_forward(i);
      }
      equal = equal && torch::equal(x, expected);
    }
    check(equal, "inference equals the unswapped model bitwise");
  }

  // LoRA training with run_block: loss and adapter gradients over three SGD steps.
  {
    Model reference, model;
    blockswap::Options options;
    options.blocks_to_swap = 3;
    options.supports_backward = true;
    blockswap::ModelOffloader offloader("blocks", model.modules(), options);
    bool equal = true;
    for (int step = 0; step < 3; ++step) {
      torch::Tensor x = input, y = input;
      for (auto& b : reference.blocks) x = b->forward(x);
      offloader.prepare_block_devices_before_forward();
      if (step == 0) offloader.reset_stats();
      for (int64_t i = 0; i < 8; ++i) {
        Block block = model.blocks[i];
        y = offloader.run_block(i, {y}, [block](const torch::autograd::variable_list& in) mutable {
          return torch::autograd::variable_list{block->forward(in[0])};
        })[0];
      }
      const torch::Tensor loss_ref = x.pow(2).mean(), loss = y.pow(2).mean();
      loss_ref.backward();
      loss.backward();
      equal = equal && torch::equal(loss_ref, loss);
      if (step == 0) {
        const blockswap::Stats stats = offloader.stats();
        const uint64_t block_bytes = (16 * 16 + 16) * sizeof(float); // weight + bias
        check(stats.moves == 6, "a training step with N=8, K=3 makes 6 moves");
        check(stats.h2d_bytes % 6 == 0 && stats.h2d_bytes / 6 >= block_bytes &&
                  stats.h2d_bytes / 6 < block_bytes + 512,
              "h2d_bytes is 6 blocks' bytes");
        check(stats.d2h_bytes == 0, "d2h_bytes is 0");
        check(stats.peak_device_bytes <= 5 * (block_bytes + 512), "peak within the 5 slots");
      }
      torch::NoGradGuard no_grad;
      for (std::size_t b = 0; b < 8; ++b) {
        equal =
            equal && torch::equal(reference.blocks[b]->lora.grad(), model.blocks[b]->lora.grad());
        for (auto* m : {&reference, &model}) {
          auto& p = m->blocks[b]->lora;
          p.sub_(p.grad() * 0.1);
          p.mutable_grad().zero_();
        }
      }
    }
    check(equal, "LoRA training equals the unswapped model bitwise");
  }

  // Two block lists on one shared device, planned together (docs/guide.md).
  {
    torch::NoGradGuard no_grad;
    Model first, second, reference_first, reference_second;
    const std::size_t slot = (16 * 16 + 16) * sizeof(float) + 512; // over one aligned block
    const blockswap::SwapPlan plan = blockswap::plan_block_lists(
        {first.modules(), second.modules()}, 6 * slot, blockswap::Mode::forward_only);
    auto device = blockswap::open_device(torch::kCPU, {.budget_bytes = 6 * slot});
    blockswap::Options options;
    options.shared_device = device;
    options.blocks_to_swap = plan.lists[0].blocks_to_swap;
    blockswap::ModelOffloader a("double_blocks", first.modules(), options);
    options.blocks_to_swap = plan.lists[1].blocks_to_swap;
    blockswap::ModelOffloader b("single_blocks", second.modules(), options);
    torch::Tensor expected = input, x = input;
    for (auto* m : {&reference_first, &reference_second})
      for (auto& block : m->blocks) expected = block->forward(expected);
    a.prepare_block_devices_before_forward();
    b.prepare_block_devices_before_forward();
    for (auto [offloader, model] : {std::pair{&a, &first}, std::pair{&b, &second}}) {
      for (int64_t i = 0; i < 8; ++i) {
        offloader->wait_for_block(i);
        x = model->blocks[i]->forward(x);
        offloader->submit_move_blocks_forward(i);
      }
    }
    check(torch::equal(x, expected), "two lists on one device equal the unswapped model");
    check(device->memory().peak_device_bytes == plan.device_bytes,
          "the device holds what the plan says");
  }
  return failures == 0 ? 0 : 1;
}
