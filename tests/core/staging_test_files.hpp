// The staging tests' files and rings: a file of known bytes, blocks of it laid out as a loader
// lays them out, rings of host buffers. For file_source_test and staging_ring_test.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/core/file_source.hpp"

namespace blockswap::testing {

namespace fs = std::filesystem;

// A file of `bytes` bytes, byte i = (i * 7 + salt) mod 251, in a directory of this test's own
// (files of one test live and go together).
struct TestFile {
  fs::path path;
  std::vector<std::byte> contents;
  explicit TestFile(std::size_t bytes, const std::string& name = "model.bin",
                    std::size_t salt = 0) {
    const fs::path dir =
        fs::temp_directory_path() / ("blockswap-file-reader-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    path = dir / name;
    contents.resize(bytes);
    for (std::size_t i = 0; i < bytes; ++i) contents[i] = std::byte((i * 7 + salt) % 251);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(contents.data()), static_cast<std::streamsize>(bytes));
  }
  ~TestFile() { fs::remove_all(path.parent_path()); }
};

inline std::shared_ptr<Buffer> host_buffer(std::size_t bytes) {
  return std::make_shared<Buffer>(static_cast<std::byte*>(std::malloc(bytes)), bytes,
                                  [](std::byte* p, std::size_t) { std::free(p); });
}

inline std::vector<std::shared_ptr<Buffer>> ring(int buffers, std::size_t bytes) {
  std::vector<std::shared_ptr<Buffer>> out;
  for (int i = 0; i < buffers; ++i) out.push_back(host_buffer(bytes));
  return out;
}

// Blocks of the file as a loader lays them out: block b's tensors are `tensors` ranges of
// `tensor` bytes, each at an odd offset (safetensors does not align), packed in reverse order
// with a 64-byte gap, so that both the file offsets and the packed offsets matter.
inline std::vector<FileBlock> blocks_of(int n, int tensors, std::size_t tensor,
                                        uint64_t first = 13) {
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

inline void expect_block(const TestFile& file, const FileBlock& block, const std::byte* got) {
  for (const FileRange& r : block.ranges) {
    ASSERT_EQ(std::memcmp(got + r.to, file.contents.data() + r.file_offset, r.bytes), 0)
        << "range at file byte " << r.file_offset;
  }
}

inline void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    FAIL() << "no error";
  } catch (const Error& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
}

} // namespace blockswap::testing
