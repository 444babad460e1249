// Compressed weights in `blockswap plan` (issue 45, Options::compress): the ratio the codec
// reaches on a checkpoint, modelled from its tensors' dtypes, and whether compression pays.
#pragma once

#include <string>
#include <vector>

#include "blockswap/core/compression_choice.hpp" // compression_verdict
#include "blockswap/model_io/safetensors.hpp"

namespace blockswap::tool {

// The ratio (raw bytes over compressed bytes) of the codec on `tensors`, each dtype at the
// ratio measured on trained weights (docs/performance.md, "Lossless compression of frozen
// weights": bf16 1.40, fp16 1.11, fp32 1.17, float8 1.20, the lower of the two models), other
// dtypes 1 (core/compression_choice.hpp, modelled_dtype_ratio); weighted by their bytes.
double modelled_compression_ratio(const std::vector<TensorInfo>& tensors);

} // namespace blockswap::tool
