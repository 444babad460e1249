#include "blockswap/core/activation_rule.hpp"

#include "blockswap/core/error.hpp"

namespace blockswap {

std::vector<ActivationRule::Group> ActivationRule::open(Group g) {
  BLOCKSWAP_CHECK(groups_.empty() || g > groups_.rbegin()->first, "activation rule: group ", g,
                  " opens after group ", groups_.rbegin()->first,
                  "; groups open in increasing order");
  std::vector<Group> out;
  for (const Group earlier : on_device_) {
    Record& record = groups_.at(earlier);
    record.out = true; // a group that saved nothing is out too: nothing of it is left to move
    if (record.saved) out.push_back(earlier);
  }
  on_device_.clear();
  groups_.emplace(g, Record{});
  on_device_.insert(g);
  return out;
}

void ActivationRule::saved(Group g) {
  const auto it = groups_.find(g);
  BLOCKSWAP_ASSERT(it != groups_.end());
  it->second.saved = true;
}

ActivationRule::Restore ActivationRule::backward_starts(Group g) {
  const auto it = groups_.find(g);
  if (it == groups_.end() || it->second.started) return {};
  Record& record = it->second;
  record.started = true;
  on_device_.erase(g);
  Restore restore;
  if (record.saved && record.out && !record.back) {
    record.back = true;
    restore.own = true;
  }
  // The group saved last before g that is in host memory with its backward still to come.
  for (auto earlier = std::make_reverse_iterator(it); earlier != groups_.rend(); ++earlier) {
    Record& candidate = earlier->second;
    if (!candidate.saved || !candidate.out || candidate.started) continue;
    if (!candidate.back) {
      candidate.back = true;
      restore.ahead = earlier->first;
    }
    break; // brought back already: nothing more ahead
  }
  return restore;
}

void ActivationRule::forget(Group g) {
  groups_.erase(g);
  on_device_.erase(g);
}

bool ActivationRule::out(Group g) const {
  const auto it = groups_.find(g);
  return it != groups_.end() && it->second.saved && it->second.out;
}

std::size_t ActivationRule::size() const {
  return groups_.size();
}

} // namespace blockswap
