// The load pipeline's file tier under the engine: blocks over the host budget are read from the
// model's file for each load, in any call pattern, exactly; a file that fails under the run is
// an Error that loses nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

namespace fs = std::filesystem;

float value(int64_t block, std::size_t j) {
  return float(block) * 1e4f + float(j);
}

// N blocks of `floats` floats each, block b's j-th = value(b, j), written as a model file holds
// them: two tensors per block, the second half first, at odd offsets with junk between.
struct ModelFile {
  fs::path path;
  std::vector<FileBlock> blocks;
  std::vector<std::size_t> bytes;
  ModelFile(int64_t n, std::size_t floats) {
    const fs::path dir =
        fs::temp_directory_path() / ("blockswap-engine-file-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    path = dir / "model.safetensors";
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    auto junk = [&](int count) {
      for (int i = 0; i < count; ++i) out.put(char(0x7f));
    };
    junk(13);
    const std::size_t half = floats / 2;
    for (int64_t b = 0; b < n; ++b) {
      std::vector<float> values(floats);
      for (std::size_t j = 0; j < floats; ++j) values[j] = value(b, j);
      FileBlock block;
      block.bytes = floats * sizeof(float);
      const auto write = [&](std::size_t first, std::size_t count) {
        block.ranges.push_back(
            FileRange{static_cast<uint64_t>(out.tellp()), count * sizeof(float), first * 4});
        out.write(reinterpret_cast<const char*>(values.data() + first),
                  static_cast<std::streamsize>(count * sizeof(float)));
      };
      write(half, floats - half);
      junk(5);
      write(0, half);
      blocks.push_back(block);
      bytes.push_back(block.bytes);
    }
  }
  ~ModelFile() { fs::remove_all(path.parent_path()); }

  FileTier tier(std::size_t host_budget) const {
    return FileTier{{path.string()}, blocks, host_budget, 2, CacheBypass::direct};
  }
  // Fills the host copies of the blocks the budget keeps in memory.
  void fill(Engine& engine) const {
    for (int64_t b = 0; b < engine.blocks(); ++b) {
      if (engine.in_file(b)) {
        EXPECT_EQ(engine.host_data(b), nullptr);
        continue;
      }
      auto* host = reinterpret_cast<float*>(engine.host_data(b));
      for (std::size_t j = 0; j < bytes[b] / 4; ++j) host[j] = value(b, j);
    }
  }
};

std::size_t wrong(const Engine& engine, int64_t block) {
  const auto* dev = reinterpret_cast<const float*>(engine.device_data(block));
  std::size_t wrong = 0;
  for (std::size_t j = 0; j < engine.block_bytes(block) / 4; ++j)
    wrong += dev[j] != value(block, j);
  return wrong;
}

void forward(Engine& engine) {
  for (int64_t i = 0; i < engine.blocks(); ++i) {
    engine.wait_for_block(i);
    ASSERT_EQ(wrong(engine, i), 0u) << "block " << i << " forward";
    engine.after_forward(i);
  }
}

void backward(Engine& engine) {
  for (int64_t b = engine.blocks() - 1; b >= 0; --b) {
    engine.wait_for_block(b);
    ASSERT_EQ(wrong(engine, b), 0u) << "block " << b << " backward";
    engine.after_backward(b);
  }
}

std::shared_ptr<EmulatedDevice> device() {
  return std::make_shared<EmulatedDevice>(EmulatedDeviceOptions{.link_gbps = 4.0});
}

TEST(FileTier, TheHostBudgetHoldsMovedBlocksFirstThenTheOthersAndTheFileTheRest) {
  const ModelFile file(8, 1000); // 4000 B per block
  EngineOptions options{.blocks_to_swap = 3};
  options.file = file.tier(2 * 4000 + 100);
  Engine engine(device(), file.bytes, options);
  // Forward-only with R = 2 moves blocks 0, 1, 3, 4 and 6 (K + R = 5 loads per pass), loaded in
  // the order 3, 4, 6, then 0 and 1 for the next pass; two fit the budget, spread over the
  // pass's loads (core/planner.hpp, host_priority): the first and the last, 3 and 1.
  std::vector<bool> in_file;
  for (int64_t b = 0; b < 8; ++b) in_file.push_back(engine.in_file(b));
  EXPECT_EQ(in_file, (std::vector<bool>{true, false, true, false, true, true, true, true}));
  // Room left after the moved blocks goes to the blocks that never move, in block order.
  options.file = file.tier(6 * 4000 + 100);
  Engine roomy(device(), file.bytes, options);
  int64_t in_host = 0;
  for (int64_t b = 0; b < 8; ++b) in_host += roomy.in_file(b) ? 0 : 1;
  EXPECT_EQ(in_host, 6);
  for (const Op& op : roomy.schedule().pass()) {
    if (op.kind == Op::Kind::move) {
      EXPECT_FALSE(roomy.in_file(op.move.in)) << op.move.in;
    }
  }
}

// A caller's order (FileTier::priority: the planner's file_priority) replaces the engine's; the
// loads stay exact. One that does not name every block once is refused.
TEST(FileTier, TheCallersPriorityPlacesTheBlocks) {
  const ModelFile file(8, 1000);
  EngineOptions options{.blocks_to_swap = 3};
  options.file = file.tier(2 * 4000 + 100);
  options.file->priority = {6, 0, 1, 2, 3, 4, 5, 7};
  Engine engine(device(), file.bytes, options);
  std::vector<bool> in_file;
  for (int64_t b = 0; b < 8; ++b) in_file.push_back(engine.in_file(b));
  EXPECT_EQ(in_file, (std::vector<bool>{false, true, true, true, true, true, false, true}));
  file.fill(engine);
  for (int pass = 0; pass < 3; ++pass) {
    engine.prepare();
    forward(engine);
  }
  for (const std::vector<int64_t>& wrong_order :
       std::vector<std::vector<int64_t>>{{6, 0, 1, 2, 3, 4, 5}, {6, 6, 1, 2, 3, 4, 5, 7}, {8}}) {
    options.file->priority = wrong_order;
    EXPECT_THROW(Engine(device(), file.bytes, options), InvalidArgument);
  }
}

// A training engine gives the budget to the blocks a training pass moves before those only
// inference moves: a block a step loads is never read from the file while one it never loads
// holds host memory.
TEST(FileTier, TrainingMovesTakeTheBudgetFirst) {
  const ModelFile file(8, 1000);
  for (int64_t k : {1, 2}) {
    EngineOptions options{.blocks_to_swap = k, .supports_backward = true};
    options.trainable_bytes.assign(8, 0);
    std::vector<bool> moved(8, false);
    int64_t moved_count = 0;
    {
      Engine probe(device(), file.bytes, options);
      for (const Op& op : probe.schedule().pass()) {
        if (op.kind == Op::Kind::move && !moved[op.move.in]) {
          moved[op.move.in] = true;
          ++moved_count;
        }
      }
    }
    options.file = file.tier(static_cast<std::size_t>(moved_count) * 4000);
    Engine engine(device(), file.bytes, options);
    for (int64_t b = 0; b < 8; ++b) {
      EXPECT_EQ(engine.in_file(b), !moved[b]) << "K " << k << ", block " << b;
    }
    file.fill(engine);
    engine.prepare();
    engine.reset_stats();
    forward(engine);
    backward(engine);
    EXPECT_EQ(engine.stats().disk_bytes, 0u) << "K " << k;
  }
}

TEST(FileTier, InferenceFromTheFileIsExactAtEveryBudget) {
  const ModelFile file(8, 1000);
  for (int64_t k : {1, 3, 6}) {
    for (std::size_t budget : {std::size_t{0}, std::size_t{8000}, std::size_t{1} << 20}) {
      SCOPED_TRACE("K " + std::to_string(k) + ", host budget " + std::to_string(budget));
      EngineOptions options{.blocks_to_swap = k};
      options.file = file.tier(budget);
      Engine engine(device(), file.bytes, options);
      file.fill(engine);
      uint64_t file_loads = 0;
      for (int pass = 0; pass < 4; ++pass) {
        engine.prepare();
        if (pass == 1) engine.reset_stats();
        forward(engine);
      }
      for (const Op& op : engine.schedule().pass()) {
        if (op.kind == Op::Kind::move && engine.in_file(op.move.in)) ++file_loads;
      }
      EXPECT_EQ(engine.stats().disk_bytes, 3 * file_loads * 4000);
    }
  }
}

TEST(FileTier, TrainingPassesFromTheFileAreExact) {
  const ModelFile file(6, 1500);
  for (int64_t k : {1, 2, 4}) {
    SCOPED_TRACE("K " + std::to_string(k));
    EngineOptions options{.blocks_to_swap = k, .supports_backward = true, .trainable_bytes = {}};
    options.trainable_bytes.assign(6, 0);
    options.file = file.tier(0);
    Engine engine(device(), file.bytes, options);
    file.fill(engine);
    for (int step = 0; step < 3; ++step) {
      engine.prepare();
      forward(engine);
      backward(engine);
    }
  }
}

// Patterns the schedule does not foresee: every load still reads the right bytes.
TEST(FileTier, UnforeseenOrdersReadTheRightBlocks) {
  const ModelFile file(7, 1200);
  EngineOptions options{.blocks_to_swap = 3, .supports_backward = true};
  options.trainable_bytes.assign(7, 0);
  options.file = file.tier(4800); // one moved block in host memory
  Engine engine(device(), file.bytes, options);
  file.fill(engine);
  engine.prepare();
  forward(engine);
  backward(engine);
  engine.set_forward_only(true); // a sample between steps
  engine.prepare();
  forward(engine);
  engine.prepare(); // a pass stopped after three blocks
  for (int64_t i = 0; i < 3; ++i) {
    engine.wait_for_block(i);
    ASSERT_EQ(wrong(engine, i), 0u);
    engine.after_forward(i);
  }
  engine.set_forward_only(false);
  engine.disable(); // every block on the device
  engine.prepare();
  forward(engine);
  engine.enable();
  engine.prepare();
  forward(engine);
  backward(engine);
  engine.prepare();
  forward(engine);
  backward(engine);
}

TEST(FileTier, AFileChangedUnderTheRunIsAnErrorThatLosesNothing) {
  const ModelFile file(6, 1000);
  EngineOptions options{.blocks_to_swap = 3};
  options.file = file.tier(0);
  Engine engine(device(), file.bytes, options);
  engine.prepare();
  forward(engine);
  const auto size = fs::file_size(file.path);
  std::vector<char> saved(size);
  std::ifstream(file.path, std::ios::binary).read(saved.data(), std::streamsize(size));
  fs::resize_file(file.path, size / 2); // truncated under the run
  bool raised = false;
  try {
    engine.prepare();
    forward(engine);
    forward(engine);
  } catch (const Error& e) {
    raised = true;
    EXPECT_NE(std::string(e.what()).find(file.path.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("changed"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(raised);
  { // the same bytes again, as the file was when opened: the engine goes on, exactly
    std::ofstream out(file.path, std::ios::binary | std::ios::trunc);
    out.write(saved.data(), std::streamsize(size));
  }
  EngineOptions again{.blocks_to_swap = 3};
  again.file = file.tier(0);
  Engine fresh(device(), file.bytes, again);
  fresh.prepare();
  forward(fresh);
}

TEST(FileTier, WhatTheFileCannotHoldIsRefused) {
  const ModelFile file(4, 500);
  EngineOptions trainable{.blocks_to_swap = 1, .supports_backward = true};
  trainable.trainable_bytes.assign(4, 400); // full fine-tuning: weights that change
  trainable.file = file.tier(0);
  EXPECT_THROW(Engine(device(), file.bytes, trainable), Error);
  EngineOptions seed{.blocks_to_swap = 1, .algorithm = Algorithm::seed};
  seed.file = file.tier(0);
  EXPECT_THROW(Engine(device(), file.bytes, seed), Error);
  EngineOptions short_list{.blocks_to_swap = 1};
  short_list.file = file.tier(0);
  short_list.file->blocks.pop_back();
  EXPECT_THROW(Engine(device(), file.bytes, short_list), InvalidArgument);
  EngineOptions missing{.blocks_to_swap = 1};
  missing.file = file.tier(0);
  missing.file->files[0] += ".gone";
  try {
    Engine engine(device(), file.bytes, missing);
    FAIL() << "a missing file was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(".gone"), std::string::npos) << e.what();
  }
}

} // namespace
} // namespace blockswap
