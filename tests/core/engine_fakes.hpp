// The engine tests' model and front end: blocks whose weights say which block they are, and
// a backward that needs each block in the slot its forward ran in, as autograd's saved views do.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {

// A model whose block i holds floats i*1e4 + j. "Computing" a block checks that the engine
// hands out exactly those weights.
struct FakeModel {
  std::vector<std::size_t> floats;
  std::vector<std::size_t> bytes() const {
    std::vector<std::size_t> out;
    for (std::size_t f : floats) out.push_back(f * sizeof(float));
    return out;
  }
  static float value(int64_t block, std::size_t j) { return float(block) * 1e4f + float(j); }

  void fill(Engine& engine) const {
    for (std::size_t b = 0; b < floats.size(); ++b) {
      auto* host = reinterpret_cast<float*>(engine.host_data(int64_t(b)));
      for (std::size_t j = 0; j < floats[b]; ++j) host[j] = value(int64_t(b), j);
    }
  }
  // Returns the number of wrong values read from the device copy of `block`.
  std::size_t compute(const Engine& engine, int64_t block) const {
    const auto* dev = reinterpret_cast<const float*>(engine.device_data(block));
    std::size_t wrong = 0;
    for (std::size_t j = 0; j < floats[block]; ++j) wrong += dev[j] != value(block, j);
    return wrong;
  }
  std::vector<std::byte> snapshot(const Engine& engine) const {
    std::vector<std::byte> all;
    for (std::size_t b = 0; b < floats.size(); ++b) {
      const std::byte* host = engine.host_data(int64_t(b));
      all.insert(all.end(), host, host + floats[b] * sizeof(float));
    }
    return all;
  }
};

inline FakeModel uniform(int64_t n, std::size_t floats = 4096) {
  return FakeModel{std::vector<std::size_t>(n, floats)};
}

inline void forward(Engine& engine, const FakeModel& model) {
  for (int64_t i = 0; i < engine.blocks(); ++i) {
    engine.wait_for_block(i);
    ASSERT_EQ(model.compute(engine, i), 0u) << "block " << i << " forward";
    engine.after_forward(i);
  }
}

inline void backward(Engine& engine, const FakeModel& model) {
  for (int64_t b = engine.blocks() - 1; b >= 0; --b) {
    engine.wait_for_block(b);
    ASSERT_EQ(model.compute(engine, b), 0u) << "block " << b << " backward";
    engine.after_backward(b);
  }
}

inline std::shared_ptr<EmulatedDevice> slow_device(double gbps = 2.0) {
  return std::make_shared<EmulatedDevice>(EmulatedDeviceOptions{.link_gbps = gbps});
}

// The front end's backward: before block b's backward, acquire_for_backward puts it back into
// the slot its forward ran in (autograd's saved views point there).
struct Graph {
  std::vector<const Buffer*> slot; // where each block's forward ran
};

inline Graph forward_recording(Engine& engine, const FakeModel& model) {
  Graph graph{std::vector<const Buffer*>(engine.blocks(), nullptr)};
  for (int64_t i = 0; i < engine.blocks(); ++i) {
    engine.wait_for_block(i);
    graph.slot[i] = engine.device_buffer(i).get();
    EXPECT_EQ(model.compute(engine, i), 0u) << "block " << i << " forward";
    engine.after_forward(i);
  }
  return graph;
}

// Backward of blocks last..0 only, as a loss on block `last` gives; true when every block
// found its own weights in the slot its forward used.
inline bool backward_from(Engine& engine, const FakeModel& model, const Graph& graph,
                          int64_t last) {
  for (int64_t b = last; b >= 0; --b) {
    engine.acquire_for_backward(b, graph.slot[b]);
    if (engine.device_buffer(b).get() != graph.slot[b] || model.compute(engine, b) != 0) {
      return false;
    }
  }
  return true;
}

} // namespace blockswap
