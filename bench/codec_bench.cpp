// The codec on one core (core/codec.hpp): ratio, encode and decode GB/s (of decoded bytes), and
// the checksum's share of the decode, over files of bf16 values or synthetic weights.
//
//   build/bench/codec_bench                       # synthetic normal(0, 0.02), every dtype
//   build/bench/codec_bench --dtype fp32 FILE...  # each FILE's bytes as values of the dtype
//
// bench/python/compression_bench.py --dump DIR writes trained and random weights' bf16 bytes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "blockswap/core/codec.hpp"
#include "blockswap/core/error.hpp"

namespace codec = blockswap::codec;

namespace {

double seconds_of(auto&& fn, int repeats) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

void measure(const std::string& label, const std::vector<std::byte>& raw, codec::DType dtype) {
  codec::Range all{0, raw.size() / codec::width(dtype) * codec::width(dtype), dtype};
  std::vector<std::byte> block;
  double enc = seconds_of([&] { block = codec::encode(raw, {&all, 1}); }, 2);
  std::vector<std::byte> out(raw.size());
  double dec = seconds_of([&] { codec::decode(block, out); }, 5);
  BLOCKSWAP_CHECK(std::memcmp(out.data(), raw.data(), raw.size()) == 0, "codec_bench: ", label,
                  " did not round-trip");
  volatile uint64_t sink = 0;
  double sum = seconds_of([&] { sink = sink + codec::checksum(out); }, 5);
  const double gb = static_cast<double>(raw.size()) / 1e9;
  std::printf("| %s | %s | %.1f | %.4f | %.2f | %.2f | %.1f |\n", label.c_str(), codec::name(dtype),
              raw.size() / 1e6, static_cast<double>(raw.size()) / block.size(), gb / enc, gb / dec,
              gb / sum);
}

} // namespace

int main(int argc, char** argv) {
  codec::DType dtype = codec::DType::bf16;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dtype" && i + 1 < argc) {
      std::string d = argv[++i];
      dtype = d == "fp32"   ? codec::DType::fp32
              : d == "fp16" ? codec::DType::fp16
              : d == "fp8"  ? codec::DType::fp8
                            : codec::DType::bf16;
    } else {
      files.push_back(a);
    }
  }
  std::printf("| weights | dtype | MB | ratio | encode GB/s | decode GB/s | checksum GB/s |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  try {
    if (files.empty()) {
      // 32 M values of normal(0, 0.02) in each dtype (bf16 and fp8 e4m3 by truncation).
      std::mt19937 rng(0);
      std::normal_distribution<float> normal(0.0f, 0.02f);
      std::vector<uint32_t> values(32u << 20);
      for (uint32_t& v : values) {
        float f = normal(rng);
        std::memcpy(&v, &f, 4);
      }
      for (codec::DType d :
           {codec::DType::bf16, codec::DType::fp16, codec::DType::fp32, codec::DType::fp8}) {
        const int w = codec::width(d);
        std::vector<std::byte> raw(values.size() * w);
        for (size_t i = 0; i < values.size(); ++i) {
          const uint32_t u = values[i];
          uint32_t v = u;
          if (d == codec::DType::bf16) v = u >> 16;
          if (d == codec::DType::fp16) {
            float f;
            std::memcpy(&f, &u, 4);
            const _Float16 h = static_cast<_Float16>(f);
            uint16_t bits;
            std::memcpy(&bits, &h, 2);
            v = bits;
          }
          if (d == codec::DType::fp8) {
            const int e = std::clamp(static_cast<int>((u >> 23) & 0xFF) - 127 + 7, 0, 15);
            v = ((u >> 24) & 0x80) | (e << 3) | ((u >> 20) & 7);
          }
          std::memcpy(raw.data() + i * w, &v, w); // little-endian: the low bytes
        }
        measure("synthetic normal(0, 0.02)", raw, d);
      }
    }
    for (const std::string& f : files) {
      std::ifstream in(f, std::ios::binary);
      BLOCKSWAP_CHECK(in, "codec_bench: cannot open ", f);
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
      std::vector<std::byte> raw(bytes.size());
      std::memcpy(raw.data(), bytes.data(), bytes.size());
      measure(f.substr(f.find_last_of('/') + 1), raw, dtype);
    }
  } catch (const blockswap::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
