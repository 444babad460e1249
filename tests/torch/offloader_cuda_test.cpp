// The LibTorch front end on a GPU where torch's caching allocator and current device meet
// blockswap's (label gpu; built only with CUDA): Note [slots after packing] (offloader_build.cpp),
// Note [slots beside torch's allocator] and Note [device scope] (src/device/cuda/cuda_device.cpp).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "blockswap/core/error.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/torch.hpp"

namespace blockswap {
namespace {

constexpr int64_t kBlocks = 8, kWidth = 2048; // 16 MiB of float weights per block

torch::nn::ModuleList frozen_blocks(c10::Device device) {
  torch::manual_seed(3);
  torch::nn::ModuleList blocks;
  for (int64_t b = 0; b < kBlocks; ++b) {
    torch::nn::Linear linear(torch::nn::LinearOptions(kWidth, kWidth).bias(false));
    linear->weight.set_requires_grad(false);
    linear->to(device);
    blocks->push_back(linear);
  }
  return blocks;
}

torch::Tensor forward(ModelOffloader* offloader, torch::nn::ModuleList& blocks, torch::Tensor x) {
  torch::NoGradGuard no_grad;
  if (offloader) offloader->prepare_block_devices_before_forward();
  for (int64_t b = 0; b < kBlocks; ++b) {
    if (offloader) offloader->wait_for_block(b);
    x = blocks[b]->as<torch::nn::Linear>()->forward(x).tanh();
    if (offloader) offloader->submit_move_blocks_forward(b);
  }
  return x;
}

Options forward_only(int64_t k, c10::Device device) {
  Options o;
  o.blocks_to_swap = k;
  o.supports_backward = false;
  o.device = device;
  return o;
}

int device_count() {
  return static_cast<int>(c10::cuda::device_count());
}

class OffloaderCuda : public ::testing::Test {
protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
};

// A model already on the GPU, with so little free device memory that its weights and the slots
// cannot be there together: the offloader packs the weights off the device first, torch's cache
// gives their memory back when the slots ask, and the slots fit. (Before both, this threw
// OutOfMemory with the weights' memory free in torch's cache.)
TEST_F(OffloaderCuda, SlotsTakeTheMemoryTheWeightsLeaveOnTheDevice) {
  const c10::Device cuda(c10::kCUDA, 0);
  c10::cuda::set_device(0);
  torch::nn::ModuleList blocks = frozen_blocks(cuda);
  const torch::Tensor x = torch::randn({4, kWidth}, torch::TensorOptions().device(cuda));
  const torch::Tensor expected = forward(nullptr, blocks, x);
  constexpr int64_t kSwapped = 2; // slots: 6 blocks, 96 MiB; the weights: 128 MiB
  const std::size_t block_bytes = kWidth * kWidth * 4;
  const std::size_t slots = (kBlocks - kSwapped) * block_bytes;
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  std::size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  // Leave half the slots' bytes free, outside torch: less than the slots, more than the slots
  // less the weights.
  const std::size_t keep = slots / 2;
  ASSERT_GT(free_bytes, keep + (64u << 20));
  void* filler = nullptr;
  ASSERT_EQ(cudaMalloc(&filler, free_bytes - keep), cudaSuccess);
  std::string error;
  torch::Tensor out;
  try {
    ModelOffloader offloader("linear", blocks, forward_only(kSwapped, cuda));
    out = forward(&offloader, blocks, x);
  } catch (const std::exception& e) {
    error = e.what();
  }
  ASSERT_EQ(cudaFree(filler), cudaSuccess);
  ASSERT_EQ(error, "");
  EXPECT_TRUE(torch::equal(out.cpu(), expected.cpu()));
}

// Should the slots not fit even so, the weights go back to the device they were on (the
// constructor changes nothing), and the error names what blockswap and torch hold.
TEST_F(OffloaderCuda, SlotsThatDoNotFitLeaveTheModelOnTheDevice) {
  const c10::Device cuda(c10::kCUDA, 0);
  torch::nn::ModuleList blocks = frozen_blocks(cuda);
  auto device = open_device(cuda);
  try {
    Buffer huge = device->attach("huge")->allocate_device(std::size_t{1} << 50);
    FAIL() << "a 1 PiB slot was allocated";
  } catch (const OutOfMemory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("held by blockswap"), std::string::npos) << what;
    EXPECT_NE(what.find("torch's caching allocator holds"), std::string::npos) << what;
  }
  Options o = forward_only(2, cuda);
  o.shared_device = open_device(cuda, {.budget_bytes = 1});
  EXPECT_THROW(ModelOffloader("linear", blocks, o), OutOfMemory);
  for (const auto& p : blocks->parameters()) EXPECT_EQ(p.device(), cuda);
}

// Note [device scope], with one GPU: the device current already (made so by torch), and a
// device that does not exist named with the devices present.
TEST_F(OffloaderCuda, AnOffloaderWorksWithItsDeviceCurrentAndNamesAMissingOne) {
  const c10::Device cuda(c10::kCUDA, 0);
  c10::cuda::set_device(0);
  torch::nn::ModuleList blocks = frozen_blocks(cuda);
  const torch::Tensor x = torch::randn({4, kWidth}, torch::TensorOptions().device(cuda));
  const torch::Tensor expected = forward(nullptr, blocks, x);
  {
    ModelOffloader offloader("linear", blocks, forward_only(3, cuda));
    for (int pass = 0; pass < 2; ++pass) {
      EXPECT_TRUE(torch::equal(forward(&offloader, blocks, x).cpu(), expected.cpu()));
    }
  }
  const int missing = device_count();
  try {
    open_device(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(missing)));
    FAIL() << "cuda:" << missing << " was opened";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(detail::concat("cuda:", missing, " does not exist")),
              std::string::npos)
        << e.what();
  }
}

// Note [device scope], with two GPUs: an offloader on cuda:0 used while torch's current device
// is cuda:1 (torch.cuda.set_device(1)); torch's current device stays cuda:1.
TEST_F(OffloaderCuda, AnOffloaderWorksWhileAnotherDeviceIsCurrent) {
  if (device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs (this machine has " << device_count()
                 << "): an offloader on cuda:0 while cuda:1 is current";
  }
  const c10::Device cuda(c10::kCUDA, 0);
  c10::cuda::set_device(0);
  torch::nn::ModuleList blocks = frozen_blocks(cuda);
  const torch::Tensor x = torch::randn({4, kWidth}, torch::TensorOptions().device(cuda));
  const torch::Tensor expected = forward(nullptr, blocks, x);
  c10::cuda::set_device(1);
  {
    ModelOffloader offloader("linear", blocks, forward_only(3, cuda));
    for (int pass = 0; pass < 2; ++pass) {
      EXPECT_TRUE(torch::equal(forward(&offloader, blocks, x).cpu(), expected.cpu()));
      EXPECT_EQ(c10::cuda::current_device(), 1);
    }
  }
  c10::cuda::set_device(0);
}

} // namespace
} // namespace blockswap
