// FileReader: the file tier's reads, in order, through a ring of staging buffers, past the page
// cache; every failure an Error naming the file and the block, raised where that block is
// waited for.
#include "blockswap/core/file_reader.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"

namespace blockswap {
namespace {

namespace fs = std::filesystem;

// A file of `bytes` bytes, byte i = i * 7 mod 251, in a directory of this test's own.
struct TestFile {
  fs::path path;
  std::vector<std::byte> contents;
  explicit TestFile(std::size_t bytes, const std::string& name = "model.bin") {
    const fs::path dir =
        fs::temp_directory_path() / ("blockswap-file-reader-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    path = dir / name;
    contents.resize(bytes);
    for (std::size_t i = 0; i < bytes; ++i) contents[i] = std::byte((i * 7) % 251);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(contents.data()), static_cast<std::streamsize>(bytes));
  }
  ~TestFile() { fs::remove_all(path.parent_path()); }
};

std::shared_ptr<Buffer> host_buffer(std::size_t bytes) {
  return std::make_shared<Buffer>(static_cast<std::byte*>(std::malloc(bytes)), bytes,
                                  [](std::byte* p, std::size_t) { std::free(p); });
}

std::vector<std::shared_ptr<Buffer>> ring(int buffers, std::size_t bytes) {
  std::vector<std::shared_ptr<Buffer>> out;
  for (int i = 0; i < buffers; ++i) out.push_back(host_buffer(bytes));
  return out;
}

// Blocks of the file as a loader lays them out: block b's tensors are `tensors` ranges of
// `tensor` bytes, each at an odd offset (safetensors does not align), packed in reverse order
// with a 64-byte gap, so that both the file offsets and the packed offsets matter.
std::vector<FileBlock> blocks_of(int n, int tensors, std::size_t tensor, uint64_t first = 13) {
  std::vector<FileBlock> blocks(n);
  uint64_t at = first;
  for (int b = 0; b < n; ++b) {
    for (int t = 0; t < tensors; ++t) {
      const std::size_t to = static_cast<std::size_t>(tensors - 1 - t) * (tensor + 64);
      blocks[b].ranges.push_back(FileRange{at, tensor, to});
      at += tensor;
    }
    blocks[b].bytes = static_cast<std::size_t>(tensors) * (tensor + 64);
  }
  return blocks;
}

void expect_block(const TestFile& file, const FileBlock& block, const std::byte* got) {
  for (const FileRange& r : block.ranges) {
    ASSERT_EQ(std::memcmp(got + r.to, file.contents.data() + r.file_offset, r.bytes), 0)
        << "range at file byte " << r.file_offset;
  }
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    FAIL() << "no error";
  } catch (const Error& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
}

class FileReaderTest : public ::testing::TestWithParam<CacheBypass> {};

TEST_P(FileReaderTest, ReadsEveryBlockExactlyInTheOrderAsked) {
  // Small tensors, and tensors across the edges of the reader's 8 MiB reads.
  for (const std::size_t tensor : {std::size_t{1000}, std::size_t{3} << 20}) {
    const std::vector<FileBlock> blocks = blocks_of(5, 3, tensor);
    const TestFile file(13 + 5 * 3 * tensor + 100);
    FileReader reader(file.path.string(), blocks, ring(2, blocks[0].bytes), "blocks", GetParam());
    const std::vector<int64_t> order = {3, 0, 4, 4, 1, 2, 0};
    for (int64_t b : order) reader.request(b); // deeper than the ring: reads wait for releases
    for (int64_t b : order) {
      const FileReader::Staged staged = reader.next();
      ASSERT_EQ(staged.block, b);
      expect_block(file, blocks[b], staged.buffer->data());
      reader.release(staged);
    }
    EXPECT_EQ(reader.bytes_read(), order.size() * blocks[0].bytes);
    if (GetParam() == CacheBypass::drop) {
      EXPECT_FALSE(reader.direct());
    }
    std::cout << "O_DIRECT: " << (reader.direct() ? "yes" : "no (buffered, DONTNEED)") << "\n";
  }
}

// Blocks of nine 8 MiB reads, one more than the reader's eight bounce parts: a part is read
// again as soon as it is copied out, and the parts a block leaves free read the first parts of
// the block asked for next (Note [reading across blocks]).
// Read in the order asked, every block is exact; when the order changes after that read
// (cancel), the window read ahead is dropped and the blocks asked for instead are exact.
TEST_P(FileReaderTest, ReadingAheadIntoTheNextBlockKeepsEveryBlockExactWhenTheOrderChanges) {
  const std::size_t tensor = std::size_t{22} << 20; // a block: 66 MiB and the gaps
  const std::vector<FileBlock> blocks = blocks_of(4, 3, tensor);
  const TestFile file(13 + 4 * 3 * tensor);
  FileReader reader(file.path.string(), blocks, ring(2, blocks[0].bytes), "blocks", GetParam());
  for (int64_t b : {0, 1, 2, 3, 1}) reader.request(b);
  for (int64_t b : {0, 1}) {
    const FileReader::Staged staged = reader.next();
    ASSERT_EQ(staged.block, b);
    expect_block(file, blocks[b], staged.buffer->data());
    reader.release(staged);
  }
  // Block 2 read whole, so block 3's first parts were read ahead; then 3 and 1 are forgotten.
  const FileReader::Staged two = reader.next();
  ASSERT_EQ(two.block, 2);
  reader.cancel();
  expect_block(file, blocks[2], two.buffer->data());
  reader.release(two);
  for (int64_t b : {0, 3, 3, 2}) reader.request(b);
  for (int64_t b : {0, 3, 3, 2}) {
    const FileReader::Staged staged = reader.next();
    ASSERT_EQ(staged.block, b);
    expect_block(file, blocks[b], staged.buffer->data());
    reader.release(staged);
  }
}

TEST_P(FileReaderTest, AFileTruncatedUnderTheRunIsAnErrorAtThatBlockAndTheReaderGoesOn) {
  const std::vector<FileBlock> blocks = blocks_of(4, 2, 5000);
  const TestFile file(13 + 4 * 2 * 5000);
  FileReader reader(file.path.string(), blocks, ring(1, blocks[0].bytes), "blocks", GetParam());
  reader.request(0);
  const FileReader::Staged first = reader.next();
  expect_block(file, blocks[0], first.buffer->data());
  reader.release(first);
  fs::resize_file(file.path, 13 + 2 * 2 * 5000);
  reader.request(3);
  expect_error([&] { reader.next(); },
               {"[blocks]", file.path.string(), "changed while", "before block 3 was read"});
  reader.request(1); // the ring's buffer came back: the reader still answers
  expect_error([&] { reader.next(); }, {"changed while"});
}

TEST_P(FileReaderTest, AFileRewrittenWithTheSameSizeIsAnError) {
  const std::vector<FileBlock> blocks = blocks_of(2, 2, 4096);
  TestFile file(13 + 2 * 2 * 4096);
  FileReader reader(file.path.string(), blocks, ring(1, blocks[0].bytes), "blocks", GetParam());
  // Another mtime: the file was written again, whatever it now holds.
  fs::last_write_time(file.path, fs::last_write_time(file.path) + std::chrono::seconds(5));
  reader.request(1);
  expect_error([&] { reader.next(); }, {"changed while", "modified since"});
}

INSTANTIATE_TEST_SUITE_P(Bypass, FileReaderTest,
                         ::testing::Values(CacheBypass::direct, CacheBypass::drop),
                         [](const ::testing::TestParamInfo<CacheBypass>& bypass) {
                           return bypass.param == CacheBypass::direct ? "Direct" : "Drop";
                         });

TEST(FileReader, RangesOutsideTheFileOrTheBlockAreRefusedAtOnce) {
  const TestFile file(1000);
  expect_error(
      [&] {
        FileReader(file.path.string(), {FileBlock{{FileRange{900, 200, 0}}, 200}}, ring(1, 200),
                   "blocks");
      },
      {"[blocks] block 0 needs bytes 900 to 1100", "which has 1000"});
  expect_error(
      [&] {
        FileReader(file.path.string(), {FileBlock{{FileRange{0, 100, 50}}, 120}}, ring(1, 200),
                   "blocks");
      },
      {"block 0: a range of 100 bytes at 50 does not fit its 120 packed bytes"});
  expect_error(
      [&] {
        FileReader(file.path.string(), {FileBlock{{FileRange{0, 100, 0}}, 100}}, ring(1, 50),
                   "blocks");
      },
      {"a staging buffer of 50 bytes cannot hold the largest block (100 bytes)"});
  expect_error(
      [&] {
        FileReader((file.path.parent_path() / "missing").string(),
                   {FileBlock{{FileRange{0, 100, 0}}, 100}}, ring(1, 100), "blocks");
      },
      {"cannot open", "missing", "No such file"});
}

// Blocks in pageable host memory (no file at all): copied whole, in parts on several threads
// when large, beside blocks with nothing to read.
TEST(FileReader, BlocksFromMemoryAreCopiedWhole) {
  std::vector<std::byte> memory((std::size_t{40} << 20) + 12345);
  for (std::size_t i = 0; i < memory.size(); ++i) memory[i] = std::byte(i * 131 % 251);
  const std::vector<FileBlock> blocks = {FileBlock{{}, memory.size(), memory.data()},
                                         FileBlock{{}, 777, memory.data() + 4096}, FileBlock{}};
  FileReader reader("", blocks, ring(2, memory.size()), "blocks");
  for (int64_t b : {0, 1, 0, 2}) reader.request(b);
  for (int64_t b : {0, 1, 0, 2}) {
    const FileReader::Staged staged = reader.next();
    ASSERT_EQ(staged.block, b);
    if (blocks[b].bytes > 0) { // block 2 has nothing to read (and no memory)
      EXPECT_EQ(std::memcmp(staged.buffer->data(), blocks[b].memory, blocks[b].bytes), 0) << b;
    }
    reader.release(staged);
  }
  EXPECT_EQ(reader.bytes_read(), 2 * memory.size() + 777);
  expect_error(
      [&] {
        FileReader("", {FileBlock{{FileRange{0, 1, 0}}, 1, memory.data()}}, ring(1, 1), "blocks");
      },
      {"from memory or from the file, not both"});
}

TEST(FileReader, DestroyedWithReadsPendingItStops) {
  const std::vector<FileBlock> blocks = blocks_of(8, 1, 1 << 20);
  const TestFile file(13 + 8 * (1 << 20));
  FileReader reader(file.path.string(), blocks, ring(2, blocks[0].bytes), "blocks");
  for (int64_t b = 0; b < 8; ++b) reader.request(b); // six wait for a buffer, never released
  reader.next();
}

// take() gives a block its buffer at once, before the read is done: buffers go to the blocks in
// the order asked, each to the next block once it is released.
TEST(FileReader, TakeGivesTheBuffersInTheOrderTheyAreReleased) {
  const std::vector<FileBlock> blocks = blocks_of(4, 2, 5000);
  const TestFile file(13 + 4 * 2 * 5000);
  const std::vector<std::shared_ptr<Buffer>> buffers = ring(2, blocks[0].bytes);
  FileReader reader(file.path.string(), blocks, buffers, "blocks");
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
TEST(FileReader, ATakenBlockIsReadWhatComesAfter) {
  const std::vector<FileBlock> blocks = blocks_of(3, 2, 5000);
  const TestFile file(13 + 3 * 2 * 5000);
  std::shared_ptr<Buffer> last;
  {
    FileReader reader(file.path.string(), blocks, ring(2, blocks[0].bytes), "blocks");
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
TEST(FileReader, ACopyOrderedAfterItsReadCopiesTheBlockRead) {
  EmulatedDevice device(EmulatedDeviceOptions{.link_gbps = 0.05}); // 1 MiB: 20 ms
  const std::vector<FileBlock> blocks = blocks_of(2, 1, 1 << 20);
  const TestFile file(13 + 2 * (1 << 20));
  const std::size_t bytes = blocks[0].bytes;
  FileReader reader(file.path.string(), blocks, ring(1, bytes), "blocks", CacheBypass::direct,
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

TEST(FileReader, ABlockOutOfRangeOrANextWithoutRequestIsNamed) {
  const TestFile file(100);
  FileReader reader(file.path.string(), {FileBlock{{FileRange{0, 10, 0}}, 10}}, ring(1, 10),
                    "blocks");
  expect_error([&] { reader.request(1); }, {"block index 1 is out of range"});
  expect_error([&] { reader.next(); }, {"take() with no block requested"});
}

} // namespace
} // namespace blockswap
