// Compressed weights on the timed device (issue 45): the real engine's step with every block in
// host memory compressed (EngineOptions::compress, its sizes modelled at a ratio) against the
// same step raw, against the new bound T* and the simulator's prediction, for the FLUX and Wan
// 14B shapes, inference and training, half the blocks swapped and all but two, copy/compute
// ratios 0.5-2 (a block's forward is its raw
// copy's time over the ratio), a link of 25 GB/s, with every swapped block in host memory and
// with the file tier (half of them read from a 7 GB/s disk, which stays raw). The compressed
// step twice: with the decodes on their own stream (blockswap now), and on the copy stream, in
// series with the copies (LinkModel::decode_stream false: blockswap before its decode stream).
// Device time: the same figures on any machine.
//
//   build/bench/compressed_step_bench              # ratio 1.40 (trained bf16), decode 200 GB/s
//   build/bench/compressed_step_bench 1.5 600      # another ratio and decode GB/s
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/device/timed.hpp"

namespace {

using namespace blockswap;

struct Shape {
  std::string name;
  std::vector<int64_t> blocks;
  std::vector<std::size_t> bytes;
};

struct Row {
  double measured = 0, predicted = 0, bound = 0;
  int64_t compressed = 0, in_file = 0;
};

// One step of `shape`, K per list; `held`: the share of each list's moved blocks in host memory
// (the rest read from the file; 1: no file tier); `ratio` > 1: those in host memory compressed.
Row run(const Shape& shape, const std::vector<int64_t>& ks, Mode mode, double copy_compute,
        double held, double ratio, const LinkModel& link) {
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = link});
  Device device(timed);
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<BlockTiming> timings;
  Row row;
  for (std::size_t l = 0; l < shape.blocks.size(); ++l) {
    const int64_t n = shape.blocks[l];
    const std::size_t bytes = shape.bytes[l];
    const std::size_t compressed = static_cast<std::size_t>(double(bytes) / ratio);
    EngineOptions options{.blocks_to_swap = ks[l], .supports_backward = mode == Mode::training};
    options.trainable_bytes.assign(static_cast<std::size_t>(n), 0); // LoRA: adapters stay
    if (held < 1) {
      const Schedule probe({n, ks[l], mode});
      std::vector<bool> moves(static_cast<std::size_t>(n), false);
      int64_t moved = 0;
      for (const Op& op : probe.pass()) {
        if (op.kind == Op::Kind::move && !moves[op.move.in]) {
          moves[op.move.in] = true;
          ++moved;
        }
      }
      const auto budget = static_cast<std::size_t>(held * double(moved)) * bytes;
      options.file = FileTier{{},
                              std::vector<FileBlock>(n, FileBlock{{}, bytes, nullptr}),
                              budget,
                              link.staging_buffers,
                              CacheBypass::direct};
    }
    if (ratio > 1) {
      options.compress = Compress::on;
      options.modelled_compressed_bytes.assign(static_cast<std::size_t>(n), compressed);
    }
    engines.push_back(std::make_unique<Engine>(
        device.attach(shape.name), std::vector<std::size_t>(n, bytes), options, shape.name));
    engines.back()->compress();
    BlockTiming timing = uniform_timing(n, link.seconds(bytes) / copy_compute, bytes, 2.0);
    for (int64_t b = 0; b < n; ++b) {
      timing.from_file.push_back(engines.back()->in_file(b));
      row.in_file += engines.back()->in_file(b) ? 1 : 0;
    }
    if (ratio > 1) timing.compressed_bytes.assign(static_cast<std::size_t>(n), compressed);
    row.compressed += engines.back()->compression().blocks;
    timings.push_back(std::move(timing));
  }
  std::vector<TimedList> lists;
  std::vector<SimulatedList> simulated;
  for (std::size_t l = 0; l < engines.size(); ++l) {
    lists.push_back({engines[l].get(), &timings[l]});
    simulated.push_back({&engines[l]->schedule(), &timings[l]});
  }
  const Simulation predicted = simulate(simulated, link);
  const TimedStep step = time_step(*timed, lists, predicted.warmup_passes);
  row.measured = step.step_seconds;
  row.predicted = predicted.step_seconds;
  row.bound = step_bound(simulated, link);
  return row;
}

} // namespace

int main(int argc, char** argv) {
  const double ratio = argc > 1 ? std::atof(argv[1]) : 1.40;
  const double decode_gbps = argc > 2 ? std::atof(argv[2]) : 200;
  if (!(ratio > 1) || !(decode_gbps > 0)) {
    std::fprintf(stderr, "usage: compressed_step_bench [RATIO > 1] [DECODE_GBPS > 0]\n");
    return 2;
  }
  LinkModel link{25e9, 5e-6, 7e9, 2};
  link.decode_bytes_per_second = decode_gbps * 1e9;
  const std::vector<Shape> shapes = {
      {"flux", {19, 38}, {339'600'000 * 2, 141'600'000 * 2}},
      {"wan14b", {40}, {351'000'000 * 2}},
  };
  std::printf("ratio %.2f, decode %g GB/s, link 25 GB/s, disk 7 GB/s\n\n", ratio, decode_gbps);
  LinkModel serial = link;
  serial.decode_stream = false;
  std::printf("| model | mode | K | copy/compute | moved blocks in host memory | step raw (s) | "
              "step compressed (s) | raw / compressed | raw / compressed, decodes on the copy "
              "stream | T* compressed (s) | step / T* | predicted / step |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& shape : shapes) {
    for (Mode mode : {Mode::forward_only, Mode::training}) {
      const int64_t n = shape.blocks[0];
      for (const int64_t k : {n / 2, n - 2}) { // half the blocks swapped; all but two
        std::vector<int64_t> ks;
        for (int64_t blocks : shape.blocks) ks.push_back(k * blocks / n);
        for (double held : {1.0, 0.5}) {
          for (double copy_compute : {0.5, 1.0, 1.5, 2.0}) {
            const Row raw = run(shape, ks, mode, copy_compute, held, 1.0, link);
            const Row c = run(shape, ks, mode, copy_compute, held, ratio, link);
            const Row s = run(shape, ks, mode, copy_compute, held, ratio, serial);
            std::printf("| %s | %s | %lld | %g | %.0f %% | %.3f | %.3f | %.3f | %.3f | %.3f | "
                        "%.3f | %.3f |\n",
                        shape.name.c_str(), mode == Mode::training ? "train" : "infer",
                        static_cast<long long>(k), copy_compute, held * 100, raw.measured,
                        c.measured, raw.measured / c.measured, raw.measured / s.measured, c.bound,
                        c.measured / c.bound, c.predicted / c.measured);
            std::fflush(stdout);
          }
        }
      }
    }
  }
}
