// The engine's own cost per block operation (Google Benchmark), with nothing to wait for.
//
//   build/bench/engine_bench
//
// A no-op backend isolates the engine (schedule lookup, residency table, events); the same
// loop on the emulated device adds its copy thread's hand-off.
#include <benchmark/benchmark.h>

#include <cstring>

#include "blockswap/core/engine.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

// Copies complete as they are enqueued and events are always complete: only the engine's
// bookkeeping is left to measure.
class InstantBackend final : public Backend {
public:
  std::string name() const override { return "instant"; }
  Buffer allocate_host(std::size_t bytes) override { return allocate(bytes); }
  Buffer allocate_device(std::size_t bytes) override { return allocate(bytes); }
  void copy_to_device(std::byte*, const std::byte*, std::size_t, int64_t) override {}
  void copy_to_host(std::byte*, const std::byte*, std::size_t, int64_t) override {}
  void set_copy_observer(CopyObserver) override {}
  void poison(std::byte*, std::size_t) override {}
  std::unique_ptr<Event> make_event() override { return std::make_unique<Event>(); }
  void record(Event&, Stream) override {}
  void wait(Stream, const Event&) override {}
  void synchronize(const Event&) override {}
  MemoryStats memory() const override { return {}; }

private:
  static Buffer allocate(std::size_t bytes) {
    return Buffer(new std::byte[std::max<std::size_t>(bytes, 1)], bytes,
                  [](std::byte* p, std::size_t) { delete[] p; });
  }
};

void BM_ScheduleLookup(benchmark::State& state) {
  const Schedule schedule({24, 6, Mode::forward_only});
  int64_t block = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(schedule.after_forward(block).size());
    block = (block + 1) % 24;
  }
}
BENCHMARK(BM_ScheduleLookup);

// One block of a forward-only pass, N=24, K=6: wait for it, then its moves (8 of 24 blocks
// move). Items are blocks.
template <typename MakeBackend> void pass_loop(benchmark::State& state, MakeBackend make) {
  Engine engine(make(), std::vector<std::size_t>(24, 256), {.blocks_to_swap = 6});
  engine.prepare();
  int64_t block = 0;
  for (auto _ : state) {
    engine.wait_for_block(block);
    engine.after_forward(block);
    block = (block + 1) % 24;
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_EngineBlock_Instant(benchmark::State& state) {
  pass_loop(state, [] { return std::make_shared<InstantBackend>(); });
}
BENCHMARK(BM_EngineBlock_Instant);

void BM_EngineSubmit_Instant(benchmark::State& state) {
  // after_forward alone, on a block that moves: the cost of one move.
  Engine engine(std::make_shared<InstantBackend>(), std::vector<std::size_t>(2, 256),
                {.blocks_to_swap = 1, .rotating_slots = 1});
  engine.prepare();
  int64_t block = 0;
  for (auto _ : state) {
    engine.wait_for_block(block);
    engine.after_forward(block); // N=2, K=1: every block moves
    block ^= 1;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_EngineSubmit_Instant);

void BM_EngineWaitReady(benchmark::State& state) {
  Engine engine(std::make_shared<InstantBackend>(), std::vector<std::size_t>(4, 256), {});
  engine.prepare();
  for (auto _ : state) engine.wait_for_block(2); // ready: returns at once
}
BENCHMARK(BM_EngineWaitReady);

void BM_EngineBlock_Emulated(benchmark::State& state) {
  pass_loop(state, [] { return std::make_shared<EmulatedDevice>(); });
}
BENCHMARK(BM_EngineBlock_Emulated);

} // namespace
} // namespace blockswap

BENCHMARK_MAIN();
