// Whether compressed weights pay (EngineOptions::compress, Options::compress = auto): the
// codec's ratio modelled from the weights' dtypes, what the planner's model says of the step,
// and the host memory the copies may take. One decision for `blockswap plan`, for an offloader
// built with compress = auto, and for whoever plans one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace blockswap {

// The codec's ratio (raw bytes over compressed) on weights of one dtype, as measured on trained
// weights (docs/performance.md, "Lossless compression of frozen weights"; the lower of the two
// models): safetensors' names ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2") and torch's
// ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"); 1 for any other.
double modelled_dtype_ratio(std::string_view dtype);

// What compression does to a step the simulator predicts at `raw` seconds and at `compressed`
// seconds with it: "pays" (2 % faster or more), "costs" (2 % slower or more), or "changes
// nothing" (the step is compute-bound: the loads hide either way).
std::string compression_verdict(double raw, double compressed);

// What the decision knows. Unknown facts are left at their defaults.
struct CompressionFacts {
  bool can_decode = true;    // the backend has a decoder (Backend::can_decode)
  uint64_t frozen_bytes = 0; // the frozen bytes compression may store (host copies)
  uint64_t host_bytes = 0;   // every host copy's bytes, raw
  double ratio = 1;          // modelled (modelled_dtype_ratio, weighted by bytes)
  // Host memory the copies may take: the machine's available memory, the host budget.
  std::optional<uint64_t> host_available = std::nullopt;
  // The planner's model of the step raw and compressed (the schedule simulator); 0: unknown
  // (an offloader does not know its blocks' compute time).
  double raw_step_seconds = 0, compressed_step_seconds = 0;
};

struct CompressionChoice {
  bool on = false;
  std::string reason; // one line: why, with the numbers
};

// Note [automatic compression] in the .cpp.
CompressionChoice choose_compression(const CompressionFacts& facts);

} // namespace blockswap
