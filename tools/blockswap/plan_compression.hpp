// Compressed weights in `blockswap plan` (issue 45, Options::compress): the ratio the codec
// reaches on a checkpoint, modelled from its tensors' dtypes, and whether compression pays.
#pragma once

#include <string>
#include <vector>

#include "blockswap/model_io/safetensors.hpp"

namespace blockswap::tool {

// The ratio (raw bytes over compressed bytes) of the codec on `tensors`, each dtype at the
// ratio measured on trained weights (docs/performance.md, "Lossless compression of frozen
// weights": bf16 1.40, fp16 1.11, fp32 1.17, float8 1.20, the lower of the two models), other
// dtypes 1; weighted by their bytes.
double modelled_compression_ratio(const std::vector<TensorInfo>& tensors);

// What compression does to a step the simulator predicts at `raw` seconds and at `compressed`
// seconds with it: "pays" (2 % faster or more), "costs" (2 % slower or more), or "changes
// nothing" (the step is compute-bound: the loads hide either way).
std::string compression_verdict(double raw, double compressed);

} // namespace blockswap::tool
