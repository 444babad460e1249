#include "blockswap/core/compression_choice.hpp"

#include <cstdio>

#include "blockswap/core/error.hpp"

namespace blockswap {

double modelled_dtype_ratio(std::string_view d) {
  if (d == "BF16" || d == "bfloat16") return 1.40;
  if (d == "F16" || d == "float16") return 1.11;
  if (d == "F32" || d == "float32") return 1.17;
  if (d == "F8_E4M3" || d == "F8_E5M2" || d == "float8_e4m3fn" || d == "float8_e5m2") return 1.20;
  return 1.0;
}

std::string compression_verdict(double raw, double compressed) {
  if (compressed <= raw * 0.98) return "pays";
  if (compressed >= raw * 1.02) return "costs";
  return "changes nothing";
}

namespace {
constexpr double kLeastRatio = 1.1; // below it the host memory saved does not pay the encoding

std::string gib(uint64_t bytes) {
  const auto b = static_cast<double>(bytes);
  char out[32];
  if (bytes >= (1ull << 30)) {
    std::snprintf(out, sizeof out, "%.3g GiB", b / double(1ull << 30));
  } else {
    std::snprintf(out, sizeof out, "%.3g MiB", b / double(1ull << 20));
  }
  return out;
}
} // namespace

// Note [automatic compression]
// compress = auto turns compression on where it pays, off where it costs or changes nothing,
// in this order:
// 1. off where the device cannot decode, where no frozen bytes are stored in host copies
//    of the offloader's own (the file tier, node-shared copies, trainable-only blocks), or where
//    the weights are not floating point that compresses (modelled ratio under 1.1: integers,
//    quantized bytes);
// 2. on where host memory is short: the host copies, raw, take more than the memory available
//    to them (the machine's, or the host budget), and compressed they take less by the ratio;
// 3. where the planner's model of the step is known (blockswap plan, from the link's and the
//    compute's speeds): on where compression pays (the link bounds the step), off where it
//    costs (the decoder is slower than the link it saves) or changes nothing (compute-bound);
// 4. off otherwise: host memory suffices and nothing says the link bounds the step (an
//    offloader does not know its blocks' compute time; `blockswap plan` does, and
//    compress = on follows its verdict).
// The choice and its reason are reported (a log line, stats()).
CompressionChoice choose_compression(const CompressionFacts& f) {
  if (!f.can_decode) return {false, "the device cannot decode compressed weights"};
  if (f.frozen_bytes == 0) {
    return {false, "no frozen weights are stored in host copies of its own"};
  }
  if (f.ratio < kLeastRatio) {
    return {false, detail::concat("the frozen weights are not of a dtype that compresses "
                                  "(bfloat16, float16, float32, float8; modelled ratio ",
                                  f.ratio, ")")};
  }
  if (f.host_available && f.host_bytes > *f.host_available) {
    return {true, detail::concat("host memory is short: the host copies take ", gib(f.host_bytes),
                                 " raw, ", gib(*f.host_available), " is available (ratio ", f.ratio,
                                 ")")};
  }
  if (f.raw_step_seconds > 0 && f.compressed_step_seconds > 0) {
    const std::string verdict = compression_verdict(f.raw_step_seconds, f.compressed_step_seconds);
    const std::string numbers =
        detail::concat("the planner predicts ", f.compressed_step_seconds,
                       " s a step compressed against ", f.raw_step_seconds, " s raw");
    if (verdict == "pays") return {true, "the link bounds the step: " + numbers};
    if (verdict == "costs") return {false, "the decoder is slower than the link: " + numbers};
    return {false, "the step is compute-bound: " + numbers};
  }
  return {false, "host memory suffices and nothing says the link bounds the step "
                 "(compress='on' where blockswap plan says compression pays)"};
}

} // namespace blockswap
