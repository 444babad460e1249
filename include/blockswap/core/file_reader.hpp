// FileReader: the staging ring's reader (DESIGN.md, "Tiers"). Blocks' frozen bytes stay in the
// model's file (the file tier), or in host memory the system would not pin (Note [pageable host
// memory] in engine_staging.cpp); a reader thread reads each requested block, in the order asked,
// into the next buffer of a small staging ring (pinned, from the backend), from which the copy
// stream copies it to the device. Host memory stays bounded: the ring, and a ring of aligned
// bounce parts (64 MiB).
//
// Reads bypass the page cache (Note [reading past the page cache] in file_reader.cpp), so that
// host memory stays what blockswap holds and the bandwidth measured is the disk's.
// Every failure (a read error, a short read, the file changed or truncated under the run) is
// an Error naming the file and the block, raised by the call that waits for that block; what
// was read before stays valid.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "blockswap/core/backend.hpp"

namespace blockswap {

// `bytes` bytes of the file from `file_offset` go to offset `to` of the block's packed bytes.
struct FileRange {
  uint64_t file_offset = 0;
  std::size_t bytes = 0;
  std::size_t to = 0;
};

// One block's frozen bytes in the file: where each range goes, and the packed size they fill.
// With `memory` set instead, the block's `bytes` are copied from there (pageable host memory,
// which must stay valid and unchanged while the reader lives).
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

// The staging ring's reader as the engine drives it: blocks asked for in order, each given
// back in a staging buffer, the buffer free again once the copy out of it is done. Buffers go
// to requests in the order asked, each to the block that asks first once it is free, so that
// take() knows a block's buffer before its read is done: the copy out of it can be enqueued at
// once, behind a wait for the read on the copy stream (copy_after), and the host goes on.
// FileReader reads the file (and pageable memory); the timed device models a disk
// (device/timed.hpp).
class StagingReader {
public:
  struct Staged {
    int64_t block = -1;
    std::shared_ptr<Buffer> buffer;
    std::shared_ptr<void> read; // the reader's record of the read
  };
  virtual ~StagingReader() = default;
  // Asks for block i, after the blocks asked before.
  virtual void request(int64_t block) = 0;
  // The oldest requested block not yet taken, and the buffer it is read into, without waiting
  // for the read: its bytes are there once wait() returns, or for the copy stream's work after
  // copy_after(). A taken block is read even if cancel() follows. Throws Error when no block
  // is requested, or when every buffer is held by blocks taken and not released.
  virtual Staged take() = 0;
  // Makes the copy stream's later work wait for `staged`'s read; the host does not wait.
  virtual void copy_after(const Staged& staged) = 0;
  // Blocks the host until `staged`'s read is done; rethrows its failure.
  virtual void wait(const Staged& staged) = 0;
  // take() and wait(): the oldest requested block, read. When its read failed, its buffer is
  // free again and the failure is rethrown.
  Staged next();
  // The buffer of a block take() gave is free again once `copied` (an event recorded on the
  // copy stream after the copy out of it; null: at once) has completed; released before its
  // read is done, it is read into again only after that read. `copied` is the reader's: it is
  // not recorded again (the next copy out of the buffer may be enqueued before the read it
  // waits for, which waits for `copied`).
  virtual void release(const Staged& staged, std::shared_ptr<const Event> copied = nullptr) = 0;
  // Forgets every requested block take() has not given.
  virtual void cancel() = 0;
  virtual uint64_t bytes_read() const = 0;
};

// What Backend::make_staging_reader builds a reader from.
struct StagingSpec {
  std::string path; // the model's file (empty: no block has ranges)
  std::vector<FileBlock> blocks;
  std::vector<std::shared_ptr<Buffer>> staging; // the ring
  std::string label;
  CacheBypass bypass = CacheBypass::direct;
};

class FileReader final : public StagingReader {
public:
  // Opens `path` (none when no block has ranges: `path` may be empty) and checks that every
  // range of every block lies inside the file and inside its block's bytes, and that each
  // staging buffer holds the largest block: Error naming `label`, the block and the file
  // otherwise. Starts the reader thread.
  // `backend`: whose events release() is given (may be null when release() gets none).
  FileReader(std::string path, std::vector<FileBlock> blocks,
             const std::vector<std::shared_ptr<Buffer>>& staging, std::string label,
             CacheBypass bypass = CacheBypass::direct, Backend* backend = nullptr);
  ~FileReader() override; // stops the thread; reads in flight finish first

  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  // Asks for block i to be read, after the blocks asked before: as soon as its staging buffer
  // is free, the thread reads it (read-ahead as deep as the ring).
  void request(int64_t block) override;
  Staged take() override;
  // Backend::wait_host on the copy stream (the backend given to the constructor).
  void copy_after(const Staged& staged) override;
  void wait(const Staged& staged) override;
  // The thread waits for `copied` (Backend::synchronize) before it reads into that buffer
  // again, so that a copy still in flight delays only the read that needs its buffer. A copy
  // that failed fails that read.
  void release(const Staged& staged, std::shared_ptr<const Event> copied = nullptr) override;
  // Forgets every requested block take() has not given (the caller's order changed): waits for
  // a read of one of them in flight, and frees their buffers.
  void cancel() override;

  // Whether reads bypass the cache with O_DIRECT (else: buffered reads and DONTNEED).
  bool direct() const { return direct_; }
  uint64_t bytes_read() const override; // from the file and from memory
  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }
  const std::string& path() const { return path_; }

private:
  struct Free {
    std::shared_ptr<Buffer> buffer;
    std::function<void()> copied; // wait for the copy out of it before writing it
  };
  // A failed read's error, kept as its kind and message: the waiting thread throws an
  // exception of its own. (An exception object shared between threads through an
  // exception_ptr is freed by whichever thread drops it last, with a reference count the
  // thread sanitizer cannot see: it reported the reader freeing it while the caller read it.)
  struct Failure {
    enum class Kind { none, error, invalid_argument, out_of_memory } kind = Kind::none;
    std::string what;
    explicit operator bool() const { return kind != Kind::none; }
    [[noreturn]] void raise() const;
  };
  // One requested block; shared with the copy stream's wait for it (copy_after).
  struct Read {
    int64_t block = -1;
    Free into; // its buffer, given in the order asked (null until one is free)
    bool taken = false, done = false;
    Failure failure;
  };
  // What the copy stream's waits share with the reader, which they may outlive.
  struct Shared {
    std::mutex mutex;
    std::condition_variable changed;
  };

  void give_buffers(); // under the lock: free buffers to the oldest requests without one
  void run();
  // An aligned stretch of the file read into one bounce part.
  struct Part {
    uint64_t at = 0, want = 0;
  };
  std::vector<Part> parts_of(int64_t block) const; // those that cover its ranges, in file order
  void read_block(int64_t block, std::byte* into);
  void issue(int64_t block, std::size_t part, Part stretch); // into the next bounce part
  void drop_reads();                                         // waits for those in flight
  int64_t block_after() const; // the block asked for after the one being read (-1: none)
  void copy_block(int64_t block, std::byte* into) const;
  uint64_t read_part(int64_t block, std::byte* into, uint64_t offset, uint64_t bytes) const;
  void check_unchanged(int64_t block) const;

  const std::string path_, label_;
  const std::vector<FileBlock> blocks_;
  Backend* backend_ = nullptr;
  int fd_ = -1;
  bool direct_ = false;
  uint64_t size_ = 0;
  int64_t modified_ns_ = 0, changed_ns_ = 0; // its mtime and ctime when opened (file_reader.cpp)
  // The bounce parts, read into in turn: the disk reads the next ones while the oldest is
  // copied out (Note [reading past the page cache]).
  std::unique_ptr<std::byte, void (*)(void*)> bounce_{nullptr, nullptr};
  std::size_t next_part_ = 0; // the bounce part the next read goes to
  // The thread's: the parts' reads in flight, oldest first, the next block's first parts after
  // the block being read (Note [reading across blocks]).
  struct InFlight {
    int64_t block = -1;
    std::size_t part = 0;
    std::byte* bounce = nullptr;
    std::future<uint64_t> got;
  };
  std::deque<InFlight> in_flight_;

  const std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::deque<Free> free_;                   // in the order they are given out
  std::deque<std::shared_ptr<Read>> reads_; // asked, not yet both read and taken, in order
  const Read* reading_ = nullptr;           // the thread's, while it reads
  uint64_t bytes_read_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

} // namespace blockswap
