// What the fuzzer exercises, shared by the libFuzzer target and the corpus replay test: the
// safetensors header reader, then plan's block grouping and planning on what it accepted.
// Any input may be rejected with blockswap::Error; nothing else may happen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "blockswap/core/error.hpp"
#include "blockswap/model_io/model_plan.hpp"
#include "blockswap/model_io/safetensors.hpp"

namespace blockswap::fuzz {

inline void fuzz_one(const uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  SafetensorsHeader header;
  try {
    header = parse_safetensors_header(bytes, size);
  } catch (const Error&) {
    return;
  }
  // Accepted: every tensor lies inside the data and no two overlap.
  for (const TensorInfo& t : header.tensors) {
    BLOCKSWAP_ASSERT(t.begin <= t.end && t.end <= header.data_bytes);
  }
  const ModelLayout layout = group_blocks(header.tensors);
  uint64_t total = layout.non_block_bytes;
  for (const BlockGroup& g : layout.groups) total += g.total_bytes();
  for (uint64_t budget : {uint64_t{0}, total / 2, total, total * 2}) {
    for (Mode mode : {Mode::training, Mode::forward_only}) {
      try {
        const ModelPlan plan = plan_model(layout, budget, mode);
        BLOCKSWAP_ASSERT(plan.device_bytes <= budget);
      } catch (const Error&) {
      }
    }
  }
}

} // namespace blockswap::fuzz
