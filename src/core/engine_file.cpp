// The engine's file tier: blocks read from the model's file for each load (DESIGN.md, "Tiers").
#include "engine_impl.hpp"

#include <algorithm>

#include "blockswap/core/error.hpp"

namespace blockswap {

// Note [the file tier]
// A block in the file has no host copy. A reader thread (core/file_reader.hpp) reads its bytes
// into one of a ring of pinned staging buffers, and its load copies them from there to its slot
// on the copy stream; the buffer is read into again only after that copy (an event the reader
// waits for from its thread), so a copy in flight delays only the read that needs its buffer.
//
// Reads run ahead in the order the loads will come: the current schedule's pass (its moves, in
// order, cycling into the next pass), or prepare's placements. A load that is not the one read
// ahead (a call pattern the schedule did not foresee: a recompute, a skipped block, a mode
// switch) cancels the reads ahead and reads its own block first, then the prediction goes on from
// that block's place in the pass: slower once, never different bytes. Every load of a block in
// the file reads the file again; what the block had on the device is never kept, as it is frozen.
void Engine::Impl::start_file_tier() {
  const FileTier& file = *options_.file;
  BLOCKSWAP_CHECK_ARGUMENT(file.blocks.size() == blocks_.size(), "[", label_,
                           "] the file tier has ", file.blocks.size(), " blocks for ",
                           blocks_.size(), ": give every block's place in the file");
  BLOCKSWAP_CHECK_ARGUMENT(file.staging_buffers >= 1, "[", label_,
                           "] the file tier needs at least one staging buffer, not ",
                           file.staging_buffers);
  for (int64_t b = 0; b < blocks(); ++b) {
    BLOCKSWAP_CHECK_ARGUMENT(!store_.in_file(b) || file.blocks[b].bytes == store_.bytes(b), "[",
                             label_, "] block ", b, " has ", store_.bytes(b),
                             " packed bytes, but its place in the file fills ",
                             file.blocks[b].bytes);
  }
  int64_t in_file = 0;
  for (int64_t b = 0; b < blocks(); ++b) in_file += store_.in_file(b) ? 1 : 0;
  if (in_file == 0) return; // the host budget holds every block
  // More buffers than blocks in the file would never be read into.
  std::vector<std::shared_ptr<Buffer>> staging;
  for (int64_t i = 0; i < std::min(file.staging_buffers, in_file); ++i) {
    staging.push_back(std::make_shared<Buffer>(backend_->allocate_host(slot_bytes_)));
    staging_copied_.emplace_back(staging.back().get(), backend_->make_event());
  }
  std::vector<FileBlock> blocks = file.blocks;
  for (int64_t b = 0; b < this->blocks(); ++b) {
    if (!store_.in_file(b)) blocks[b] = FileBlock{}; // never read: checked by its own reader
  }
  reader_ =
      std::make_unique<FileReader>(file.path, std::move(blocks), staging, label_, file.bypass);
  plan_reads();
}

void Engine::Impl::plan_reads() {
  if (!reader_) return;
  file_order_.clear();
  for (const Op& op : current().pass()) {
    if (op.kind == Op::Kind::move && store_.in_file(op.move.in)) file_order_.push_back(op.move.in);
  }
  file_cursor_ = 0;
}

void Engine::Impl::expect_loads(const std::vector<int64_t>& blocks) {
  if (!reader_) return;
  reader_->cancel();
  file_ahead_.clear();
  for (int64_t b : blocks) {
    if (!store_.in_file(b)) continue;
    reader_->request(b);
    file_ahead_.push_back(b);
  }
  file_cursor_ = 0; // then the pass
}

FileReader::Staged Engine::Impl::take_from_file(int64_t block) {
  if (file_ahead_.empty() || file_ahead_.front() != block) { // Note [the file tier]
    reader_->cancel();
    file_ahead_.clear();
    reader_->request(block);
    file_ahead_.push_back(block);
    const auto at = std::find(file_order_.begin(), file_order_.end(), block);
    if (at != file_order_.end()) {
      file_cursor_ = static_cast<std::size_t>(at - file_order_.begin() + 1) % file_order_.size();
    }
  }
  file_ahead_.pop_front();
  FileReader::Staged staged = reader_->next(); // rethrows the read's failure
  read_ahead();
  return staged;
}

void Engine::Impl::read_ahead() {
  const std::size_t depth = staging_copied_.size();
  while (!file_order_.empty() && file_ahead_.size() < depth) {
    const int64_t b = file_order_[file_cursor_];
    file_cursor_ = (file_cursor_ + 1) % file_order_.size();
    reader_->request(b);
    file_ahead_.push_back(b);
  }
}

void Engine::Impl::load_from_file(int64_t block, std::byte* slot) {
  FileReader::Staged staged;
  try {
    staged = take_from_file(block);
  } catch (...) {
    if (listener_ != nullptr) listener_->on_file_failed();
    throw;
  }
  const std::size_t bytes = store_.bytes(block);
  backend_->copy_to_device(slot, staged.buffer->data(), bytes, block);
  Event* copied = nullptr;
  for (auto& [buffer, event] : staging_copied_) {
    if (buffer == staged.buffer.get()) copied = event.get();
  }
  BLOCKSWAP_ASSERT(copied != nullptr, "a staging buffer the engine did not make");
  backend_->record(*copied, Stream::copy);
  reader_->release(staged, [backend = backend_, copied] { backend->synchronize(*copied); });
  stats_.disk_bytes += bytes;
}

} // namespace blockswap
