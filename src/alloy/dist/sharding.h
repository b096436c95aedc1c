#pragma once
// Sharded data parallelism (ZeRO) per holder set, with uneven shards.
//
// A holder set's parameters, concatenated in backward order (the order the Reducer fills its
// buckets in), form the set's flat buffer. Each member owns one contiguous range of it, sized by
// its share (train.shard_ratio: by memory or speed, not 1/N), and keeps AdamW's moments for that
// range only:
//   stage 1 (ZeRO-1, Megatron's distributed optimizer): gradients are all-reduced as without
//           sharding; each member updates its range; the updated ranges are all-gathered.
//   stage 2 (ZeRO-2): each bucket's gradient is reduced onto the owners of its elements instead of
//           all-reduced (a reduce-scatter: Gloo has none, so one reduce per owner the bucket
//           touches); then as stage 1.
// Exactness: AdamW is element-wise, so updating a range equals updating the whole tensor there;
// the gradient norm for clipping is summed over the owned ranges (each element counted once), as
// the one-device norm up to summation order.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "alloy/model/transformer.h"

namespace c10d {
class Work;
}

namespace alloy::dist {

class Group;

// Boundaries of N elements split by SHARES (positive, any scale): SHARES.size() + 1 ascending
// offsets from 0 to N; member i owns [b[i], b[i+1]).
std::vector<int64_t> shard_bounds(int64_t n, const std::vector<double>& shares);

// The parts of PARAMS (concatenated in order) that fall in the flat range [LO, HI), in order: they
// cover the range contiguously.
std::vector<model::ParamSlice> slices_in(const std::vector<model::Param*>& params, int64_t lo, int64_t hi);

// The shares of the members RANKS (sorted global ranks) of one holder set: RATIO empty (even), as
// many entries as the set has members (in rank order), or one per rank of the world (each
// member's entry). Anything else throws InputError naming FIELD.
std::vector<double> set_shares(const std::vector<int>& ranks, const std::vector<double>& ratio, int world_size,
                               const std::string& field);

// The all-gather of a set's flat range [LO, LO + STAGING.numel()) into STAGING, which holds this
// rank's own part of it already: one broadcast from each member whose range overlaps it (Gloo has
// no uneven all-gather). Returns the posted works with their roots (group ranks).
std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, int>> gather_from_owners(Group& group, const std::vector<int64_t>& bounds,
                                                                                 int64_t lo, at::Tensor& staging);

class Sharding {
 public:
  struct Set {
    std::shared_ptr<Group> group;
    std::vector<model::Param*> params;  // backward order: the set's flat order
    std::vector<int64_t> bounds;        // group rank i owns [bounds[i], bounds[i + 1])
  };
  explicit Sharding(std::vector<Set> sets);

  // After the optimizer step: every member's updated range to every member. The staging buffer
  // (host memory, for Gloo) exists only during the call: call it after the gradients are freed,
  // so that it takes their place instead of adding a set's worth of bytes to the peak.
  void gather_params();
  // What gather_params() puts on the wire from this rank, counted as a ring all-gather would:
  // (n - 1) / n of each set's parameter bytes.
  int64_t gather_bytes_sent() const;

 private:
  std::vector<Set> sets_;
  std::vector<int64_t> numel_;  // per set: elements (the staging buffer's size)
};

}  // namespace alloy::dist
