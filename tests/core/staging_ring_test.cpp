// StagingRing: the staging ring's protocol over any source (requests in order, buffers given
// in the order asked and released, a taken block read whatever comes after, a copy ordered
// after its read), shown with the default reader over a file and with a source of the test's.
#include "blockswap/core/staging_ring.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "blockswap/device/emulated.hpp"
#include "staging_test_files.hpp"

namespace blockswap {
namespace {

using namespace blockswap::testing;

TEST(StagingRing, DestroyedWithReadsPendingItStops) {
  const std::vector<FileBlock> blocks = blocks_of(8, 1, 1 << 20);
  const TestFile file(13 + 8 * (1 << 20));
  FileReader reader({file.path.string()}, blocks, ring(2, blocks[0].bytes), "blocks");
  for (int64_t b = 0; b < 8; ++b) reader.request(b); // six wait for a buffer, never released
  reader.next();
}

// take() gives a block its buffer at once, before the read is done: buffers go to the blocks in
// the order asked, each to the next block once it is released.
TEST(StagingRing, TakeGivesTheBuffersInTheOrderTheyAreReleased) {
  const std::vector<FileBlock> blocks = blocks_of(4, 2, 5000);
  const TestFile file(13 + 4 * 2 * 5000);
  const std::vector<std::shared_ptr<Buffer>> buffers = ring(2, blocks[0].bytes);
  FileReader reader({file.path.string()}, blocks, buffers, "blocks");
  for (int64_t b : {2, 0, 3, 1}) reader.request(b);
  const FileReader::Staged a = reader.take(), b = reader.take();
  EXPECT_EQ(a.block, 2);
  EXPECT_EQ(b.block, 0);
  EXPECT_EQ(a.buffer, buffers[0]);
  EXPECT_EQ(b.buffer, buffers[1]);
  expect_error([&] { reader.take(); }, {"[blocks] every staging buffer is held"});
  reader.wait(b);
  expect_block(file, blocks[0], b.buffer->data());
  reader.release(b); // released first: given next
  const FileReader::Staged c = reader.take();
  EXPECT_EQ(c.block, 3);
  EXPECT_EQ(c.buffer, buffers[1]);
  reader.wait(a);
  expect_block(file, blocks[2], a.buffer->data());
  reader.release(a);
  reader.wait(c);
  expect_block(file, blocks[3], c.buffer->data());
  const FileReader::Staged d = reader.next();
  EXPECT_EQ(d.block, 1);
  EXPECT_EQ(d.buffer, buffers[0]);
  expect_block(file, blocks[1], d.buffer->data());
  EXPECT_EQ(reader.bytes_read(), 4 * blocks[0].bytes);
}

// A copy may already wait for a taken block's read (copy_after): cancel() forgets only the
// blocks not taken, and the reader, destroyed, reads the taken ones first.
TEST(StagingRing, ATakenBlockIsReadWhatComesAfter) {
  const std::vector<FileBlock> blocks = blocks_of(3, 2, 5000);
  const TestFile file(13 + 3 * 2 * 5000);
  std::shared_ptr<Buffer> last;
  {
    FileReader reader({file.path.string()}, blocks, ring(2, blocks[0].bytes), "blocks");
    for (int64_t b : {0, 1, 2}) reader.request(b);
    const FileReader::Staged first = reader.take();
    reader.cancel();
    reader.wait(first);
    expect_block(file, blocks[0], first.buffer->data());
    reader.release(first);
    reader.request(2);
    const FileReader::Staged second = reader.take();
    EXPECT_EQ(second.block, 2);
    last = second.buffer; // it held block 1's bytes (read ahead before cancel), or none
  }                       // destroyed before anything waited for block 2
  expect_block(file, blocks[2], last->data());
}

// The copy out of a staging buffer, enqueued before the block is read into it, waits for the
// read on the copy stream: here the second read waits for the copy of the first block out of
// the same buffer (a slow link), which is enqueued behind the wait for the first read, and the
// second block is taken and its copy enqueued before either read is done. A copy that did not
// wait would copy stale bytes; a reader that waited for a later record of the first copy's
// event (an event recorded again for the second copy) would never read the second block.
TEST(StagingRing, ACopyOrderedAfterItsReadCopiesTheBlockRead) {
  EmulatedDevice device(EmulatedDeviceOptions{.link_gbps = 0.05}); // 1 MiB: 20 ms
  const std::vector<FileBlock> blocks = blocks_of(2, 1, 1 << 20);
  const TestFile file(13 + 2 * (1 << 20));
  const std::size_t bytes = blocks[0].bytes;
  FileReader reader({file.path.string()}, blocks, ring(1, bytes), "blocks", CacheBypass::direct,
                    &device);
  const Buffer to0 = device.allocate_device(bytes), to1 = device.allocate_device(bytes);
  reader.request(0);
  reader.request(1);
  FileReader::Staged staged[2];
  std::shared_ptr<Event> copied[2];
  const Buffer* to[2] = {&to0, &to1};
  for (int b : {0, 1}) {
    staged[b] = reader.take(); // the one buffer, again once released
    EXPECT_EQ(staged[b].block, b);
    reader.copy_after(staged[b]);
    device.copy_to_device(to[b]->data(), staged[b].buffer->data(), bytes, b);
    copied[b] = device.make_event();
    device.record(*copied[b], Stream::copy);
    reader.release(staged[b], copied[b]);
  }
  EXPECT_EQ(staged[1].buffer, staged[0].buffer);
  device.synchronize(*copied[1]);
  expect_block(file, blocks[0], to0.data());
  expect_block(file, blocks[1], to1.data());
  reader.wait(staged[0]);
  reader.wait(staged[1]);
}

TEST(StagingRing, ABlockOutOfRangeOrANextWithoutRequestIsNamed) {
  const TestFile file(100);
  FileReader reader({file.path.string()}, {FileBlock{{FileRange{0, 10, 0}}, 10}}, ring(1, 10),
                    "blocks");
  expect_error([&] { reader.request(1); }, {"block index 1 is out of range"});
  expect_error([&] { reader.next(); }, {"take() with no block requested"});
}

// A source of the test's: block b is filled with byte b, except block 3, whose read fails.
// It records which block the ring named as next while it read.
class PatternSource final : public BlockSource {
public:
  std::vector<int64_t> named_next;
  std::atomic<int> stopped{0};
  std::atomic<bool> go{false}; // the test has asked for every block: reads may ask what is next
  void read(int64_t block, std::byte* into, const std::function<int64_t()>& next) override {
    while (!go) std::this_thread::yield();
    named_next.push_back(next());
    BLOCKSWAP_CHECK(block != 3, "[pattern] block 3 cannot be read");
    std::memset(into, static_cast<int>(block), 64);
  }
  void stop() override { ++stopped; }
};

TEST(StagingRing, ReadsThroughItsSourceInOrderAndRaisesAFailedReadWhereItIsWaitedFor) {
  auto source = std::make_shared<PatternSource>();
  {
    StagingRing ring_({64, 64, 64, 64, 0}, {source, source, source, source, nullptr}, ring(1, 64),
                      "pattern");
    for (int64_t b : {1, 3, 2, 4}) ring_.request(b);
    source->go = true;
    const StagingReader::Staged one = ring_.next();
    EXPECT_EQ(one.block, 1);
    EXPECT_EQ(one.buffer->data()[63], std::byte{1});
    ring_.release(one);
    expect_error([&] { ring_.next(); }, {"[pattern] block 3 cannot be read"});
    const StagingReader::Staged two = ring_.next(); // the failed read's buffer is free again
    EXPECT_EQ(two.block, 2);
    EXPECT_EQ(two.buffer->data()[0], std::byte{2});
    ring_.release(two);
    const StagingReader::Staged four = ring_.next(); // no source: nothing read
    EXPECT_EQ(four.block, 4);
    ring_.release(four);
    EXPECT_EQ(ring_.bytes_read(), 2 * 64u);
  }
  ASSERT_EQ(source->named_next.size(), 3u); // the block asked after the one being read
  EXPECT_EQ(source->named_next[0], 3);
  EXPECT_EQ(source->named_next[1], 2);
  EXPECT_EQ(source->named_next[2], 4);
  EXPECT_GE(source->stopped.load(), 1); // told when the ring stops
}

// A source's own exceptions (not blockswap's) are raised as blockswap's, naming the ring and the
// block; an allocation that fails is OutOfMemory.
class ThrowingSource final : public BlockSource {
public:
  void read(int64_t block, std::byte*, const std::function<int64_t()>&) override {
    if (block == 0) throw std::runtime_error("socket closed");
    if (block == 1) throw std::bad_alloc();
    throw 42;
  }
};

TEST(StagingRing, ASourcesOwnFailureNamesTheRingAndTheBlock) {
  auto source = std::make_shared<ThrowingSource>();
  StagingRing ring_({8, 8, 8}, {source, source, source}, ring(1, 8), "remote");
  for (int64_t b : {0, 1, 2}) ring_.request(b);
  expect_error([&] { ring_.next(); }, {"[remote] reading block 0: socket closed"});
  EXPECT_THROW(ring_.next(), OutOfMemory);
  expect_error([&] { ring_.next(); }, {"[remote] reading block 2 failed with an unknown error"});
}

TEST(StagingRing, BuffersSmallerThanTheLargestBlockAreRefused) {
  auto source = std::make_shared<PatternSource>();
  expect_error(
      [&] {
        StagingRing({64, 128}, {source, source}, ring(2, 100), "pattern");
      },
      {"[pattern] a staging buffer of 100 bytes cannot hold the largest block (128"});
  expect_error([&] { StagingRing({64}, {source}, {}, "pattern"); },
               {"needs at least one staging buffer"});
}

} // namespace
} // namespace blockswap
