// The staging ring's protocol and its thread (core/staging_ring.hpp); the reads themselves are
// its sources' (core/file_source.hpp).
#include "blockswap/core/staging_ring.hpp"

#include <algorithm>
#include <new>
#include <utility>

#include "blockswap/core/error.hpp"

namespace blockswap {

StagingRing::StagingRing(std::vector<std::size_t> bytes,
                         std::vector<std::shared_ptr<BlockSource>> sources,
                         const std::vector<std::shared_ptr<Buffer>>& staging, std::string label,
                         Backend* backend)
    : bytes_(std::move(bytes)), sources_(std::move(sources)), label_(std::move(label)),
      backend_(backend) {
  BLOCKSWAP_ASSERT(sources_.size() == bytes_.size(), "a source per block");
  for (const auto& buffer : staging) free_.push_back(Free{buffer, {}});
  BLOCKSWAP_CHECK_ARGUMENT(!free_.empty(), "[", label_,
                           "] the file tier needs at least one "
                           "staging buffer");
  std::size_t largest = 0;
  for (std::size_t b : bytes_) largest = std::max(largest, b);
  buffer_bytes_ = free_.front().buffer ? free_.front().buffer->size() : 0;
  for (const auto& [buffer, copied] : free_) {
    BLOCKSWAP_CHECK(buffer && buffer->size() >= largest, "[", label_, "] a staging buffer of ",
                    buffer ? buffer->size() : 0, " bytes cannot hold the largest block (", largest,
                    " bytes)");
    buffer_bytes_ = std::min(buffer_bytes_, buffer->size());
  }
  thread_ = std::thread([this] { run(); });
}

StagingRing::~StagingRing() {
  {
    std::lock_guard lock(shared_->mutex);
    stopping_ = true;
  }
  shared_->changed.notify_all();
  thread_.join();
}

StagingReader::Staged StagingReader::next() {
  const Staged staged = take();
  try {
    wait(staged);
  } catch (...) {
    release(staged);
    throw;
  }
  return staged;
}

void StagingRing::give_buffers() {
  for (const std::shared_ptr<Read>& read : reads_) {
    if (free_.empty()) return;
    if (read->into.buffer) continue;
    read->into = std::move(free_.front());
    free_.pop_front();
  }
}

void StagingRing::request(int64_t block) {
  BLOCKSWAP_CHECK(block >= 0 && block < blocks(), "[", label_, "] block index ", block,
                  " is out of range for the staging ring's ", blocks(), " blocks");
  {
    std::lock_guard lock(shared_->mutex);
    auto read = std::make_shared<Read>();
    read->block = block;
    reads_.push_back(std::move(read));
    give_buffers();
  }
  shared_->changed.notify_all();
}

StagingReader::Staged StagingRing::take() {
  std::lock_guard lock(shared_->mutex);
  const auto it = std::find_if(reads_.begin(), reads_.end(),
                               [](const std::shared_ptr<Read>& r) { return !r->taken; });
  BLOCKSWAP_CHECK(it != reads_.end(), "[", label_, "] take() with no block requested");
  const std::shared_ptr<Read> read = *it;
  BLOCKSWAP_CHECK(read->into.buffer != nullptr, "[", label_,
                  "] every staging buffer is held: release() blocks before taking more");
  read->taken = true;
  if (read->done) reads_.erase(it);
  return Staged{read->block, read->into.buffer, read};
}

void StagingRing::copy_after(const Staged& staged) {
  BLOCKSWAP_CHECK(backend_ != nullptr, "[", label_,
                  "] the file reader was given no backend to order a copy with");
  backend_->wait_host(Stream::copy, [shared = shared_, read = staged.read] {
    const auto* r = static_cast<const Read*>(read.get());
    std::unique_lock lock(shared->mutex);
    shared->changed.wait(lock, [&] { return r->done; });
  });
}

void StagingRing::Failure::raise() const {
  switch (kind) {
  case Kind::out_of_memory:
    throw OutOfMemory(what);
  case Kind::invalid_argument:
    throw InvalidArgument(what);
  default:
    throw Error(what);
  }
}

void StagingRing::wait(const Staged& staged) {
  const auto* read = static_cast<const Read*>(staged.read.get());
  BLOCKSWAP_CHECK(read != nullptr, "[", label_, "] wait() for a block take() did not give");
  std::unique_lock lock(shared_->mutex);
  shared_->changed.wait(lock, [&] { return read->done; });
  if (read->failure) read->failure.raise();
}

void StagingRing::release(const Staged& staged, std::shared_ptr<const Event> copied) {
  if (!staged.buffer) return;
  BLOCKSWAP_CHECK(copied == nullptr || backend_ != nullptr, "[", label_,
                  "] the file reader was given no backend to wait for a copy with");
  std::function<void()> wait;
  if (copied != nullptr) {
    wait = [backend = backend_, copied = std::move(copied)] { backend->synchronize(*copied); };
  }
  {
    std::lock_guard lock(shared_->mutex);
    free_.push_back(Free{staged.buffer, std::move(wait)});
    give_buffers();
  }
  shared_->changed.notify_all();
}

void StagingRing::cancel() {
  std::unique_lock lock(shared_->mutex);
  shared_->changed.wait(lock, [&] { return reading_ == nullptr || reading_->taken; });
  std::deque<Free> freed; // they were to be given first, and are again
  std::erase_if(reads_, [&](const std::shared_ptr<Read>& r) {
    if (r->taken) return false;
    if (r->into.buffer) freed.push_back(std::move(r->into));
    return true;
  });
  free_.insert(free_.begin(), std::make_move_iterator(freed.begin()),
               std::make_move_iterator(freed.end()));
}

void BlockSource::repoint(int64_t block, const std::byte* /*memory*/, std::size_t /*bytes*/) {
  throw Error(detail::concat("block ", block,
                             " is not read from host memory: only such a block can be given a "
                             "new place to read from"));
}

void StagingRing::repoint(int64_t block, const std::byte* memory, std::size_t bytes) {
  BLOCKSWAP_CHECK(block >= 0 && block < blocks(), "[", label_, "] block index ", block,
                  " is out of range for the staging ring's ", blocks(), " blocks");
  BLOCKSWAP_CHECK(bytes <= buffer_bytes_, "[", label_, "] block ", block, " cannot take ", bytes,
                  " bytes: a staging buffer holds ", buffer_bytes_);
  std::lock_guard lock(shared_->mutex);
  BLOCKSWAP_CHECK(sources_[block] != nullptr, "[", label_, "] block ", block,
                  " is never staged: it has no place to read from");
  for (const std::shared_ptr<Read>& r : reads_) {
    BLOCKSWAP_CHECK(r->block != block, "[", label_, "] block ", block,
                    " is given a new place while a read of it is requested: cancel() first");
  }
  sources_[block]->repoint(block, memory, bytes);
  bytes_[block] = bytes;
}

uint64_t StagingRing::bytes_read() const {
  std::lock_guard lock(shared_->mutex);
  return bytes_read_;
}

// Reads in the order asked, each once its buffer is free. Stopping, the blocks already taken are
// still read: the copy stream may wait for them.
void StagingRing::run() {
  std::unique_lock lock(shared_->mutex);
  while (true) {
    std::shared_ptr<Read> read;
    shared_->changed.wait(lock, [&] {
      read = nullptr;
      for (const std::shared_ptr<Read>& r : reads_) {
        if (!r->done) {
          read = r;
          break;
        }
      }
      if (stopping_) return true;
      return read != nullptr && read->into.buffer != nullptr;
    });
    if (read == nullptr || read->into.buffer == nullptr || (stopping_ && !read->taken)) {
      lock.unlock();
      for (const std::shared_ptr<BlockSource>& source : sources_) {
        if (source) source->stop(); // reads ahead write into its memory
      }
      return;
    }
    reading_ = read.get();
    const std::function<void()> copied = std::exchange(read->into.copied, {});
    std::byte* const into = read->into.buffer->data();
    const int64_t block = read->block;
    lock.unlock();
    Failure failure;
    try {
      if (copied) copied(); // the copy out of this buffer is done
      if (const std::shared_ptr<BlockSource>& source = sources_[block]) {
        source->read(block, into, [this] { return block_after(); });
      }
    } catch (const OutOfMemory& e) {
      failure = {Failure::Kind::out_of_memory, e.what()};
    } catch (const InvalidArgument& e) {
      failure = {Failure::Kind::invalid_argument, e.what()};
    } catch (const Error& e) { // blockswap's own name the block
      failure = {Failure::Kind::error, e.what()};
    } catch (const std::bad_alloc&) {
      failure = {Failure::Kind::out_of_memory,
                 detail::concat("[", label_, "] reading block ", block, ": out of host memory")};
    } catch (const std::exception& e) { // a source's own: named here
      failure = {Failure::Kind::error,
                 detail::concat("[", label_, "] reading block ", block, ": ", e.what())};
    } catch (...) {
      failure = {Failure::Kind::error, detail::concat("[", label_, "] reading block ", block,
                                                      " failed with an unknown error")};
    }
    lock.lock();
    read->done = true;
    read->failure = std::move(failure);
    reading_ = nullptr;
    if (read->taken) std::erase(reads_, read);
    if (!failure) bytes_read_ += bytes_[block];
    shared_->changed.notify_all();
  }
}

int64_t StagingRing::block_after() const {
  std::lock_guard lock(shared_->mutex);
  if (stopping_) return -1;
  bool past = false; // reads_ is in the order asked; the one being read is reading_
  for (const std::shared_ptr<Read>& r : reads_) {
    if (past && !r->done) return r->block;
    past = past || r.get() == reading_;
  }
  return -1;
}

} // namespace blockswap
