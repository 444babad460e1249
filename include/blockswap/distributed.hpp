// Data-parallel training with blockswap in C++ (docs/distributed.md):
//
//   #include <blockswap/distributed.hpp>
//   auto store = c10::make_intrusive<c10d::TCPStore>(...);   // the job's store
//   blockswap::Options options;
//   options.node_sharing = blockswap::node_sharing(store, local_rank, local_world_size);
//
// The ranks of a node then read one host copy of the swapped weights. The gradient all-reduce
// stays the caller's (c10d's ProcessGroupGloo or ProcessGroupNCCL over the same store).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>

#include "blockswap/torch.hpp"

namespace blockswap {

// Options::node_sharing over a c10d store: its set and its get (which waits for the key, up to
// the store's timeout). Throws Error for a null store.
NodeSharing node_sharing(const c10::intrusive_ptr<c10d::Store>& store, int64_t local_rank,
                         int64_t local_world_size);

} // namespace blockswap
