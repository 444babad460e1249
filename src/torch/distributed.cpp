#include "blockswap/distributed.hpp"

#include <string>
#include <vector>

#include "blockswap/core/error.hpp"

namespace blockswap {

NodeSharing node_sharing(const c10::intrusive_ptr<c10d::Store>& store, int64_t local_rank,
                         int64_t local_world_size) {
  BLOCKSWAP_CHECK(store, "node_sharing needs the job's c10d store, not a null one");
  NodeSharing sharing;
  sharing.set = [store](const std::string& key, const std::string& value) {
    store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  };
  sharing.get = [store](const std::string& key) {
    const std::vector<uint8_t> value = store->get(key);
    return std::string(value.begin(), value.end());
  };
  sharing.local_rank = local_rank;
  sharing.local_world_size = local_world_size;
  return sharing;
}

} // namespace blockswap
