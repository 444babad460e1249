// Compressed weights in the model of time (DESIGN.md section 6: "compressed bytes divide the
// link and disk terms by the ratio and add a decode term"): the simulator and T* with
// BlockTiming::compressed_bytes and LinkModel::decode_bytes_per_second, held to the engine on the
// timed device (EngineOptions::modelled_compressed_bytes); a link-bound step is faster by about
// the ratio (the decodes run on their own stream, beside the copies), a compute-bound one no
// slower; with the decodes on the copy stream (LinkModel::decode_stream false) both agree too.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/file_source.hpp"
#include "blockswap/core/simulator.hpp"
#include "blockswap/device/timed.hpp"

namespace blockswap {
namespace {

constexpr int64_t kBlocks = 12;
constexpr std::size_t kBytes = 64 << 20; // a block
constexpr double kRatio = 1.5;           // bf16 weights (docs/performance.md)

LinkModel link(bool decode_stream = true) {
  LinkModel l;
  l.bytes_per_second = 25e9;
  l.latency_seconds = 5e-6;
  l.decode_bytes_per_second = 300e9; // a GPU decoder
  l.decode_stream = decode_stream;
  return l;
}

BlockTiming timing(double copy_over_compute, bool compressed) {
  BlockTiming t = uniform_timing(kBlocks, link().seconds(kBytes) / copy_over_compute, kBytes);
  if (compressed) t.compressed_bytes.assign(kBlocks, std::size_t(double(kBytes) / kRatio));
  return t;
}

// The engine's step on the timed device, its frozen bytes modelled compressed as `t` says.
double timed_step(const Schedule& schedule, const BlockTiming& t, bool training,
                  const LinkModel& l = link()) {
  auto device = std::make_shared<TimedDevice>(TimedDeviceOptions{l});
  EngineOptions o;
  o.blocks_to_swap = schedule.blocks_to_swap();
  o.supports_backward = training;
  o.trainable_bytes.assign(kBlocks, 0); // LoRA: the adapters stay on the device
  if (!t.compressed_bytes.empty()) {
    o.compress = Compress::on;
    o.modelled_compressed_bytes = t.compressed_bytes;
  }
  Engine engine(device, t.bytes, o);
  engine.set_forward_only(!training);
  engine.compress();
  EXPECT_EQ(engine.compression().blocks, t.compressed_bytes.empty() ? 0 : kBlocks);
  const TimedList list{&engine, &t};
  return time_step(*device, std::span(&list, 1)).step_seconds;
}

// Also with a decoder slower than the link (20 GB/s of decoded bytes: the decode stream binds),
// and with the decodes on the copy stream.
TEST(CompressedTiming, SimulatorAndTimedDeviceAgreeAndTheBoundHolds) {
  for (bool training : {false, true}) {
    const Schedule schedule({kBlocks, 6, training ? Mode::training : Mode::forward_only});
    for (double decode_gbps : {300.0, 20.0}) {
      for (bool decode_stream : {true, false}) {
        LinkModel l = link(decode_stream);
        l.decode_bytes_per_second = decode_gbps * 1e9;
        for (double ratio : {0.5, 1.0, 2.0, 8.0}) {
          const BlockTiming t = timing(ratio, true);
          const double simulated = simulate(schedule, t, l).step_seconds;
          const double timed = timed_step(schedule, t, training, l);
          EXPECT_NEAR(timed / simulated, 1.0, 0.03)
              << "training " << training << " copy/compute " << ratio << " decode " << decode_gbps
              << " GB/s, decode stream " << decode_stream;
          EXPECT_LE(step_bound(schedule, t, l), simulated * (1 + 1e-9))
              << "training " << training << " copy/compute " << ratio << " decode " << decode_gbps
              << " GB/s, decode stream " << decode_stream;
        }
      }
    }
  }
}

TEST(CompressedTiming, ALinkBoundStepIsFasterByAboutTheRatioAComputeBoundOneNoSlower) {
  for (bool training : {false, true}) {
    const Schedule schedule({kBlocks, 6, training ? Mode::training : Mode::forward_only});
    // Link-bound, compressed or not: a pass's loads (inference K+R = 8, training 2K = 12) over
    // the ratio still take longer than its computes (12 forwards; training 36 forwards' worth).
    const double link_bound = training ? 8.0 : 4.0; // a block's copy over its forward
    const double raw = timed_step(schedule, timing(link_bound, false), training);
    const double compressed = timed_step(schedule, timing(link_bound, true), training);
    // Faster by the ratio of a copy's time, the raw bytes' against the compressed ones' (1.50
    // here): each decode runs beside the next load's copy; less the computes no load hides.
    const std::size_t compressed_bytes = std::size_t(double(kBytes) / kRatio);
    const double copy_ratio = link().seconds(kBytes) / link().seconds(compressed_bytes);
    EXPECT_GT(raw / compressed, 0.95 * copy_ratio) << "training " << training;
    EXPECT_LE(raw / compressed, copy_ratio * 1.01) << "training " << training;
    // The decodes on the copy stream (a backend without a decode stream): a load costs its copy
    // and its decode in series (1.39 here), as blockswap did before the decode stream.
    const double serial =
        timed_step(schedule, timing(link_bound, true), training, link(/*decode_stream=*/false));
    const double load_ratio =
        link().seconds(kBytes) / (link().seconds(compressed_bytes) + link().decode_seconds(kBytes));
    EXPECT_GT(raw / serial, 0.92 * load_ratio) << "training " << training;
    EXPECT_LE(raw / serial, load_ratio * 1.01) << "training " << training;
    EXPECT_LT(compressed, serial * 0.95) << "training " << training;
    // Compute-bound: the copies take a quarter of the computes; the decode hides too.
    const double raw_cb = timed_step(schedule, timing(0.25, false), training);
    const double compressed_cb = timed_step(schedule, timing(0.25, true), training);
    EXPECT_LE(compressed_cb, raw_cb * 1.01) << "training " << training;
  }
}

TEST(CompressedTiming, SizesAreCheckedAndASlowDecoderCosts) {
  const Schedule schedule({kBlocks, 6, Mode::forward_only});
  BlockTiming t = timing(2.0, true);
  t.compressed_bytes.pop_back();
  EXPECT_THROW(simulate(schedule, t, link()), Error);
  LinkModel negative = link();
  negative.decode_bytes_per_second = -1;
  EXPECT_THROW(simulate(schedule, timing(2.0, true), negative), Error);
  // A decoder at the link's speed: every load costs its copy and as long again to decode.
  LinkModel slow = link();
  slow.decode_bytes_per_second = slow.bytes_per_second;
  EXPECT_GT(simulate(schedule, timing(2.0, true), slow).step_seconds,
            simulate(schedule, timing(2.0, false), link()).step_seconds);
}

// The timed device's staging reader models a block staged from host memory by its bytes: given
// its compressed bytes' place (StagingReader::repoint, as LoadPipeline::compress does for a
// pageable block), its reads take their size, and a block in the file cannot be given one.
TEST(CompressedTiming, TheTimedReaderModelsAStagedBlockAtItsCompressedSize) {
  TimedDeviceOptions options;
  options.link = link();
  options.link.disk_bytes_per_second = 5e9;
  auto device = std::make_shared<TimedDevice>(options);
  Buffer host = device->allocate_host(kBytes);
  StagingSpec spec{
      {}, {FileBlock{{}, kBytes, host.data()}, FileBlock{{}, kBytes, nullptr}}, {}, "timed"};
  spec.staging.push_back(std::make_shared<Buffer>(device->allocate_host(kBytes)));
  const std::unique_ptr<StagingReader> reader = device->make_staging_reader(std::move(spec));
  auto read = [&] {
    reader->request(0);
    reader->release(reader->next());
  };
  read();
  EXPECT_EQ(reader->bytes_read(), kBytes);
  const auto compressed = std::size_t(double(kBytes) / kRatio);
  reader->repoint(0, host.data(), compressed);
  read();
  EXPECT_EQ(reader->bytes_read(), kBytes + compressed);
  EXPECT_THROW(reader->repoint(1, host.data(), compressed), Error);
}

} // namespace
} // namespace blockswap
