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
