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

namespace blockswap {
namespace {

// A c10d-like store: get waits for the key until the timeout. Each offloader a process builds
// takes the next number in its keys; the ranks here are threads of one process, so the store
// drops that number (each test builds one offloader per rank).
class TestStore {
public:
  explicit TestStore(std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : timeout_(timeout) {}

  NodeSharing rank(int64_t local_rank, int64_t local_world_size, std::string group = "") {
    NodeSharing sharing;
    sharing.set = [this](const std::string& key, const std::string& value) {
      std::lock_guard lock(mutex_);
      values_[without_number(key)] = value;
      changed_.notify_all();
    };
    sharing.get = [this](const std::string& key) {
      std::unique_lock lock(mutex_);
      const std::string k = without_number(key);
      if (!changed_.wait_for(lock, timeout_, [&] { return values_.contains(k); })) {
        throw std::runtime_error("timeout waiting for key " + k);
      }
      return values_[k];
    };
    sharing.local_rank = local_rank;
    sharing.local_world_size = local_world_size;
    sharing.group = std::move(group);
    return sharing;
  }

private:
  // "blockswap/<host>/[group-<g>/]<label>/<n>/<what>" without "<n>/".
  static std::string without_number(const std::string& key) {
    std::size_t at = 0;
    const int slashes = key.find("/group-") != std::string::npos ? 4 : 3;
    for (int slash = 0; slash < slashes; ++slash) at = key.find('/', at) + 1;
    return key.substr(0, at) + key.substr(key.find('/', at) + 1);
  }
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

Options shared_options(int64_t k, NodeSharing sharing) {
  Options o = options(k, true);
  o.node_sharing = std::move(sharing);
  return o;
}

// Runs f(rank) for each rank on a thread of its own; returns each one's error ("" if none).
std::vector<std::string> on_ranks(int64_t ranks, const std::function<void(int64_t)>& f) {
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

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

} // namespace
} // namespace blockswap
