#include "plan_compression.hpp"

#include "blockswap/core/compression_choice.hpp"

namespace blockswap::tool {

double modelled_compression_ratio(const std::vector<TensorInfo>& tensors) {
  double raw = 0, compressed = 0;
  for (const TensorInfo& t : tensors) {
    raw += static_cast<double>(t.bytes());
    compressed += static_cast<double>(t.bytes()) / modelled_dtype_ratio(t.dtype);
  }
  return compressed > 0 ? raw / compressed : 1.0;
}

} // namespace blockswap::tool
