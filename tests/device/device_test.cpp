#include "blockswap/device/device.hpp"

#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "blockswap/core/engine.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"
#include "blockswap/device/timed.hpp"

namespace blockswap {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Device, OpensByNameAndNamesTheDevicesThisBuildHas) {
  EXPECT_EQ(Device::open("emulated")->name(), "emulated");
  EXPECT_EQ(Device::open("cpu")->name(), "emulated");
  EXPECT_FALSE(Device::open("emulated")->is_cuda());
  EXPECT_TRUE(Device::present("emulated"));
  const std::string e = error_of([] { Device::open("tpu"); });
  EXPECT_NE(e.find("device 'tpu' is not one this build of blockswap has (emulated"),
            std::string::npos)
      << e;
  if (!Device::present("cuda")) {
    EXPECT_THROW(Device::open("cuda:0"), Error); // no GPU here, or no CUDA in this build
  }
  EXPECT_THROW(Device::open("cuda:x"), Error);
  if (Device::kinds() == std::vector<std::string>{"emulated"}) {
    // A build without the CUDA backend says why and what to do, not only that it lacks it.
    const std::string cuda = error_of([] { Device::open("cuda"); });
    EXPECT_NE(cuda.find("built without its CUDA backend"), std::string::npos) << cuda;
    EXPECT_NE(cuda.find("docs/build.md"), std::string::npos) << cuda;
    EXPECT_EQ(e.find("CUDA backend"), std::string::npos) << e;
  }
}

TEST(Device, EmulatedOptionsReachTheBackend) {
  auto device = Device::open("emulated", {.emulated_capacity_bytes = 4096});
  auto backend = device->attach("blocks");
  EXPECT_EQ(device->memory().device_capacity, 4096u);
  EXPECT_THROW(backend->allocate_device(8192), OutOfMemory);
  EXPECT_EQ(device->memory().device_bytes, 0u); // a failed allocation holds nothing
}

TEST(Device, ThePinningCapIsTheEmulatedDevicesAlone) {
  auto device = Device::open("emulated", {.emulated_pinnable_bytes = 0});
  EXPECT_TRUE(device->attach("blocks")->allocate_host(64).pageable());
  EXPECT_FALSE(Device::open("emulated")->attach("blocks")->allocate_host(64).pageable());
  EXPECT_THROW(Device::open("cuda", {.emulated_pinnable_bytes = 0}), InvalidArgument);
  EXPECT_THROW(Device::open("cuda", {.emulated_link_gbps = 1}), InvalidArgument);
}

// The budget is for every attached engine together; each one's memory() is its own.
TEST(Device, TheBudgetBindsEveryAttachedBackendTogether) {
  auto device = Device::open("emulated", {.budget_bytes = 3000});
  auto a = device->attach("double_blocks");
  auto b = device->attach("single_blocks");
  Buffer a1 = a->allocate_device(1000);
  Buffer b1 = b->allocate_device(1500);
  EXPECT_EQ(device->available_bytes(), 500u);
  const std::string e = error_of([&] { b->allocate_device(600); });
  EXPECT_NE(
      e.find("[single_blocks] emulated: a slot of 600 bytes does not fit the device budget "
             "of 3000 bytes; held now: 2500 bytes (double_blocks: 1000, single_blocks: 1500)"),
      std::string::npos)
      << e;
  EXPECT_EQ(a->memory().device_bytes, 1000u);
  EXPECT_EQ(b->memory().device_bytes, 1500u);
  EXPECT_EQ(device->memory().device_bytes, 2500u);
  b1.reset();
  EXPECT_EQ(device->available_bytes(), 2000u);
  Buffer b2 = b->allocate_device(2000);
  EXPECT_EQ(device->memory().peak_device_bytes, 3000u);
  EXPECT_EQ(b->memory().peak_device_bytes, 2000u);
  EXPECT_EQ(Device::open("emulated")->available_bytes(), SIZE_MAX); // no budget
}

// Memory outlives the attached backend and the device that made it.
TEST(Device, BuffersOutliveTheirDevice) {
  Buffer kept;
  {
    auto device = Device::open("emulated", {.budget_bytes = 1 << 20});
    kept = device->attach("blocks")->allocate_device(4096);
  }
  std::fill_n(kept.data(), kept.size(), std::byte{1});
  kept.reset();
}

// Every attached backend copies on the device's one copy stream, in the order enqueued, and
// each observer sees only its own copies, with its own tags.
TEST(Device, CopiesOfEveryAttachedBackendFormOneQueue) {
  auto device = Device::open("emulated", {.emulated_link_gbps = 1});
  auto a = device->attach("a");
  auto b = device->attach("b");
  std::mutex mutex;
  std::vector<std::pair<char, int64_t>> seen;
  std::vector<CopyRecord> records;
  auto observer = [&](char who) {
    return [&, who](const CopyRecord& copy) {
      std::lock_guard lock(mutex);
      seen.emplace_back(who, copy.tag);
      records.push_back(copy);
    };
  };
  a->set_copy_observer(observer('a'));
  b->set_copy_observer(observer('b'));
  Buffer host = a->allocate_host(1 << 16);
  Buffer da = a->allocate_device(1 << 16), db = b->allocate_device(1 << 16);
  for (int64_t i = 0; i < 3; ++i) {
    a->copy_to_device(da.data(), host.data(), host.size(), i);
    b->copy_to_device(db.data(), host.data(), host.size(), 10 + i);
  }
  b->copy_to_host(host.data(), db.data(), host.size(), -1);
  auto done = b->make_event();
  b->record(*done, Stream::copy);
  a->synchronize(*done); // one stream: a's view waits for b's copies too
  const std::vector<std::pair<char, int64_t>> expected{{'a', 0}, {'b', 10}, {'a', 1}, {'b', 11},
                                                       {'a', 2}, {'b', 12}, {'b', -1}};
  EXPECT_EQ(seen, expected);
  for (std::size_t i = 1; i < records.size(); ++i) {
    EXPECT_LE(records[i - 1].end, records[i].start) << "copies " << i - 1 << " and " << i;
  }
  a->set_copy_observer(nullptr);
  a->copy_to_device(da.data(), host.data(), host.size(), 5);
  a->synchronize(*done);
  auto last = a->make_event();
  a->record(*last, Stream::copy);
  a->synchronize(*last);
  EXPECT_EQ(seen.size(), expected.size()); // a no longer observes
}

// An engine sees through attach() whether the device times events, and times them: stalls are
// measured on the device (docs/performance.md, "Stalls on a GPU") through a shared Device too.
TEST(Device, AttachedBackendsTimeEventsWhereTheDeviceDoes) {
  auto timed = std::make_shared<TimedDevice>(TimedDeviceOptions{.link = {1e9}});
  Device device(timed);
  const std::shared_ptr<Backend> attached = device.attach("a");
  EXPECT_TRUE(attached->times_events());
  const auto start = attached->make_timed_event(), end = attached->make_timed_event();
  attached->record(*start, Stream::compute);
  timed->compute(0.25);
  attached->record(*end, Stream::compute);
  attached->synchronize(*end);
  const std::optional<double> seconds = attached->elapsed_seconds(*start, *end);
  ASSERT_TRUE(seconds.has_value());
  EXPECT_NEAR(*seconds, 0.25, 1e-3); // the modelled link's latency and the host's slack
  const auto untimed = attached->make_event();
  attached->record(*untimed, Stream::compute);
  EXPECT_NE(
      error_of([&] { (void)attached->elapsed_seconds(*start, *untimed); }).find("make_timed_event"),
      std::string::npos);
  EXPECT_FALSE(Device::open("emulated")->attach("b")->times_events());
}

// EngineOptions::slots_at_construction = false: the slots come with allocate_slots() (the front
// end packs a model on the GPU first, Note [slots after packing]); once there, it does nothing.
TEST(Device, AnEngineCanAllocateItsSlotsAfterConstruction) {
  auto device = Device::open("emulated", {.budget_bytes = 3 * 256});
  Engine engine(device->attach("late"), std::vector<std::size_t>(5, 256),
                {.blocks_to_swap = 2, .slots_at_construction = false});
  EXPECT_EQ(device->memory().device_bytes, 0u);
  for (int64_t b = 0; b < engine.blocks(); ++b) {
    std::fill_n(engine.host_data(b), engine.block_bytes(b), std::byte(b + 1));
  }
  engine.allocate_slots();
  EXPECT_EQ(device->memory().device_bytes, 3u * 256);
  engine.allocate_slots();
  EXPECT_EQ(device->memory().device_bytes, 3u * 256);
  engine.prepare();
  for (int64_t b = 0; b < engine.blocks(); ++b) {
    const Entered entered = engine.enter(b);
    EXPECT_EQ(entered.slot->data()[0], std::byte(b + 1)) << "block " << b;
    engine.leave(b);
  }
  // A budget the slots do not fit: an engine that waits still throws, at allocate_slots.
  Engine over(device->attach("over"), std::vector<std::size_t>(5, 256),
              {.blocks_to_swap = 2, .slots_at_construction = false});
  const std::string e = error_of([&] { over.allocate_slots(); });
  EXPECT_NE(e.find("does not fit the device budget"), std::string::npos) << e;
}

// Two engines on one device: each runs its schedule exactly, their slots count together.
TEST(Device, TwoEnginesShareOneDevice) {
  auto device = Device::open("emulated", {.budget_bytes = 5 * 256});
  Engine first(device->attach("first"), std::vector<std::size_t>(4, 256), {.blocks_to_swap = 2});
  Engine second(device->attach("second"), std::vector<std::size_t>(5, 200), {.blocks_to_swap = 2});
  EXPECT_EQ(device->memory().device_bytes, 5u * 256);
  for (Engine* engine : {&first, &second}) {
    for (int64_t b = 0; b < engine->blocks(); ++b) {
      std::fill_n(engine->host_data(b), engine->block_bytes(b), std::byte(b + 1));
    }
    engine->prepare();
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (Engine* engine : {&first, &second}) {
      for (int64_t b = 0; b < engine->blocks(); ++b) {
        const Entered entered = engine->enter(b);
        EXPECT_EQ(entered.slot->data()[0], std::byte(b + 1)) << engine->label() << " " << b;
        EXPECT_EQ(entered.slot->data()[engine->block_bytes(b) - 1], std::byte(b + 1));
        engine->leave(b);
      }
    }
    first.prepare();
    second.prepare();
  }
  EXPECT_EQ(first.stats().moves + second.stats().moves, 2u * (2 + 2) * 2);
  const std::string e = error_of([&] { first.disable(), first.prepare(); });
  EXPECT_NE(e.find("does not fit the device budget"), std::string::npos) << e;
}

// Offloaded activations copy on torch's streams, outside the attached engines: the Device counts
// their bytes (TransferStats), apart from the slots' account and budget.
TEST(Device, CountsTransfersThatAreNotBlockWeights) {
  Device device(std::make_shared<EmulatedDevice>(), 1000);
  EXPECT_EQ(device.transfers().host_bytes, 0u);
  device.count_d2h(300);
  device.count_d2h(200);
  device.count_h2d(300);
  device.count_host_freed(300);
  const TransferStats t = device.transfers();
  EXPECT_EQ(t.bytes_d2h, 500u);
  EXPECT_EQ(t.bytes_h2d, 300u);
  EXPECT_EQ(t.host_bytes, 200u);
  EXPECT_EQ(t.peak_host_bytes, 500u);
  EXPECT_EQ(device.memory().device_bytes, 0u); // not the slots' memory
  EXPECT_EQ(device.available_bytes(), 1000u);
  device.count_host_freed(200);
  EXPECT_EQ(device.transfers().host_bytes, 0u);
}

} // namespace
} // namespace blockswap
