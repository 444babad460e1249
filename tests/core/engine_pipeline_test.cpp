// A pipeline stage's engine: micro-batches whose forwards and backwards come in a pipeline
// schedule's order (GPipe, 1F1B), every backward in the slot its own forward ran in, and the
// loads the schedule predicts (Schedule::loads, Note [training rotation] in schedule.cpp).
#include <gtest/gtest.h>

#include <deque>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/schedule.hpp"
#include "engine_fakes.hpp"

namespace blockswap {
namespace {

// Plays `halves` (a forward per micro-batch, then its backward, oldest first as both schedules
// do) on `engine`; false when a backward found the wrong weights or another slot.
bool play(Engine& engine, const FakeModel& model, const std::vector<Op::Kind>& halves) {
  std::deque<Graph> pending;
  for (const Op::Kind half : halves) {
    if (half == Op::Kind::forward) {
      engine.prepare();
      pending.push_back(forward_recording(engine, model));
      continue;
    }
    if (!backward_from(engine, model, pending.front(), engine.blocks() - 1)) return false;
    pending.pop_front();
  }
  return !::testing::Test::HasFailure();
}

std::size_t block_bytes(const FakeModel& model) {
  return model.floats[0] * sizeof(float);
}

TEST(EnginePipeline, EveryStageOfGPipeAnd1F1BLoadsWhatTheScheduleSays) {
  for (const PipelineSchedule kind : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
    for (int64_t n : {6, 9}) {
      for (int64_t k = 1; k < n; ++k) {
        for (int64_t r = 0; r <= n - k; ++r) {
          const FakeModel model = uniform(n, 256);
          Engine engine(
              slow_device(16), model.bytes(),
              {.blocks_to_swap = k, .supports_backward = true, .training_rotating_slots = r});
          model.fill(engine);
          engine.prepare();
          const Schedule& schedule = engine.schedule();
          for (int64_t stage = 0; stage < 4; ++stage) {
            const auto halves = pipeline_halves(kind, 4, stage, 5);
            engine.reset_stats();
            ASSERT_TRUE(play(engine, model, halves))
                << to_string(kind) << " " << schedule.describe() << " stage " << stage;
            EXPECT_EQ(engine.stats().h2d_bytes, schedule.loads(halves) * block_bytes(model))
                << to_string(kind) << " " << schedule.describe() << " stage " << stage;
          }
        }
      }
    }
  }
}

// Both sides of the trade: the seed's layout reloads K blocks at each turn of the warm-up and
// the cool-down, R rotating slots reload R; each micro-batch alone still loads 2K.
TEST(EnginePipeline, RotatingSlotsCutTheReloadsOfTheWarmUpAndCoolDown) {
  const int64_t n = 12, k = 6, stages = 4, micro_batches = 8;
  const FakeModel model = uniform(n, 256);
  for (int64_t r : {0, 1, 2}) {
    Engine engine(slow_device(16), model.bytes(),
                  {.blocks_to_swap = k, .supports_backward = true, .training_rotating_slots = r});
    model.fill(engine);
    engine.prepare();
    const int64_t turns_r = r == 0 ? k : r;
    EXPECT_EQ(engine.schedule().rotating_slots(), turns_r);
    for (int64_t stage = 0; stage < stages; ++stage) {
      const auto halves =
          pipeline_halves(PipelineSchedule::one_f_one_b, stages, stage, micro_batches);
      const int64_t turns = stages - stage - 1; // forwards in a row, then backwards in a row
      engine.reset_stats();
      ASSERT_TRUE(play(engine, model, halves)) << "R=" << r << " stage " << stage;
      EXPECT_EQ(engine.stats().h2d_bytes / block_bytes(model),
                2 * k * micro_batches + 2 * turns * turns_r)
          << "R=" << r << " stage " << stage;
    }
  }
}

// A forward after a forward, then the backwards in the other order than the pipelines' (the
// newest first): still every block in its slot, only more loads.
TEST(EnginePipeline, BackwardsInAnyOrderOfMicroBatchesAreExact) {
  for (int64_t r : {0, 1, 2}) {
    const FakeModel model = uniform(9, 256);
    Engine engine(slow_device(16), model.bytes(),
                  {.blocks_to_swap = 4, .supports_backward = true, .training_rotating_slots = r});
    model.fill(engine);
    std::vector<Graph> graphs;
    for (int i = 0; i < 3; ++i) {
      engine.prepare();
      graphs.push_back(forward_recording(engine, model));
    }
    for (int i = 2; i >= 0; --i) {
      EXPECT_TRUE(backward_from(engine, model, graphs[i], 8)) << "R=" << r << " mb " << i;
    }
    EXPECT_TRUE(backward_from(engine, model, graphs[0], 3)) << "R=" << r << " again, part";
  }
}

} // namespace
} // namespace blockswap
