#pragma once
// An exact SUM all-reduce along a tree of the group's members (core/sync_tree.h says which tree
// and why): every member adds its children's partial sums to its own, chunk by chunk, and sends
// the result to its parent; the root's total comes back down the same edges. Chunks pipeline, so a
// buffer takes about its bytes over the slowest tree edge plus one chunk per level, and no slow
// pair the tree avoids carries anything. A tree rooted at an edge (SyncTree::twin) swaps the two
// ends' partial sums over it, each way at once, and both ends send the total down their sides.
//
// Exactness: every member ends with the root's bits (the same on all of them, so replicas stay
// identical); the root adds its children's sums in ascending member order, as every inner member
// does, so a run is reproducible (paired with a twin, it adds the twin's last, and the twin adds
// its own partial to the root's: P_root + P_twin on both). The order differs from Gloo's ring, which is why a set routes by
// tree only where the plan says a slow pair is among its members (SyncTree is empty otherwise).
//
// Stripes (core/sync_tree.h, sync_trees): with several trees, a buffer is cut into as many
// contiguous slices and slice s is summed along tree s, all at once, so two regions joined by
// several slow lines use them side by side. Each element still follows one fixed tree, so the bits
// are the same on every member and in every run.
//
// The sums are taken in the order they were asked for (the order every member asks in: the
// reducer launches a group's buckets in bucket order), over a group used for nothing else, on two
// threads: one sends a sum's partials up (and, at a root, its total down) and then starts the next
// sum, the other passes totals down as they arrive and completes the sums. So a bucket's partial
// sums climb while the bucket before it is still coming down, and a run of buckets pays the
// tree's round trip once, not once a bucket: over a distant link (40 ms each way) that round trip
// was most of a megabyte bucket's time. Every receive is bounded by the group's timeout; a failure
// ends the sum's Work with the error, which wait_work turns into a report naming the dead or
// stalled ranks.
#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "alloy/core/sync_tree.h"

namespace c10d {
class Work;
}

namespace alloy::dist {

class Group;

class TreeAllreduce {
 public:
  static constexpr int64_t kChunkBytes = kSyncTreeChunkBytes;
  static constexpr int kMaxStripes = 4;  // a stripe takes two bits of a message's tag
  // GROUP's ranks (ascending) are the trees' members in order; one tree or several (stripes).
  TreeAllreduce(std::shared_ptr<Group> group, std::vector<SyncTree> stripes, int64_t chunk_bytes = kChunkBytes);
  ~TreeAllreduce();
  TreeAllreduce(const TreeAllreduce&) = delete;
  TreeAllreduce& operator=(const TreeAllreduce&) = delete;

  // Asynchronous SUM in place of a contiguous host tensor; wait() on the handle.
  c10::intrusive_ptr<c10d::Work> allreduce_sum(at::Tensor& t);
  const SyncTree& tree() const { return stripes_.front(); }
  const std::vector<SyncTree>& stripes() const { return stripes_; }

 private:
  struct Job;
  void run_up();
  void run_down();
  void up(Job& job);    // posts every receive, sends the partial sums up (a root: the totals down)
  void down(Job& job);  // passes the totals down, waits for every send, leaves the total in place

  std::shared_ptr<Group> group_;
  std::vector<SyncTree> stripes_;
  int64_t chunk_bytes_;
  int me_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Job>> up_queue_, down_queue_;
  bool stop_ = false, up_done_ = false;
  int64_t seq_ = 0;
  std::thread up_worker_, down_worker_;
};

}  // namespace alloy::dist
