#include "auto_compress.hpp"

#include <c10/core/ScalarType.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace blockswap::torch_frontend {

namespace {

const char* dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
  case c10::ScalarType::BFloat16:
    return "bfloat16";
  case c10::ScalarType::Half:
    return "float16";
  case c10::ScalarType::Float:
    return "float32";
  case c10::ScalarType::Float8_e4m3fn:
    return "float8_e4m3fn";
  case c10::ScalarType::Float8_e5m2:
    return "float8_e5m2";
  default:
    return "";
  }
}

// MemAvailable of /proc/meminfo: what the machine can give without swapping; empty elsewhere.
std::optional<uint64_t> available_host_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    uint64_t kib = 0;
    if (fields >> kib) return kib * 1024;
  }
  return std::nullopt;
}

} // namespace

CompressionChoice choose_compression(const Options& options,
                                     const std::vector<BlockLayout>& layouts, bool can_decode) {
  if (options.algorithm == Algorithm::seed) {
    return {false, "the seed's replay copies every block back to host memory"};
  }
  // Every rank of the node must agree (Note [compressed node-shared copy]), and what each would
  // measure of its host memory differs.
  if (options.node_sharing) {
    return {false, "with node sharing the node's ranks must agree, and auto decides per "
                   "process: pass compress='on' to compress the node's copy"};
  }
  CompressionFacts facts;
  facts.can_decode = can_decode;
  double compressed = 0;
  uint64_t held = 0; // host memory the module's tensors hold now, which the host copies replace
  for (const BlockLayout& layout : layouts) {
    facts.host_bytes += layout.bytes;
    for (const PackedTensor& t : layout.tensors) {
      const auto bytes = static_cast<uint64_t>(c10::multiply_integers(t.sizes)) *
                         static_cast<uint64_t>(c10::elementSize(t.dtype));
      if (t.variable.defined() && t.variable.device().is_cpu()) held += bytes;
      if (t.role != Role::frozen) continue;
      facts.frozen_bytes += bytes;
      compressed += static_cast<double>(bytes) / modelled_dtype_ratio(dtype_name(t.dtype));
    }
  }
  if (compressed > 0) facts.ratio = static_cast<double>(facts.frozen_bytes) / compressed;
  // The host copies in the steady state: the machine's available memory and what the module's
  // tensors leave to them; the host budget, when one is given, bounds them.
  if (const std::optional<uint64_t> available = available_host_bytes()) {
    facts.host_available = *available + held;
  }
  if (options.host_budget_bytes) {
    facts.host_available =
        std::min<uint64_t>(facts.host_available.value_or(UINT64_MAX), *options.host_budget_bytes);
  }
  return blockswap::choose_compression(facts);
}

} // namespace blockswap::torch_frontend
