// The ranks of a node as threads of one process, for the node-sharing tests
// (node_sharing_test.cpp): a c10d-like store they meet
// through, and a way to run each rank.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "test_model.hpp"

namespace blockswap {
namespace {

// A c10d-like store: get waits for the key until the timeout. Each offloader a process builds
// takes the next number in its keys; the ranks here are threads of one process, so the store
// drops that number (each test builds one offloader per rank).
class TestStore {
public:
  explicit TestStore(std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : timeout_(timeout) {}

  NodeSharing rank(int64_t local_rank, int64_t local_world_size, std::string group = "") {
    NodeSharing sharing;
    sharing.set = [this](const std::string& key, const std::string& value) {
      std::lock_guard lock(mutex_);
      values_[without_number(key)] = value;
      changed_.notify_all();
    };
    sharing.get = [this](const std::string& key) {
      std::unique_lock lock(mutex_);
      const std::string k = without_number(key);
      if (!changed_.wait_for(lock, timeout_, [&] { return values_.contains(k); })) {
        throw std::runtime_error("timeout waiting for key " + k);
      }
      return values_[k];
    };
    sharing.local_rank = local_rank;
    sharing.local_world_size = local_world_size;
    sharing.group = std::move(group);
    return sharing;
  }

private:
  // "blockswap/<host>/[group-<g>/]<label>/<n>/<what>" without "<n>/".
  static std::string without_number(const std::string& key) {
    std::size_t at = 0;
    const int slashes = key.find("/group-") != std::string::npos ? 4 : 3;
    for (int slash = 0; slash < slashes; ++slash) at = key.find('/', at) + 1;
    return key.substr(0, at) + key.substr(key.find('/', at) + 1);
  }
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

Options shared_options(int64_t k, NodeSharing sharing) {
  Options o = options(k, true);
  o.node_sharing = std::move(sharing);
  return o;
}

// Runs f(rank) for each rank on a thread of its own; returns each one's error ("" if none).
std::vector<std::string> on_ranks(int64_t ranks, const std::function<void(int64_t)>& f) {
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

} // namespace
} // namespace blockswap
