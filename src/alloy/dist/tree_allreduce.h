#pragma once
// An exact SUM all-reduce along a tree of the group's members (core/sync_tree.h says which tree
// and why): every member adds its children's partial sums to its own, chunk by chunk, and sends
// the result to its parent; the root's total comes back down the same edges. Chunks pipeline, so a
// buffer takes about its bytes over the slowest tree edge plus one chunk per level, and no slow
// pair the tree avoids carries anything.
//
// Exactness: every member ends with the root's bits (the same on all of them, so replicas stay
// identical); the root adds its children's sums in ascending member order, as every inner member
// does, so a run is reproducible. The order differs from Gloo's ring, which is why a set routes by
// tree only where the plan says a slow pair is among its members (SyncTree is empty otherwise).
//
// The sums run on a thread of their own, one after another in the order they were asked for (the
// order every member asks in: the reducer launches a group's buckets in bucket order), over a
// group used for nothing else. Every receive is bounded by the group's timeout; a failure ends
// the sum's Work with the error, which wait_work turns into a report naming the dead or stalled
// ranks.
#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "alloy/core/sync_tree.h"

namespace c10d {
class Work;
}

namespace alloy::dist {

class Group;

class TreeAllreduce {
 public:
  static constexpr int64_t kChunkBytes = kSyncTreeChunkBytes;
  // GROUP's ranks (ascending) are the tree's members in order.
  TreeAllreduce(std::shared_ptr<Group> group, SyncTree tree, int64_t chunk_bytes = kChunkBytes);
  ~TreeAllreduce();
  TreeAllreduce(const TreeAllreduce&) = delete;
  TreeAllreduce& operator=(const TreeAllreduce&) = delete;

  // Asynchronous SUM in place of a contiguous host tensor; wait() on the handle.
  c10::intrusive_ptr<c10d::Work> allreduce_sum(at::Tensor& t);
  const SyncTree& tree() const { return tree_; }

 private:
  struct Job;
  void run();
  void sum(at::Tensor& flat, int64_t seq);

  std::shared_ptr<Group> group_;
  SyncTree tree_;
  int64_t chunk_bytes_;
  int me_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Job>> queue_;
  bool stop_ = false;
  int64_t seq_ = 0;
  std::thread worker_;
};

}  // namespace alloy::dist
