#include "plan_compression.hpp"

namespace blockswap::tool {

double modelled_compression_ratio(const std::vector<TensorInfo>& tensors) {
  double raw = 0, compressed = 0;
  for (const TensorInfo& t : tensors) {
    const std::string& d = t.dtype;
    const double ratio = d == "BF16"                        ? 1.40
                         : d == "F16"                       ? 1.11
                         : d == "F32"                       ? 1.17
                         : d == "F8_E4M3" || d == "F8_E5M2" ? 1.20
                                                            : 1.0;
    raw += static_cast<double>(t.bytes());
    compressed += static_cast<double>(t.bytes()) / ratio;
  }
  return compressed > 0 ? raw / compressed : 1.0;
}

std::string compression_verdict(double raw, double compressed) {
  if (compressed <= raw * 0.98) return "pays";
  if (compressed >= raw * 1.02) return "costs";
  return "changes nothing";
}

} // namespace blockswap::tool
