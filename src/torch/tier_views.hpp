// Where a block's frozen tensors are while the block is off the device, by the source of their
// bytes: the block's host copy, or the model's file mapped (the file tier); and what a caller's
// change to them comes to where that source cannot take it. BlockBinder asks it for every frozen
// view it binds; a new source of frozen bytes is one more case here. Implementer-only
// (src/torch).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "block_layout.hpp"
#include "blockswap/core/backend.hpp"
#include "file_weights.hpp"

namespace blockswap::torch_frontend {

class TierViews {
public:
  // `label` prefixes its messages.
  explicit TierViews(std::string label) : label_(std::move(label)) {}

  // With the model's file (Options::weights_file), before the host copies are filled:
  // `in_file[b]` says which blocks the engine reads from the file for each load (the file tier,
  // Options::host_budget_bytes); their frozen views are views of `map` (the file, mapped:
  // file_weights.hpp) at their file and file_offset, and a change of theirs cannot be kept, as the
  // next load reads the file. `read`, when set, fills a block's packed host copy from the file
  // instead of from its tensors, which were built empty (Options::weights_from_file). `path` is the
  // file's: if the mapped file shrinks under the run (check_sources), those views could only
  // crash the process (SIGBUS), so they become tensors with no elements and a warning says so (a
  // file deleted or renamed keeps them).
  void use_file(FileMap map, std::vector<bool> in_file,
                std::function<void(int64_t block, std::byte* packed)> read, std::string path);
  // The blocks' host copies (Engine::host_buffer: null for a block with none), in block order.
  void use_host_copies(std::vector<std::shared_ptr<Buffer>> hosts) { hosts_ = std::move(hosts); }
  // Note [compressed frozen views] in the .cpp: block `block`'s host copy is now `host`, whose
  // first `compressed_bytes` are its frozen bytes compressed (Engine::compress).
  void use_compressed(int64_t block, std::shared_ptr<Buffer> host, std::size_t compressed_bytes);
  // Whether the block's frozen bytes exist only compressed: its frozen views have no elements
  // (until decode_host_copy).
  bool compressed(int64_t block) const {
    const auto b = static_cast<std::size_t>(block);
    return !compressed_bytes_.empty() && compressed_bytes_[b] > 0 && !decoded_[b];
  }
  // Decodes a compressed block's frozen bytes into host memory of their own (once), which its
  // frozen views show from then on: for the weights the offloader leaves behind at close.
  // Throws Error where the compressed bytes are damaged.
  void decode_host_copy(int64_t block, std::size_t frozen_bytes);
  // A compressed block's frozen bytes decoded into host memory of their own, for one reader (a
  // state_dict, a copy of the model): nothing is kept, the views stay as they are. Throws Error
  // where the compressed bytes are damaged.
  std::shared_ptr<Buffer> decoded_frozen(int64_t block, std::size_t frozen_bytes) const;
  // Each frozen tensor of a compressed block (its variable) with its true values in host memory
  // of their own (decoded_frozen); empty for a block that is not compressed.
  std::vector<std::pair<at::Tensor, at::Tensor>> frozen_values(int64_t block,
                                                               const BlockLayout& layout) const;

  // What the module's tensors must still fill of block `block`'s host copy once its source has
  // filled what it holds: everything; all but the frozen tensors, which were read from the file
  // (weights_from_file); or nothing, as the block has no host copy (a block in the file holds
  // frozen tensors only). Throws Error when the read fails.
  enum class Fill { everything, all_but_frozen, nothing };
  Fill fill_host_copy(int64_t block);

  // Frozen tensor `t` of block `block` off the device: a CPU tensor over the memory that holds
  // its values (sharing it: the weights outlive the engine), or one with no elements where that
  // memory can no longer be read (viewable).
  at::Tensor frozen(int64_t block, const PackedTensor& t) const;
  // Whether a caller's change to the block's frozen tensors cannot be kept, as their source is
  // not a host copy (the file): such a change goes through matches_source, and what cannot be
  // kept through dropped (Note [changes to the file tier] in the .cpp).
  bool read_only(int64_t block) const {
    return !in_file_.empty() && in_file_[static_cast<std::size_t>(block)];
  }
  // Whether frozen() of the block's tensors holds values: false once its source was lost.
  bool viewable(int64_t block) const { return !(read_only(block) && file_gone_); }
  // Whether a source was lost just now (the mapped file shrank): true once, with a warning; the
  // frozen views of the blocks that are no longer viewable must be bound again. Never throws.
  bool check_sources() noexcept;

  // Whether `now`, the caller's frozen tensor `t` of a read_only block, holds its source's
  // values, so that the change may be kept as it is. First puts the source's values back where
  // the change reached the source's own memory (a write into a view of the mapped file).
  bool matches_source(int64_t block, const PackedTensor& t, const at::Tensor& now);
  // Notes that the caller's change to that tensor was dropped: it holds the source's values
  // again.
  void dropped(int64_t block, const PackedTensor& t);
  // Notes that the caller wrote a compressed block's frozen tensor while it had no elements
  // (off the device: Note [changed compressed weights] in block_binder.cpp): the write did
  // nothing, and the tensor holds its true values again.
  void dropped_compressed(int64_t block, const PackedTensor& t);
  bool any_dropped() const { return !dropped_.empty() || !dropped_compressed_.empty(); }
  // Throws the Error that names the changes dropped since the last one, if any, and forgets
  // them.
  void raise_dropped();

private:
  std::string label_;
  std::vector<std::shared_ptr<Buffer>> hosts_;   // [block]
  std::vector<std::size_t> compressed_bytes_;    // [block]: 0 (empty: every block) for raw ones
  std::vector<std::shared_ptr<Buffer>> decoded_; // [block]: decode_host_copy's
  FileMap file_map_;
  std::vector<bool> in_file_; // empty: no block
  std::function<void(int64_t, std::byte*)> read_;
  std::string file_path_;
  bool file_gone_ = false;           // the file shrank: its blocks' views were dropped
  std::vector<std::string> dropped_; // Note [changes to the file tier]
  std::vector<std::string> dropped_compressed_;
};

} // namespace blockswap::torch_frontend
