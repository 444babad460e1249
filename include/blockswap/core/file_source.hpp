// The staging ring's sources (core/staging_ring.hpp): FileSource reads blocks' frozen bytes
// from the model's file (the file tier) past the page cache (Note [reading past the page
// cache] in file_source.cpp), so that host memory stays what blockswap holds and the bandwidth
// measured is the disk's; MemorySource copies them from host memory the system would not pin
// (Note [pageable host memory] in load_pipeline.cpp), compressed or not (a compressed host copy is
// copied as it is, and decoded on the device). A remote source is one more BlockSource here.
//
// Every failure (a read error, a short read, the file changed or truncated under the run) is
// an Error naming the file and the block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "blockswap/core/backend.hpp"
#include "blockswap/core/staging_ring.hpp"

namespace blockswap {

// `bytes` bytes of file `file` (an index into the files given: the shards of a sharded
// checkpoint; 0 for one file) from `file_offset` go to offset `to` of the block's packed bytes.
struct FileRange {
  uint64_t file_offset = 0;
  std::size_t bytes = 0;
  std::size_t to = 0;
  std::size_t file = 0;
};

// One block's frozen bytes in the files (its ranges may lie in several): where each range goes, and
// the packed size they fill. With `memory` set instead, the block's `bytes` are copied from there
// (pageable host memory, which must stay valid and unchanged while the reader lives).
struct FileBlock {
  std::vector<FileRange> ranges;
  std::size_t bytes = 0;
  const std::byte* memory = nullptr;
};

// How reads keep out of the page cache.
enum class CacheBypass {
  direct, // O_DIRECT where the file system takes it, else `drop`
  drop,   // buffered reads, each followed by posix_fadvise(POSIX_FADV_DONTNEED)
};

// What Backend::make_staging_reader builds a reader from: per block, its place in the file or
// its pageable memory (neither: never staged).
struct StagingSpec {
  std::vector<std::string>
      files; // the model's files, FileRange::file's (none: no block has ranges)
  std::vector<FileBlock> blocks;
  std::vector<std::shared_ptr<Buffer>> staging; // the ring
  std::string label;
  CacheBypass bypass = CacheBypass::direct;
};

class FileSource final : public BlockSource {
public:
  // Opens `files` (one fd each) and checks that every range of every block names one of them,
  // lies inside it and inside its block's bytes: Error naming `label`, the block and the file
  // otherwise. Blocks with no ranges are not its.
  FileSource(std::vector<std::string> files, std::vector<FileBlock> blocks, std::string label,
             CacheBypass bypass = CacheBypass::direct);
  ~FileSource() override; // waits for reads in flight

  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  void read(int64_t block, std::byte* into, const std::function<int64_t()>& next) override;
  void stop() override { drop_reads(); }

  // Whether reads of every file bypass the cache with O_DIRECT (else, for a file the file
  // system will not read so: buffered reads and DONTNEED).
  bool direct() const;

private:
  // An aligned stretch of a file read into one bounce part.
  struct Part {
    uint64_t at = 0, want = 0;
    std::size_t file = 0;
  };
  // One of the files, open.
  struct Opened {
    std::string path;
    int fd = -1;
    bool direct = false;
    uint64_t size = 0;
    int64_t modified_ns = 0, changed_ns = 0; // its mtime and ctime when opened
  };
  void open(std::string path, CacheBypass bypass); // one more of files_
  std::vector<Part> parts_of(int64_t block) const; // those that cover its ranges, in file order
  void issue(int64_t block, std::size_t part, Part stretch); // into the next bounce part
  void drop_reads();                                         // waits for those in flight
  uint64_t read_part(int64_t block, const Part& part, std::byte* into) const;
  void check_unchanged(int64_t block) const; // the files the block reads

  const std::string label_;
  const std::vector<FileBlock> blocks_;
  std::vector<Opened> files_;
  // The bounce parts, read into in turn: the disk reads the next ones while the oldest is
  // copied out (Note [reading past the page cache]).
  std::unique_ptr<std::byte, void (*)(void*)> bounce_{nullptr, nullptr};
  std::size_t next_part_ = 0; // the bounce part the next read goes to
  // The parts' reads in flight, oldest first, the next block's first parts after the block
  // being read (Note [reading across blocks]).
  struct InFlight {
    int64_t block = -1;
    std::size_t part = 0;
    std::byte* bounce = nullptr;
    std::future<uint64_t> got;
  };
  std::deque<InFlight> in_flight_;
};

// Blocks in pageable host memory (FileBlock::memory), copied in parts on several threads.
class MemorySource final : public BlockSource {
public:
  explicit MemorySource(std::vector<FileBlock> blocks) : blocks_(std::move(blocks)) {}
  void read(int64_t block, std::byte* into, const std::function<int64_t()>& next) override;
  void repoint(int64_t block, const std::byte* memory, std::size_t bytes) override;

private:
  std::vector<FileBlock> blocks_; // repoint changes a block's, never while it is read
};

// The staging ring over the file and pageable memory that `spec` names (what
// Backend::make_staging_reader gives by default): checks as FileSource and StagingRing do,
// and that no block is both in the file and in memory.
class FileReader final : public StagingRing {
public:
  FileReader(std::vector<std::string> files, std::vector<FileBlock> blocks,
             const std::vector<std::shared_ptr<Buffer>>& staging, std::string label,
             CacheBypass bypass = CacheBypass::direct, Backend* backend = nullptr);
  // Whether the file is read with O_DIRECT (false with no file).
  bool direct() const { return file_ != nullptr && file_->direct(); }

private:
  struct Sources {
    std::shared_ptr<FileSource> file; // null: no block has ranges
    std::vector<std::size_t> bytes;
    std::vector<std::shared_ptr<BlockSource>> per_block;
  };
  FileReader(Sources sources, const std::vector<std::shared_ptr<Buffer>>& staging,
             std::string label, Backend* backend);
  static Sources sources_of(std::vector<std::string> files, std::vector<FileBlock> blocks,
                            const std::string& label, CacheBypass bypass);
  std::shared_ptr<FileSource> file_;
};

} // namespace blockswap
