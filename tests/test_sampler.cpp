#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <set>

#include "alloy/data/sampler.h"

using alloy::data::GlobalBatchSampler;

// Over any whole number of epochs every sample appears exactly once per epoch, and positions are
// a pure function of (seed, position): a resumed sampler continues with exactly the same samples.
RC_GTEST_PROP(Sampler, EachEpochIsAPermutationAndResumeIsExact, ()) {
  const uint64_t n = *rc::gen::inRange<uint64_t>(1, 300);
  const uint64_t gb = *rc::gen::inRange<uint64_t>(1, 40);
  const uint64_t seed = *rc::gen::arbitrary<uint64_t>();
  const uint64_t steps = *rc::gen::inRange<uint64_t>(1, 30);
  const uint64_t resume_at = *rc::gen::inRange<uint64_t>(0, steps);

  GlobalBatchSampler a(n, seed);
  std::vector<uint64_t> stream;
  for (uint64_t s = 0; s < steps; ++s) {
    auto b = a.global_batch(s, gb);
    RC_ASSERT(b.size() == gb);
    stream.insert(stream.end(), b.begin(), b.end());
  }
  for (uint64_t e = 0; (e + 1) * n <= stream.size(); ++e) {
    std::vector<uint64_t> epoch(stream.begin() + static_cast<long>(e * n), stream.begin() + static_cast<long>((e + 1) * n));
    std::sort(epoch.begin(), epoch.end());
    for (uint64_t i = 0; i < n; ++i) RC_ASSERT(epoch[i] == i);
  }
  // No sample repeats within the first epoch's worth of positions, also across batch borders.
  std::set<uint64_t> first(stream.begin(), stream.begin() + static_cast<long>(std::min<size_t>(n, stream.size())));
  RC_ASSERT(first.size() == std::min<size_t>(n, stream.size()));

  GlobalBatchSampler resumed(n, seed);
  for (uint64_t s = resume_at; s < steps; ++s) {
    auto b = resumed.global_batch(s, gb);
    RC_ASSERT(std::equal(b.begin(), b.end(), stream.begin() + static_cast<long>(s * gb)));
  }
}

TEST(Sampler, SeedsGiveDifferentOrders) {
  GlobalBatchSampler a(100, 1), b(100, 2), c(100, 1, /*shuffle=*/false);
  EXPECT_NE(a.take(0, 100), b.take(0, 100));
  auto in_order = c.take(0, 100);
  for (uint64_t i = 0; i < 100; ++i) EXPECT_EQ(in_order[i], i);
  EXPECT_NE(a.take(0, 100), a.take(100, 100));  // epochs are reshuffled
}

#include "alloy/core/plan.h"

// Replicas take consecutive, disjoint slices of each global batch (Plan::sample_offset), so over
// any steps and any heterogeneous split, no sample is repeated or dropped, and a resumed run sees
// the same samples on every replica.
RC_GTEST_PROP(Sampler, ReplicaSlicesPartitionEveryGlobalBatch, ()) {
  const int replicas = *rc::gen::inRange(1, 6);
  std::vector<std::pair<int64_t, int64_t>> split;
  for (int r = 0; r < replicas; ++r)
    split.emplace_back(*rc::gen::inRange<int64_t>(1, 7), *rc::gen::inRange<int64_t>(1, 5));
  alloy::Plan plan = alloy::Plan::data_parallel(4, split);
  const uint64_t gb = static_cast<uint64_t>(plan.global_batch);
  const uint64_t n = *rc::gen::inRange<uint64_t>(gb, 4 * gb + 50);
  const uint64_t seed = *rc::gen::arbitrary<uint64_t>();
  const uint64_t steps = *rc::gen::inRange<uint64_t>(1, 12);
  GlobalBatchSampler whole(n, seed);
  std::vector<GlobalBatchSampler> per_replica(static_cast<size_t>(replicas), GlobalBatchSampler(n, seed));
  for (uint64_t s = 0; s < steps; ++s) {
    std::vector<uint64_t> joined;
    for (int r = 0; r < replicas; ++r) {
      auto part = per_replica[static_cast<size_t>(r)].take(s * gb + static_cast<uint64_t>(plan.sample_offset(r)),
                                                           static_cast<uint64_t>(plan.pipelines[static_cast<size_t>(r)].samples()));
      joined.insert(joined.end(), part.begin(), part.end());
    }
    // Together the replicas see exactly the global batch, position by position: nothing twice,
    // nothing dropped (within an epoch the global stream is a permutation, tested above).
    RC_ASSERT(joined == whole.global_batch(s, gb));
  }
}
