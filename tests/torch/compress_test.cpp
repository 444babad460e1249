// Options::compress (docs/guide.md, "Compressed weights"): every mode is bitwise the run without
// blockswap with compression on as with it off: inference (float32 and bfloat16 weights), LoRA
// training, full fine-tuning (the trainable bytes raw, the frozen ones compressed), offloaded
// activations and the file tier (the blocks in host memory compressed, the file's raw). Off the
// device a compressed block's frozen tensors have no elements; close() gives them their values
// back; a change to one is an Error; the host memory saved is real.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/torch.hpp"
#include "reference_transformer.hpp"
#include "test_model.hpp"

namespace blockswap {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kBlocks = 6;
constexpr int kSteps = 3;

enum class Work { inference, inference_bf16, lora, fine_tune, activations, file_tier };

const char* work_name(Work work) {
  switch (work) {
  case Work::inference:
    return "inference";
  case Work::inference_bf16:
    return "inference_bf16";
  case Work::lora:
    return "lora";
  case Work::fine_tune:
    return "fine_tune";
  case Work::activations:
    return "activations";
  case Work::file_tier:
    return "file_tier";
  }
  return "?";
}

std::vector<torch::Tensor> all_parameters(const Model& model) {
  std::vector<torch::Tensor> out;
  for (const auto& block : model.blocks) {
    for (const auto& p : block->parameters()) out.push_back(p.detach().cpu().clone());
  }
  return out;
}

void expect_same_parameters(const std::vector<torch::Tensor>& a,
                            const std::vector<torch::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i) {
    expect_bitwise(a[i], b[i], what + " parameter " + std::to_string(i));
  }
}

// Checks after each run with compression on: blocks were compressed, and host memory shrank.
void expect_compressed(const ModelOffloader& offloader, bool compress, double least_ratio) {
  const CompressionStats stats = offloader.compression();
  if (!compress) {
    EXPECT_EQ(stats.blocks, 0);
    return;
  }
  EXPECT_GT(stats.blocks, 0);
  EXPECT_GT(stats.ratio(), least_ratio);
  EXPECT_GT(offloader.stats().decoded_bytes, 0u);
}

class Compressed : public ::testing::TestWithParam<std::tuple<Work, bool>> {
protected:
  Work work() const { return std::get<0>(GetParam()); }
  bool compress() const { return std::get<1>(GetParam()); }
  Options with_compress(Options o) const {
    o.compress = compress() ? Compress::on : Compress::off;
    return o;
  }

  void inference(bool bf16) {
    Model reference(kBlocks), model(kBlocks);
    if (bf16) {
      for (auto& b : reference.blocks) b->to(torch::kBFloat16);
      for (auto& b : model.blocks) b->to(torch::kBFloat16);
    }
    const std::vector<torch::Tensor> before = all_parameters(model);
    Inputs in;
    if (bf16) {
      in.x = in.x.to(torch::kBFloat16);
      in.context = in.context.to(torch::kBFloat16);
    }
    torch::NoGradGuard no_grad;
    const torch::Tensor expected = reference.forward(in.x, in.context);
    {
      ModelOffloader offloader("blocks", model.modules(), with_compress(options(3, false)));
      for (int pass = 0; pass < kSteps; ++pass) {
        offloader.prepare_block_devices_before_forward();
        expect_bitwise(forward_run_block(offloader, model, in.x, in.context), expected,
                       "pass " + std::to_string(pass));
      }
      expect_compressed(offloader, compress(), bf16 ? 1.2 : 1.05);
    }
    expect_same_parameters(before, all_parameters(model), "after close");
  }

  void lora(bool offload_activations) {
    TrainingRun reference(kBlocks), swapped(kBlocks);
    reference.run(kSteps, [&](const torch::Tensor& x, const torch::Tensor& context) {
      return reference.model.forward(x, context);
    });
    Options o = with_compress(options(2, true));
    o.offload_activations = offload_activations;
    ModelOffloader offloader("blocks", swapped.model.modules(), o);
    swapped.run(kSteps, [&](const torch::Tensor& x, const torch::Tensor& context) {
      offloader.prepare_block_devices_before_forward();
      return forward_run_block(offloader, swapped.model, x, context);
    });
    expect_same_training(reference, swapped, work_name(work()));
    expect_compressed(offloader, compress(), 1.05);
  }

  void fine_tune() {
    auto trainable_model = [] {
      Model model(kBlocks);
      for (auto& block : model.blocks) {
        for (auto& p : block->fc1->parameters()) p.set_requires_grad(true);
      }
      return model;
    };
    auto trainable = [](const Model& model) {
      std::vector<torch::Tensor> out;
      for (const auto& b : model.blocks) {
        for (const auto& p : b->parameters()) {
          if (p.requires_grad()) out.push_back(p);
        }
      }
      return out;
    };
    const Inputs in;
    Model reference = trainable_model();
    torch::optim::SGD sgd(trainable(reference), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<torch::Tensor> expected_losses;
    for (int step = 0; step < kSteps; ++step) {
      const torch::Tensor loss = reference.forward(in.x, in.context).pow(2).mean();
      loss.backward();
      expected_losses.push_back(loss.detach());
      sgd.step();
      for (auto& p : trainable(reference)) p.mutable_grad().reset();
    }
    Model model = trainable_model();
    {
      Options o = with_compress(options(2, true));
      FusedSGD fused;
      fused.lr = 0.05;
      fused.momentum = 0.9;
      o.optimizer = fused;
      o.step_on = StepOn::device;
      ModelOffloader offloader("blocks", model.modules(), o);
      for (int step = 0; step < kSteps; ++step) {
        offloader.prepare_block_devices_before_forward();
        const torch::Tensor loss =
            forward_run_block(offloader, model, in.x, in.context).pow(2).mean();
        loss.backward();
        expect_bitwise(loss, expected_losses[step], "loss " + std::to_string(step));
      }
      expect_compressed(offloader, compress(), 1.05);
    }
    expect_same_parameters(all_parameters(reference), all_parameters(model), "after close");
  }

  void file_tier() {
    using models::ReferenceTransformer;
    constexpr models::TransformerConfig kConfig{kBlocks, 32, 4, 4, 0};
    const fs::path dir =
        fs::temp_directory_path() / ("blockswap-compress-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    const std::string path = (dir / "model.safetensors").string();
    ReferenceTransformer(kConfig).save(path);
    ReferenceTransformer reference(kConfig), model = ReferenceTransformer::load_frozen_empty(path);
    for (auto& block : reference.blocks()) block->to(kDevice);
    torch::NoGradGuard no_grad;
    const torch::Tensor x = reference.example_input(2, 5).to(kDevice);
    torch::Tensor expected = x;
    for (auto& block : reference.blocks()) expected = block->forward(expected);
    {
      Options o = with_compress(options(3, false));
      o.weights_file = path;
      o.weights_from_file = true; // built empty: the frozen weights are the file's
      o.host_budget_bytes = 2 * model.frozen_bytes() / kBlocks; // two blocks in host memory
      ModelOffloader offloader("blocks", model.modules(), o);
      for (int pass = 0; pass < kSteps; ++pass) {
        offloader.prepare_block_devices_before_forward();
        torch::Tensor y = x;
        for (int64_t i = 0; i < kBlocks; ++i) {
          y = offloader.run_block(i, {y}, [&, i](const torch::autograd::variable_list& in) {
            return torch::autograd::variable_list{model.blocks()[i]->forward(in[0])};
          })[0];
        }
        expect_bitwise(y, expected, "file tier pass " + std::to_string(pass));
      }
      int64_t in_file = 0;
      for (int64_t b = 0; b < kBlocks; ++b) in_file += offloader.is_in_file(b) ? 1 : 0;
      EXPECT_GT(in_file, 0);
      if (compress()) { // the blocks in host memory, not the file's
        EXPECT_GT(offloader.compression().blocks, 0);
        EXPECT_LE(offloader.compression().blocks, kBlocks - in_file);
      }
    }
    fs::remove_all(dir);
  }
};

TEST_P(Compressed, IsBitwiseTheRunWithoutBlockswap) {
  switch (work()) {
  case Work::inference:
    inference(false);
    break;
  case Work::inference_bf16:
    inference(true);
    break;
  case Work::lora:
    lora(false);
    break;
  case Work::activations:
    lora(true);
    break;
  case Work::fine_tune:
    fine_tune();
    break;
  case Work::file_tier:
    file_tier();
    break;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryMode, Compressed,
                         ::testing::Combine(::testing::Values(Work::inference, Work::inference_bf16,
                                                              Work::lora, Work::fine_tune,
                                                              Work::activations, Work::file_tier),
                                            ::testing::Bool()),
                         [](const auto& test) {
                           return std::string(work_name(std::get<0>(test.param))) +
                                  (std::get<1>(test.param) ? "_compressed" : "_raw");
                         });

// Note [compressed frozen views]: off the device a compressed block's frozen tensors have no
// elements; close() gives them their values. Note [changed compressed weights]: a tensor
// assigned whole is encoded again and kept; a write into the tensor with no elements did
// nothing and says so at the next pass, after which the offloader goes on with the true weights.
TEST(Compress, FrozenTensorsOffTheDeviceAreEmptyUntilClose) {
  Model model(kBlocks);
  for (auto& b : model.blocks) b->to(torch::kBFloat16);
  const std::vector<torch::Tensor> before = all_parameters(model);
  Options o = options(3, false);
  o.compress = Compress::on;
  int64_t off = 0;
  const torch::Tensor assigned = torch::full({2 * kDim, kDim}, 0.5, torch::kBFloat16);
  {
    ModelOffloader offloader("blocks", model.modules(), o);
    offloader.prepare_block_devices_before_forward();
    while (offloader.is_resident(off)) ++off;
    ASSERT_GT(offloader.compression().blocks, 0);
    EXPECT_EQ(model.blocks[off]->fc1->weight.numel(), 0);
    EXPECT_EQ(model.blocks[off]->fc1->bias.numel(), 0);
    model.blocks[off]->fc1->weight.set_data(assigned.clone());
    {
      torch::NoGradGuard no_grad;
      model.blocks[off]->fc1->bias.mul_(2); // no elements: does nothing
    }
    Inputs in;
    const auto pass = [&] {
      torch::NoGradGuard no_grad;
      offloader.prepare_block_devices_before_forward();
      return forward_run_block(offloader, model, in.x.to(torch::kBFloat16),
                               in.context.to(torch::kBFloat16));
    };
    expect_error(pass, "'fc1.bias' of block " + std::to_string(off) +
                           " were written in place while their blocks were off the device");
    const torch::Tensor got = pass(); // the offloader goes on
    const torch::Tensor again = pass();
    expect_bitwise(got, again, "the pass after the error, twice");
  }
  // The assigned weight was kept; every other weight has its values again.
  const std::vector<torch::Tensor> after = all_parameters(model);
  ASSERT_EQ(after.size(), before.size());
  expect_bitwise(model.blocks[off]->fc1->weight, assigned, "the assigned weight, after close");
  for (std::size_t i = 0; i < after.size(); ++i) {
    if (after[i].sizes() == assigned.sizes() && torch::equal(after[i], assigned)) continue;
    expect_bitwise(after[i], before[i], "after close, parameter " + std::to_string(i));
  }
}

// The planner (blocks_to_swap = -1) leaves room in the budget for the two decode buffers.
TEST(Compress, ThePlannedBlocksAndTheDecodeBufferFitTheBudget) {
  for (bool on : {false, true}) {
    Model model(kBlocks);
    std::size_t total = 0;
    for (const auto& b : model.blocks) {
      for (const auto& p : b->parameters()) {
        if (!p.requires_grad()) total += (std::size_t(p.nbytes()) + 255) / 256 * 256;
      }
    }
    Options o = options(-1, false);
    o.device_budget_bytes = total / 2;
    o.compress = on ? Compress::on : Compress::off;
    ModelOffloader offloader("blocks", model.modules(), o);
    Inputs in;
    torch::NoGradGuard no_grad;
    offloader.prepare_block_devices_before_forward();
    forward_run_block(offloader, model, in.x, in.context);
    EXPECT_LE(offloader.device()->memory().peak_device_bytes, total / 2) << "compress " << on;
    EXPECT_EQ(offloader.compression().decode_buffer_bytes > 0, on);
  }
}

TEST(Compress, HostMemoryShrinksAndTheOptionIsChecked) {
  std::size_t kept[2] = {};
  for (bool on : {false, true}) {
    Model model(kBlocks);
    for (auto& b : model.blocks) b->to(torch::kBFloat16);
    Options o = options(3, false);
    o.compress = on ? Compress::on : Compress::off;
    ModelOffloader offloader("blocks", model.modules(), o);
    kept[on] = offloader.device()->host_memory().kept_bytes;
  }
  EXPECT_LT(double(kept[1]), 0.9 * double(kept[0]));
  Options seed = options(3, false);
  seed.compress = Compress::on;
  seed.algorithm = Algorithm::seed;
  Model model(kBlocks);
  expect_error([&] { ModelOffloader("blocks", model.modules(), seed); }, "compress");
}

} // namespace
} // namespace blockswap
