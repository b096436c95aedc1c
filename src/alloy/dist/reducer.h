#pragma once
// Gradient sync overlapped with backward. Parameters are grouped by the set of ranks that hold
// them (one process group per distinct set: data-parallel replicas of a layer, and the GPT-2
// embedding shared by a first and a last stage), then into buckets in backward order, capped at
// bucket_mb. During the last micro-batch's backward a hook on each parameter marks its gradient
// ready; when a bucket is complete its all-reduce (SUM) starts at once on the group's background
// threads while backward continues. finish() waits for every bucket and writes the sums back.
//
// Exactness: each micro-batch's loss is already divided by the tokens of the whole global batch,
// so the SUM over holders is the one-device gradient. No averaging anywhere.
//
// Compression (grad_sync.compression, opt-in): a set whose group is marked compressed syncs
// through a CompressedSync (fuse -> compress -> exchange -> decompress on a worker thread of the
// set, see compressed_sync.h) instead of dense buckets; the other sets stay exact. The dense path
// is the same code with or without compression elsewhere, so `none` is bit for bit what it was.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "alloy/dist/compressed_sync.h"
#include "alloy/model/transformer.h"

namespace c10d {
class Work;
}

namespace alloy::dist {

class Group;

struct ReducerStats {
  double wait_s = 0;      // time finish() spent waiting for communication that backward did not hide
  int64_t buckets = 0;
  int64_t bytes = 0;      // dense gradient bytes reduced (the buckets' size)
  int64_t bytes_sent = 0; // what this rank put on the wire for them (ring: 2(n-1)/n of each bucket)
  // Compressed sets (zero without compression):
  CompressedSyncStats compressed;  // summed over this rank's compressed sets; spans of all of them
};

class Reducer {
 public:
  struct ParamGroup {
    std::shared_ptr<Group> group;          // null when only this rank holds the parameters
    std::vector<model::Param*> params;     // in backward order
    std::shared_ptr<CompressedSync> compressed;  // set: this group's gradients go compressed
    // ZeRO-2 (dist/sharding.h): the owners' bounds in the group's flat order (PARAMS concatenated);
    // each bucket is reduced onto the owners of its elements instead of all-reduced, and a
    // parameter's .grad holds the sum only in this rank's range (elsewhere: unspecified).
    std::vector<int64_t> reduce_to;
    // ZeRO-3 (dist/zero3.h), with reduce_to: this rank's range of the reduced gradient goes here
    // (flat, the range's length) instead of into .grad, which is dropped, and the buckets' buffers
    // exist only from the first gradient of the last micro-batch to the end of the sync.
    at::Tensor grad_shard;
  };
  Reducer(std::vector<ParamGroup> groups, double bucket_mb);
  ~Reducer();

  // Call at the start of each optimizer step (STEP 0-based; ORIGIN the trace clock).
  void begin_step(int64_t step, std::chrono::steady_clock::time_point origin);
  // Call before the backward of the last micro-batch: from then on, gradients that become ready
  // are reduced as their buckets fill.
  void arm();
  // Waits for all buckets and leaves the reduced gradients in the parameters' .grad.
  ReducerStats finish();
  bool armed() const { return armed_; }  // between arm() and finish(): the last micro-batch's backward
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  const std::vector<std::shared_ptr<CompressedSync>>& compressed() const { return compressed_; }

  // For tests and benchmarks: start every bucket now (no hooks), as if all gradients were ready.
  void reduce_all_now();

 private:
  struct Bucket;
  void on_grad_ready(size_t bucket, size_t slot, const at::Tensor& incoming);
  void launch(Bucket& b);  // and the group's following buckets that are complete
  void launch_one(Bucket& b);
  static at::Tensor& flat_of(Bucket& b);

  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::shared_ptr<CompressedSync>> compressed_;
  bool armed_ = false;
  int64_t step_ = 0;
  std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
};

}  // namespace alloy::dist
