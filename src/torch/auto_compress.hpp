// compress = auto for one offloader (Note [automatic compression] in core/compression_choice.cpp):
// the facts its blocks and the machine give the decision. Implementer-only (src/torch).
#pragma once

#include <vector>

#include "block_layout.hpp"
#include "blockswap/core/compression_choice.hpp"
#include "blockswap/torch/options.hpp"

namespace blockswap::torch_frontend {

// The choice for blocks `layouts` built with `options` (their compress is auto), on a backend
// that can decode or not.
CompressionChoice choose_compression(const Options& options,
                                     const std::vector<BlockLayout>& layouts, bool can_decode);

} // namespace blockswap::torch_frontend
