// Options::node_sharing inside one process: the ranks of a node are threads here, each with its
// own model and offloader, meeting through an in-memory store (the multi-process runs, with
// c10d's store and Gloo, are `blockswap run --ranks` in tests/tools). Every rank trains exactly
// as the model without blockswap; every way the meeting can fail is an Error on every rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <barrier>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include "blockswap/core/node_memory.hpp"
#include "test_model.hpp"
#include "test_store.hpp"

namespace blockswap {
namespace {

void scramble_frozen(Model& model) {
  torch::NoGradGuard no_grad;
  for (auto& block : model.blocks) {
    for (auto& p : block->parameters()) {
      if (!p.requires_grad()) p.fill_(-3.0);
    }
  }
}

// Every rank's frozen weights are local rank 0's, read from one host copy; each rank's LoRA
// training equals the model's without blockswap, bit for bit, at every K.
TEST(NodeSharing, EveryRankTrainsExactlyOnLocalRankZerosWeights) {
  constexpr int64_t kBlocks = 6, kRanks = 3;
  TrainingRun reference(kBlocks);
  reference.run(
      3, [&](torch::Tensor x, const torch::Tensor& c) { return reference.model.forward(x, c); });
  for (int64_t k : {0, 2, 4}) {
    TestStore store;
    std::vector<std::unique_ptr<TrainingRun>> runs;
    for (int64_t r = 0; r < kRanks; ++r) {
      runs.push_back(std::make_unique<TrainingRun>(kBlocks));
      if (r > 0) scramble_frozen(runs[r]->model); // only local rank 0's are read
    }
    const auto errors = on_ranks(kRanks, [&](int64_t r) {
      TrainingRun& run = *runs[r];
      ModelOffloader offloader("block", run.model.modules(),
                               shared_options(k, store.rank(r, kRanks)));
      run.run(3, [&](torch::Tensor x, const torch::Tensor& c) {
        offloader.prepare_block_devices_before_forward();
        return forward_run_block(offloader, run.model, x, c);
      });
    });
    for (int64_t r = 0; r < kRanks; ++r) {
      ASSERT_EQ(errors[r], "") << "rank " << r;
      expect_same_training(reference, *runs[r],
                           "K=" + std::to_string(k) + " rank " + std::to_string(r));
      // After the offloader, the frozen weights are ordinary host tensors with rank 0's values.
      expect_bitwise(runs[r]->model.blocks[1]->fc2->weight, reference.model.blocks[1]->fc2->weight,
                     "frozen weight after close, rank " + std::to_string(r));
    }
    // Each rank maps the node's memory for itself.
    EXPECT_NE(runs[0]->model.blocks[1]->fc2->weight.data_ptr(),
              runs[1]->model.blocks[1]->fc2->weight.data_ptr());
  }
}

// Note [pinning shares]
// The ranks of a node map one copy of the frozen weights, copy-on-write. On a GPU each rank
// page-locks its mapping read-only (CudaDevice::pin_host); were the pin to make the kernel copy
// the pages (a pin for writing, or a long-term read-only pin that unshares copy-on-write pages),
// each rank would hold a private copy: smaps would show the mapping's pages as private, not
// shared. Measured after a pass, so that every rank has read every page, and with the
// offloaders alive. Here (the emulated device pins nothing) it checks the measurement itself.
TEST(NodeSharing, PinningTheSharedCopyMakesNoPrivateCopy) {
  constexpr int64_t kBlocks = 4, kRanks = 2;
  TestStore store;
  std::vector<std::unique_ptr<TrainingRun>> runs;
  std::size_t frozen_bytes = 0;
  for (int64_t r = 0; r < kRanks; ++r) runs.push_back(std::make_unique<TrainingRun>(kBlocks));
  for (auto& block : runs[0]->model.blocks) {
    for (auto& p : block->parameters()) {
      if (!p.requires_grad()) frozen_bytes += p.numel() * p.element_size();
    }
  }
  std::barrier together(kRanks);
  NodeMemoryUse use;
  std::vector<bool> pinned(kRanks, false);
  const auto errors = on_ranks(kRanks, [&](int64_t r) {
    TrainingRun& run = *runs[r];
    std::optional<ModelOffloader> offloader;
    try {
      Options o = shared_options(2, store.rank(r, kRanks));
      o.shared_device = open_device(kDevice);
      pinned[r] = false;
      offloader.emplace("block", run.model.modules(), o);
      pinned[r] = o.shared_device->backend().memory().pinned_host;
      run.run(1, [&](torch::Tensor x, const torch::Tensor& c) {
        offloader->prepare_block_devices_before_forward();
        return forward_run_block(*offloader, run.model, x, c);
      });
    } catch (...) {
      together.arrive_and_drop();
      throw;
    }
    together.arrive_and_wait();
    if (r == 0) use = NodeMemory::use();
    together.arrive_and_wait();
  });
  for (int64_t r = 0; r < kRanks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  std::cout << "node memory with " << kRanks << " ranks, pinned " << pinned[0] << "/" << pinned[1]
            << ": private " << use.private_bytes << ", shared " << use.shared_bytes
            << ", frozen weights " << frozen_bytes << " bytes\n";
  ASSERT_GT(frozen_bytes, 0u);
  // Every rank maps every page of the one copy: kRanks mappings of it, shared.
  EXPECT_GE(use.shared_bytes, kRanks * frozen_bytes);
  // A private copy of the weights in a rank would be frozen_bytes; the page-aligned parts
  // (node_sharing.cpp) and the header page stay well under half of it.
  EXPECT_LT(use.private_bytes, frozen_bytes / 2)
      << "pinning made a private copy of the node's weights (pinned: " << pinned[0] << ", "
      << pinned[1] << ")";
}

// Two groups of ranks on one node meeting through one store (process subgroups), each group
// with its own model: each group's ranks read their own local rank 0's weights.
TEST(NodeSharing, GroupsSharingAStoreKeepTheirOwnCopies) {
  TestStore store;
  std::vector<std::unique_ptr<Model>> models;
  for (int r = 0; r < 4; ++r) models.push_back(std::make_unique<Model>(4));
  {
    torch::NoGradGuard no_grad;
    models[2]->blocks[0]->fc1->weight.fill_(0.5); // group b's local rank 0: other weights
  }
  const auto expected = models[2]->blocks[0]->fc1->weight.clone();
  const auto original = models[0]->blocks[0]->fc1->weight.clone();
  const auto errors = on_ranks(4, [&](int64_t r) {
    ModelOffloader offloader("block", models[r]->modules(),
                             shared_options(2, store.rank(r % 2, 2, r < 2 ? "a" : "b")));
  });
  for (int r = 0; r < 4; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  expect_bitwise(models[1]->blocks[0]->fc1->weight, original, "group a's local rank 1");
  expect_bitwise(models[3]->blocks[0]->fc1->weight, expected, "group b's local rank 1");
}

TEST(NodeSharing, DifferentBlocksOnARankAreAnErrorOnEveryRank) {
  TestStore store;
  Model leader(6), other(5);
  const auto errors = on_ranks(2, [&](int64_t r) {
    Model& model = r == 0 ? leader : other;
    ModelOffloader offloader("block", model.modules(), shared_options(2, store.rank(r, 2)));
  });
  EXPECT_NE(errors[1].find("differ from local rank 0's"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("local rank 1 could not use"), std::string::npos) << errors[0];
}

TEST(NodeSharing, ALocalRankZeroThatFailsTellsTheOthers) {
  TestStore store;
  Model a(6), b(6);
  const auto errors = on_ranks(2, [&](int64_t r) {
    ModelOffloader offloader("block", (r == 0 ? a : b).modules(),
                             shared_options(r == 0 ? 9 : 2, store.rank(r, 2))); // K = 9 > N
  });
  EXPECT_NE(errors[0].find("blocks_to_swap"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("local rank 0 could not build"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("blocks_to_swap"), std::string::npos) << errors[1];
}

// A rank that never comes (it died, or never builds the offloader): local rank 0 waits for the
// store's timeout, then raises, with its own tensors as they were.
TEST(NodeSharing, ARankThatNeverComesIsAnErrorAfterTheStoresTimeout) {
  TestStore store(std::chrono::milliseconds(300));
  Model model(6), reference(6);
  const Inputs in;
  expect_error(
      [&] {
        ModelOffloader offloader("block", model.modules(), shared_options(2, store.rank(0, 2)));
      },
      "local rank 1 to map them in vain");
  torch::NoGradGuard no_grad;
  // The weights are intact, in host tensors (on a GPU, no longer on the device).
  for (std::size_t b = 0; b < model.blocks.size(); ++b) {
    const auto expected = reference.blocks[b]->named_parameters();
    for (const auto& item : model.blocks[b]->named_parameters()) {
      expect_bitwise(item.value(), expected[item.key()],
                     "after the failed constructor: block " + std::to_string(b) + " " + item.key());
    }
  }
  // A rank whose local rank 0 never comes.
  Model lonely(6);
  TestStore empty(std::chrono::milliseconds(300));
  expect_error(
      [&] {
        ModelOffloader offloader("block", lonely.modules(), shared_options(2, empty.rank(1, 2)));
      },
      "local rank 0's node-shared weights in vain");
}

TEST(NodeSharing, FullFineTuningAndBadRanksAreRefused) {
  TestStore store;
  Model model(4);
  Options o = shared_options(2, store.rank(0, 1));
  o.optimizer = FusedSGD{.lr = 0.1};
  expect_error([&] { ModelOffloader offloader("block", model.modules(), o); }, "node_sharing");
  expect_error(
      [&] {
        ModelOffloader offloader("block", model.modules(), shared_options(2, store.rank(2, 2)));
      },
      "local rank 2 of 2");
}

// The node's copy never changes: a write into a swapped frozen weight raises at the block's next
// move, and the node's copy keeps its values.
TEST(NodeSharing, AWriteIntoASharedFrozenWeightIsAnError) {
  TestStore store;
  Model model(4), reference(4);
  const Inputs in;
  ModelOffloader offloader("block", model.modules(), shared_options(2, store.rank(0, 1)));
  offloader.prepare_block_devices_before_forward();
  torch::NoGradGuard no_grad;
  forward_run_block(offloader, model, in.x, in.context);
  model.blocks[3]->fc1->weight.mul_(2); // resident: the write lands in its slot
  expect_error(
      [&] {
        offloader.prepare_block_devices_before_forward();
        forward_run_block(offloader, model, in.x, in.context);
      },
      "shared by every rank");
}

// Note [compressed node-shared copy]: with compress on, the node's one copy holds the blocks
// compressed, made by local rank 0; every rank decodes it at each load and trains exactly as the
// model without blockswap, with rank 0's weights (the others' own were scrambled).
TEST(NodeSharing, EveryRankTrainsExactlyOnOneCompressedCopy) {
  constexpr int64_t kBlocks = 5, kRanks = 2;
  TrainingRun reference(kBlocks);
  reference.run(
      2, [&](torch::Tensor x, const torch::Tensor& c) { return reference.model.forward(x, c); });
  for (int64_t k : {0, 3}) {
    TestStore store;
    std::vector<std::unique_ptr<TrainingRun>> runs;
    std::vector<CompressionStats> compression(kRanks);
    std::vector<Stats> stats(kRanks);
    for (int64_t r = 0; r < kRanks; ++r) {
      runs.push_back(std::make_unique<TrainingRun>(kBlocks));
      if (r > 0) scramble_frozen(runs[r]->model);
    }
    const auto errors = on_ranks(kRanks, [&](int64_t r) {
      TrainingRun& run = *runs[r];
      Options o = shared_options(k, store.rank(r, kRanks));
      o.compress = Compress::on;
      ModelOffloader offloader("block", run.model.modules(), o);
      run.run(2, [&](torch::Tensor x, const torch::Tensor& c) {
        offloader.prepare_block_devices_before_forward();
        return forward_run_block(offloader, run.model, x, c);
      });
      compression[r] = offloader.compression();
      stats[r] = offloader.stats();
    });
    const std::string at = "K=" + std::to_string(k);
    for (int64_t r = 0; r < kRanks; ++r) {
      ASSERT_EQ(errors[r], "") << at << " rank " << r;
      expect_same_training(reference, *runs[r], at + " rank " + std::to_string(r));
      expect_bitwise(runs[r]->model.blocks[2]->fc1->weight, reference.model.blocks[2]->fc1->weight,
                     at + ": frozen weight after close, rank " + std::to_string(r));
      // Every block is stored compressed, the same on every rank, and the loads decoded it.
      EXPECT_EQ(compression[r].blocks, kBlocks) << at;
      EXPECT_GT(compression[r].ratio(), 1.05) << at;
      EXPECT_EQ(compression[r].compressed_bytes, compression[0].compressed_bytes) << at;
      EXPECT_GT(stats[r].decoded_bytes, 0u) << at << " rank " << r;
      EXPECT_EQ(stats[r].decoded_bytes > stats[r].compressed_bytes, true) << at;
    }
  }
}

TEST(NodeSharing, RanksThatDisagreeOnCompressionAreAnErrorOnEveryRank) {
  TestStore store;
  Model a(4), b(4), reference(4);
  const auto errors = on_ranks(2, [&](int64_t r) {
    Options o = shared_options(2, store.rank(r, 2));
    o.compress = r == 0 ? Compress::on : Compress::off;
    ModelOffloader offloader("block", (r == 0 ? a : b).modules(), o);
  });
  EXPECT_NE(errors[1].find("this rank's compress option (off) differs from local rank 0's (on)"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("local rank 1 could not use the node-shared weights: its compress "
                           "option (off) differs"),
            std::string::npos)
      << errors[0];
  // Local rank 0's weights are intact after its failed constructor.
  expect_bitwise(a.blocks[1]->fc2->weight, reference.blocks[1]->fc2->weight, "rank 0's weight");
}

// The compressed copy never changes either: a write into a frozen weight, on the device or into
// its tensor with no elements off it, raises, once; the weights stay rank 0's.
TEST(NodeSharing, AWriteIntoACompressedSharedFrozenWeightIsAnError) {
  TestStore store;
  Model model(4), reference(4);
  const Inputs in;
  Options o = shared_options(2, store.rank(0, 1));
  o.compress = Compress::on;
  ModelOffloader offloader("block", model.modules(), o);
  torch::NoGradGuard no_grad;
  auto pass = [&] {
    offloader.prepare_block_devices_before_forward();
    return forward_run_block(offloader, model, in.x, in.context);
  };
  const torch::Tensor expected = reference.forward(in.x, in.context);
  expect_bitwise(pass(), expected, "first pass");
  // The same values again (a checkpoint resumed) are no change.
  model.blocks[3]->fc1->weight.copy_(reference.blocks[3]->fc1->weight);
  expect_bitwise(pass(), expected, "the same values written again");
  model.blocks[3]->fc1->weight.mul_(2); // resident: the write lands in its slot
  expect_error(pass, "shared by every rank");
  Model other(4);
  TestStore other_store;
  Options o2 = shared_options(2, other_store.rank(0, 1));
  o2.compress = Compress::on;
  ModelOffloader second("block", other.modules(), o2);
  auto second_pass = [&] {
    second.prepare_block_devices_before_forward();
    return forward_run_block(second, other, in.x, in.context);
  };
  expect_bitwise(second_pass(), expected, "second offloader's first pass");
  ASSERT_EQ(other.blocks[0]->fc1->weight.numel(), 0); // swapped out: no elements off the device
  other.blocks[0]->fc1->weight.set_data(reference.blocks[0]->fc1->weight.clone());
  expect_bitwise(second_pass(), expected, "rebound to the same values");
  other.blocks[0]->fc1->weight.mul_(2); // does nothing, but bumps its version
  expect_error(second_pass, "shared by every rank");
  expect_bitwise(second_pass(), expected, "the pass after the error");
}

} // namespace
} // namespace blockswap
