// One offloader's part of the node-shared host copy of the frozen weights (Options::node_sharing,
// docs/distributed.md). Implementer-only (src/torch).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "block_layout.hpp"
#include "blockswap/core/backend.hpp"
#include "blockswap/core/node_memory.hpp"
#include "blockswap/torch/options.hpp"

namespace blockswap::torch_frontend {

// Note [node sharing protocol] in the .cpp. Local rank 0 creates the memory and fills it (the
// offloader packs into host_memory()), then publish() seals it, publishes its ticket and waits
// until every other local rank has mapped it. The others wait for the ticket in the
// constructor, map the memory, and tell local rank 0 in publish(). A rank that fails before
// publish() tells the others why (fail(), or the destructor), so that no rank waits for it.
class NodeShare {
public:
  // Takes this offloader's keys; waits for nothing. Throws Error for a malformed `sharing`.
  NodeShare(NodeSharing sharing, std::string label);
  ~NodeShare();
  NodeShare(const NodeShare&) = delete;
  NodeShare& operator=(const NodeShare&) = delete;

  // Local rank 0 creates the memory for `layouts`; the others wait for its ticket and map it.
  // `compress`: the blocks' frozen bytes are stored compressed (Note [compressed node-shared
  // copy] in the .cpp): local rank 0 then fills the memory here, each block's bytes written by
  // `pack` (BlockBinder::pack_block) and encoded. Throws Error (naming the label) when local
  // rank 0 failed, when its ticket does not come within the store's timeout, or when its
  // blocks (or its compression) are not these.
  void open(const std::vector<BlockLayout>& layouts, bool compress = false,
            const std::function<void(int64_t, std::byte*)>& pack = {});
  // Whether this process fills the memory (local rank 0).
  bool fills() const { return sharing_.local_rank == 0; }
  // Whether the memory holds the blocks already: another rank's, or compressed here by open().
  bool filled() const { return !fills() || compress_; }
  // Per block, its part of the memory (EngineOptions::host_memory).
  const std::vector<std::shared_ptr<Buffer>>& host_memory() const { return blocks_; }
  // Per block, its frozen bytes compressed at the start of its part (0: raw; empty: none is;
  // EngineOptions::host_memory_compressed).
  const std::vector<std::size_t>& compressed_bytes() const { return compressed_; }
  // See the class comment. Throws Error naming a rank that failed or did not come.
  void publish();
  // Page-locks this process's mapping for `backend` (after publish()).
  void pin(Backend& backend);
  // Tells the other ranks why this one cannot go on, unless publish() has. Never throws.
  void fail(const std::string& why) noexcept;

private:
  std::string key(const std::string& name) const { return prefix_ + name; }
  void fill_compressed(const std::vector<BlockLayout>& layouts,
                       const std::function<void(int64_t, std::byte*)>& pack);
  void map_blocks(const std::vector<BlockLayout>& layouts);
  std::string get(const std::string& name, const std::string& waiting_for) const;

  NodeSharing sharing_;
  std::string label_;
  std::string prefix_;
  std::string fingerprint_;
  std::shared_ptr<NodeMemory> memory_;
  std::vector<std::shared_ptr<Buffer>> blocks_;
  Buffer pinned_;
  bool compress_ = false;
  std::vector<std::size_t> compressed_;
  bool published_ = false;
};

} // namespace blockswap::torch_frontend
