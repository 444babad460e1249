// The file tier's read bandwidth against the disk's: FileReader reading a file block after block
// through a ring of two staging buffers, with O_DIRECT and with buffered reads dropped from the
// cache. Compare with the disk's own: dd if=FILE of=/dev/null bs=64M iflag=direct. Each line
// also gives the fraction of the time the disk had a read in flight (/proc/diskstats' io_ticks
// of the file's device), which a noisy disk's bandwidth does not blur: the reader's own gaps.
// Usage: file_reader_bench FILE [GiB to write if FILE is missing, default 2] [MiB a block, 256]
//                          [direct|drop|both, default both]
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/file_source.hpp"

using namespace blockswap;

namespace {

// Milliseconds the device holding `path` has had I/O in flight since boot (-1: not found).
int64_t busy_ms(const std::string& path) {
  struct stat s {};
  if (::stat(path.c_str(), &s) != 0) return -1;
  std::ifstream stats("/proc/diskstats");
  unsigned major_id = 0, minor_id = 0;
  std::string name;
  while (stats >> major_id >> minor_id >> name) {
    int64_t field[10] = {};
    for (int64_t& f : field) stats >> f;
    stats.ignore(1 << 12, '\n');
    if (major_id == major(s.st_dev) && minor_id == minor(s.st_dev)) return field[9];
  }
  return -1;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE [GiB] [MiB per block]\n", argv[0]);
    return 2;
  }
  const std::string path = argv[1];
  const uint64_t gib = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 2;
  const std::size_t block = (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 256) << 20;
  const std::string modes = argc > 4 ? argv[4] : "both";
  if (!std::filesystem::exists(path)) {
    std::vector<char> chunk(64 << 20, 1);
    std::ofstream out(path, std::ios::binary);
    for (uint64_t written = 0; written < (gib << 30); written += chunk.size()) {
      out.write(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    }
  }
  const uint64_t size = std::filesystem::file_size(path);
  std::vector<FileBlock> blocks;
  for (uint64_t at = 1; at + block <= size; at += block) { // offset 1: unaligned, as safetensors
    blocks.push_back(FileBlock{{FileRange{at, block, 0}}, block});
  }
  for (const CacheBypass bypass : {CacheBypass::direct, CacheBypass::drop}) {
    if (modes != "both" && (modes == "direct") != (bypass == CacheBypass::direct)) continue;
    { // nothing of the file in the page cache: each mode reads the disk
      const int fd = ::open(path.c_str(), O_RDONLY);
      ::fdatasync(fd);
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
    std::vector<std::shared_ptr<Buffer>> ring;
    for (int i = 0; i < 2; ++i) {
      ring.push_back(std::make_shared<Buffer>(static_cast<std::byte*>(std::malloc(block)), block,
                                              [](std::byte* p, std::size_t) { std::free(p); }));
    }
    FileReader reader({path}, blocks, ring, "bench", bypass);
    const int64_t busy_before = busy_ms(path);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t b = 0; b < reader.blocks(); ++b) reader.request(b);
    for (int64_t b = 0; b < reader.blocks(); ++b) reader.release(reader.next());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double busy = double(busy_ms(path) - busy_before) / 1e3 / seconds;
    std::printf(
        "%-28s %6.2f GB/s  disk busy %3.0f %%  (%llu MiB in %.2f s, %lld blocks of %zu MiB)\n",
        reader.direct() ? "O_DIRECT" : "buffered + DONTNEED",
        double(reader.bytes_read()) / seconds / 1e9, busy_before < 0 ? -1.0 : 100 * busy,
        static_cast<unsigned long long>(reader.bytes_read() >> 20), seconds,
        static_cast<long long>(reader.blocks()), block >> 20);
  }
  return 0;
}
