#include "blockswap/core/host_store.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

std::shared_ptr<Backend> device() {
  return std::make_shared<EmulatedDevice>();
}

void fill(const HostRegion& region, std::size_t bytes, unsigned char value) {
  std::memset(region.data(), value, bytes);
}

bool all(const std::byte* data, std::size_t bytes, unsigned char value) {
  for (std::size_t i = 0; i < bytes; ++i) {
    if (data[i] != std::byte(value)) return false;
  }
  return true;
}

TEST(HostStore, EachBlockHasItsOwnBufferAndLoadsItWhole) {
  const HostStore store(device(), {100, 300, 200}, {}, {}, "blocks");
  ASSERT_EQ(store.blocks(), 3);
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_GE(store.buffer(b)->size(), store.bytes(b));
    EXPECT_EQ(store.trainable_bytes(b), store.bytes(b)); // no split given: all may change
    const HostStore::Source source = store.load_source(b);
    EXPECT_TRUE(source.contiguous());
    EXPECT_EQ(source.frozen, store.buffer(b)->data());
    EXPECT_EQ(store.trainable(b).data(), store.buffer(b)->data());
  }
  EXPECT_NE(store.buffer(0)->data(), store.buffer(1)->data());
}

// Note [atomic write-back]: the write-back goes to the region that is not authoritative; loads
// read it while it is pending; commit makes it authoritative, and the next one goes back to the
// first region; drop leaves the values from before.
TEST(HostStore, WriteBacksAlternateBetweenTwoRegionsAndDropKeepsTheOldValues) {
  HostStore store(device(), {96}, {32}, {}, "blocks");
  EXPECT_EQ(store.frozen_bytes(0), 64u);
  const HostRegion packed = store.trainable(0);
  EXPECT_EQ(packed.data(), store.buffer(0)->data() + 64);
  fill(packed, 32, 1);

  const HostRegion first = store.begin_write_back(0).target;
  EXPECT_NE(first.data(), packed.data());
  EXPECT_TRUE(store.pending(0));
  fill(first, 32, 2);
  EXPECT_EQ(store.trainable(0).data(), packed.data()); // not authoritative before commit
  const HostStore::Source pending = store.load_source(0);
  EXPECT_FALSE(pending.contiguous());
  EXPECT_EQ(pending.frozen, store.buffer(0)->data());
  EXPECT_EQ(pending.frozen_bytes, 64u);
  EXPECT_EQ(pending.trainable, first.data()); // the freshest bytes
  EXPECT_EQ(pending.trainable_bytes, 32u);

  EXPECT_EQ(store.commit(0).data(), first.data());
  EXPECT_FALSE(store.pending(0));
  EXPECT_TRUE(all(store.trainable(0).data(), 32, 2));

  const HostRegion second = store.begin_write_back(0).target;
  EXPECT_EQ(second.data(), packed.data()); // back to the packed region
  fill(second, 32, 3);
  store.drop(0); // a copy failed: the write-back is forgotten
  EXPECT_FALSE(store.pending(0));
  EXPECT_EQ(store.trainable(0).data(), first.data());
  EXPECT_TRUE(all(store.load_source(0).trainable, 32, 2));
}

TEST(HostStore, WrittenIsOneEventPerBlockReused) {
  HostStore store(device(), {16, 16}, {16, 16}, {}, "blocks");
  Event* event = &store.begin_write_back(1).written;
  store.commit(1);
  EXPECT_EQ(&store.begin_write_back(1).written, event);
  EXPECT_EQ(&store.written(1), event);
}

// The caller's memory (node-shared weights) is used in place and never has trainable bytes.
TEST(HostStore, CallersMemoryIsUsedInPlaceAndMistakesNameTheBlock) {
  std::vector<std::vector<std::byte>> storage(3, std::vector<std::byte>(128));
  std::vector<std::shared_ptr<Buffer>> memory;
  for (auto& bytes : storage) {
    memory.push_back(std::make_shared<Buffer>(bytes.data(), bytes.size(), nullptr));
  }
  const HostStore store(device(), {100, 128, 64}, {}, memory, "blocks");
  EXPECT_TRUE(store.caller_memory());
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(store.buffer(b)->data(), storage[b].data());
    EXPECT_EQ(store.trainable_bytes(b), 0u);
  }

  const auto refused =
      [&](const std::vector<std::size_t>& bytes, const std::vector<std::size_t>& trainable,
          const std::vector<std::shared_ptr<Buffer>>& given, const std::string& words) {
        try {
          HostStore bad(device(), bytes, trainable, given, "blocks");
          ADD_FAILURE() << "accepted: " << words;
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("[blocks]"), std::string::npos) << e.what();
        }
      };
  refused({100, 128}, {}, memory, "3 entries for 2 blocks");
  refused({100, 129, 64}, {}, memory, "block 1 holds fewer than its 129 bytes");
  refused({100, 128, 64}, {0, 8, 0}, memory, "block 1 has trainable bytes");
  refused({100, 128, 64}, {0, 8}, {}, "trainable_bytes has 2 entries for 3 blocks");
  refused({100, 128, 64}, {0, 200, 0}, {}, "block 1 has 128 bytes, fewer than its 200");
}

} // namespace
} // namespace blockswap
