// The staging ring (DESIGN.md "Tiers"): blocks whose bytes cannot be copied to the device from
// where they are (the model's file, host memory the system would not pin) are read, in the
// order the loads will come, into the next of a small ring of pinned staging buffers, from
// which the copy stream copies them to the device (core/load_pipeline.hpp). Host memory stays
// bounded by the ring.
//
// StagingReader is the ring as the load pipeline drives it; StagingRing runs it on a thread of
// its own over BlockSources (core/file_source.hpp: the file, pageable memory), and the timed
// device models a disk behind the same protocol (device/timed.hpp). Every failure of a read is
// an Error naming the block, raised by the call that waits for that block; what was read
// before stays valid.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "blockswap/core/backend.hpp"

namespace blockswap {

// The staging ring's reader as the load pipeline drives it: blocks asked for in order, each
// given back in a staging buffer, the buffer free again once the copy out of it is done.
// Buffers go to requests in the order asked, each to the block that asks first once it is
// free, so that take() knows a block's buffer before its read is done: the copy out of it can be
// enqueued at once, behind a wait for the read on the copy stream (copy_after), and the host
// goes on.
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
  // Block i, staged from host memory, is `bytes` bytes at `memory` from its next read on (its
  // host copy was replaced: stored compressed, or encoded again; LoadPipeline::compress). Only
  // while no read of it is requested (after cancel()). Throws Error for a block not read from
  // host memory, one requested, or more bytes than a staging buffer holds.
  virtual void repoint(int64_t block, const std::byte* memory, std::size_t bytes) = 0;
  virtual uint64_t bytes_read() const = 0;
};

// Where a staged block's bytes come from (core/file_source.hpp). The ring calls it from its
// thread, one read at a time.
class BlockSource {
public:
  virtual ~BlockSource() = default;
  // Fills `into` with block i's bytes. `next()` names the block asked for after it (-1: none),
  // whose first bytes a source may start reading meanwhile. Throws Error naming the block.
  virtual void read(int64_t block, std::byte* into, const std::function<int64_t()>& next) = 0;
  // The ring stops: waits for the reads a source started ahead.
  virtual void stop() {}
  // Block i's bytes are `bytes` at `memory` from its next read on (StagingReader::repoint; the
  // ring calls it with no read of that block under way). Default: Error, the source does not
  // read host memory.
  virtual void repoint(int64_t block, const std::byte* memory, std::size_t bytes);
};

class StagingRing : public StagingReader {
public:
  // `bytes[i]`: block i's size; `sources[i]`: where it is read from (null: it has nothing to
  // read). Checks that each staging buffer holds the largest block (Error naming `label`
  // otherwise) and starts the thread. `backend`: whose events release() is given, and whose
  // copy stream copy_after() orders (may be null when neither is used).
  StagingRing(std::vector<std::size_t> bytes, std::vector<std::shared_ptr<BlockSource>> sources,
              const std::vector<std::shared_ptr<Buffer>>& staging, std::string label,
              Backend* backend = nullptr);
  ~StagingRing() override; // stops the thread; reads in flight finish first

  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // As soon as its staging buffer is free, the thread reads it (read-ahead as deep as the ring).
  void request(int64_t block) override;
  Staged take() override;
  // Backend::wait_host on the copy stream.
  void copy_after(const Staged& staged) override;
  void wait(const Staged& staged) override;
  // The thread waits for `copied` (Backend::synchronize) before it reads into that buffer
  // again, so that a copy still in flight delays only the read that needs its buffer. A copy
  // that failed fails that read.
  void release(const Staged& staged, std::shared_ptr<const Event> copied = nullptr) override;
  // Forgets every requested block take() has not given (the caller's order changed): waits for
  // a read of one of them in flight, and frees their buffers.
  void cancel() override;
  // Under the ring's lock, so that the thread's next read of the block sees the new place.
  void repoint(int64_t block, const std::byte* memory, std::size_t bytes) override;
  uint64_t bytes_read() const override;
  int64_t blocks() const { return static_cast<int64_t>(bytes_.size()); }

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
  int64_t block_after() const; // the block asked for after the one being read (-1: none)

  std::vector<std::size_t> bytes_; // under the lock: repoint changes them
  const std::vector<std::shared_ptr<BlockSource>> sources_;
  std::size_t buffer_bytes_ = 0; // the smallest staging buffer's
  const std::string label_;
  Backend* backend_ = nullptr;
  const std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::deque<Free> free_;                   // in the order they are given out
  std::deque<std::shared_ptr<Read>> reads_; // asked, not yet both read and taken, in order
  const Read* reading_ = nullptr;           // the thread's, while it reads
  uint64_t bytes_read_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

} // namespace blockswap
