// FileSource and MemorySource through the default staging reader (FileReader): the file tier's
// reads, in order, past the page cache, and pageable memory's copies; every failure an Error
// naming the file and the block, raised where that block is waited for.
#include "blockswap/core/file_source.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "staging_test_files.hpp"

namespace blockswap {
namespace {

using namespace blockswap::testing;

class FileReaderTest : public ::testing::TestWithParam<CacheBypass> {};

TEST_P(FileReaderTest, ReadsEveryBlockExactlyInTheOrderAsked) {
  // Small tensors, and tensors across the edges of the reader's 8 MiB reads.
  for (const std::size_t tensor : {std::size_t{1000}, std::size_t{3} << 20}) {
    const std::vector<FileBlock> blocks = blocks_of(5, 3, tensor);
    const TestFile file(13 + 5 * 3 * tensor + 100);
    FileReader reader({file.path.string()}, blocks, ring(2, blocks[0].bytes), "blocks", GetParam());
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
  FileReader reader({file.path.string()}, blocks, ring(2, blocks[0].bytes), "blocks", GetParam());
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
  FileReader reader({file.path.string()}, blocks, ring(1, blocks[0].bytes), "blocks", GetParam());
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
  FileReader reader({file.path.string()}, blocks, ring(1, blocks[0].bytes), "blocks", GetParam());
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
        FileReader({file.path.string()}, {FileBlock{{FileRange{900, 200, 0}}, 200}}, ring(1, 200),
                   "blocks");
      },
      {"[blocks] block 0 needs bytes 900 to 1100", "which has 1000"});
  expect_error(
      [&] {
        FileReader({file.path.string()}, {FileBlock{{FileRange{0, 100, 50}}, 120}}, ring(1, 200),
                   "blocks");
      },
      {"block 0: a range of 100 bytes at 50 does not fit its 120 packed bytes", "model.bin"});
  expect_error(
      [&] {
        FileReader({file.path.string()}, {FileBlock{{FileRange{0, 100, 0}}, 100}}, ring(1, 50),
                   "blocks");
      },
      {"a staging buffer of 50 bytes cannot hold the largest block (100 bytes)"});
  expect_error(
      [&] {
        FileReader({(file.path.parent_path() / "missing").string()},
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
  FileReader reader({}, blocks, ring(2, memory.size()), "blocks");
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
        FileReader({}, {FileBlock{{FileRange{0, 1, 0}}, 1, memory.data()}}, ring(1, 1), "blocks");
      },
      {"[blocks] block 0 is given both host memory and ranges of the file",
       "from memory or from the file, not both"});
}

// A block in host memory given a new place (StagingReader::repoint: its host copy stored
// compressed, Note [compressed host copies]) is read from there, at its new size, from its next
// request on; a block in the file, one still requested, or more than a staging buffer holds is
// an Error that says so.
TEST(FileReader, ABlockInMemoryIsReadFromItsNewPlace) {
  std::vector<std::byte> memory(3000), moved(1000);
  for (std::size_t i = 0; i < memory.size(); ++i) memory[i] = std::byte(i * 7 % 253);
  for (std::size_t i = 0; i < moved.size(); ++i) moved[i] = std::byte(i * 11 % 241 + 1);
  const TestFile file(10'000);
  const std::vector<FileBlock> blocks = {FileBlock{{}, memory.size(), memory.data()},
                                         FileBlock{{FileRange{0, 100, 0}}, 100, nullptr}};
  FileReader reader({file.path.string()}, blocks, ring(1, memory.size()), "blocks");
  reader.request(0);
  FileReader::Staged staged = reader.next();
  reader.release(staged);
  reader.repoint(0, moved.data(), moved.size());
  reader.request(0);
  staged = reader.next();
  EXPECT_EQ(std::memcmp(staged.buffer->data(), moved.data(), moved.size()), 0);
  reader.release(staged);
  EXPECT_EQ(reader.bytes_read(), memory.size() + moved.size());
  expect_error([&] { reader.repoint(1, moved.data(), 100); },
               {"block 1 is not read from host memory"});
  expect_error([&] { reader.repoint(0, memory.data(), memory.size() + 1); },
               {"[blocks] block 0 cannot take 3001 bytes: a staging buffer holds 3000"});
  reader.request(0);
  expect_error([&] { reader.repoint(0, memory.data(), memory.size()); },
               {"[blocks] block 0 is given a new place while a read of it is requested"});
  reader.cancel();
  reader.repoint(0, memory.data(), memory.size());
}

// The file source alone, as the ring's thread calls it: each block's ranges where they go, and
// the next block's first parts read ahead only when the ring names it.
TEST(FileSource, ReadsABlockAndAheadIntoTheBlockNamedNext) {
  const std::vector<FileBlock> blocks = blocks_of(3, 2, 3 << 20);
  const TestFile file(13 + 3 * 2 * (3 << 20));
  FileSource source({file.path.string()}, blocks, "blocks", CacheBypass::drop);
  std::vector<std::byte> into(blocks[0].bytes);
  int asked = 0;
  source.read(0, into.data(), [&] {
    ++asked;
    return int64_t{2};
  });
  expect_block(file, blocks[0], into.data());
  source.read(2, into.data(), [] { return int64_t{-1}; }); // its first parts were read ahead
  expect_block(file, blocks[2], into.data());
  source.read(1, into.data(), [] { return int64_t{-1}; });
  expect_block(file, blocks[1], into.data());
  EXPECT_LE(asked, 1);
  EXPECT_FALSE(source.direct()); // CacheBypass::drop
}

// A sharded checkpoint: a block's tensors lie in several files (FileRange::file), each read
// through its own descriptor, past the cache as one file's are; tensors across the 8 MiB reads.
TEST_P(FileReaderTest, ReadsBlocksWhoseRangesLieInSeveralFiles) {
  const std::size_t tensor = (std::size_t{3} << 20) + 1001;
  const TestFile a(13 + 4 * tensor, "a.bin", 0), b(13 + 4 * tensor, "b.bin", 1),
      c(13 + 4 * tensor, "c.bin", 2);
  const TestFile* files[] = {&a, &b, &c};
  std::vector<FileBlock> blocks(3);
  std::vector<uint64_t> next(3, 13);
  for (std::size_t block = 0; block < 3; ++block) {
    for (std::size_t t = 0; t < 3; ++t) { // tensor t of block b in file (b + t) % 3
      const std::size_t file = (block + t) % 3;
      blocks[block].ranges.push_back(FileRange{next[file], tensor, (2 - t) * (tensor + 64), file});
      next[file] += tensor;
    }
    blocks[block].bytes = 3 * (tensor + 64);
  }
  FileReader reader({a.path.string(), b.path.string(), c.path.string()}, blocks,
                    ring(2, blocks[0].bytes), "blocks", GetParam());
  const std::vector<int64_t> order = {2, 0, 1, 1, 0};
  for (int64_t block : order) reader.request(block);
  for (int64_t block : order) {
    const FileReader::Staged staged = reader.next();
    ASSERT_EQ(staged.block, block);
    for (const FileRange& r : blocks[block].ranges) {
      ASSERT_EQ(std::memcmp(staged.buffer->data() + r.to,
                            files[r.file]->contents.data() + r.file_offset, r.bytes),
                0)
          << "block " << block << ", file " << r.file << " at " << r.file_offset;
    }
    reader.release(staged);
  }
  EXPECT_EQ(reader.bytes_read(), order.size() * blocks[0].bytes);
  expect_error(
      [&] {
        FileReader({a.path.string()}, {FileBlock{{FileRange{0, 10, 0, 1}}, 10}}, ring(1, 10),
                   "blocks");
      },
      {"[blocks] block 0 needs file 1 of 1 given"});
  expect_error(
      [&] {
        FileReader({a.path.string(), (a.path.parent_path() / "gone.bin").string()},
                   {FileBlock{{FileRange{0, 10, 0, 1}}, 10}}, ring(1, 10), "blocks");
      },
      {"cannot open '", "gone.bin'"});
}

} // namespace
} // namespace blockswap
