#include "alloy/train/share_balancer.h"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "alloy/core/error.h"
#include "expect_error.h"

using alloy::train::ShareBalancer;
using alloy::train::ShareBalancerOptions;

namespace {

// Each replica's step at its own seconds per sample, with FIXED seconds besides (its sync).
std::vector<double> compute_of(const std::vector<int64_t>& shares, const std::vector<double>& per_sample) {
  std::vector<double> c;
  for (size_t i = 0; i < shares.size(); ++i) c.push_back(static_cast<double>(shares[i]) * per_sample[i]);
  return c;
}

ShareBalancer armed(std::vector<int64_t> base, const std::vector<double>& per_sample, ShareBalancerOptions o = {}) {
  ShareBalancer b(base, o);
  for (int k = 0; k <= o.reference_steps; ++k) EXPECT_FALSE(b.observe(compute_of(base, per_sample)));
  EXPECT_TRUE(b.arm());
  return b;
}

}  // namespace

TEST(ShareBalancer, KeepsThePlansCutWhileTheSpeedsHold) {
  // The plan gave the fast replica more than its speed alone asks (63 : 23 : 10 at 4 : 2 : 1): the
  // slow ones spend the difference on their part of the gradient sum. Unchanged speeds keep it.
  ShareBalancer b = armed({63, 23, 10}, {0.01, 0.02, 0.04});
  for (int k = 0; k < 10; ++k) EXPECT_FALSE(b.observe(compute_of(b.shares(), {0.01, 0.02, 0.04})));
  EXPECT_EQ(b.shares(), (std::vector<int64_t>{63, 23, 10}));
  EXPECT_EQ(b.offset(0), 0);
  EXPECT_EQ(b.offset(2), 86);
}

TEST(ShareBalancer, MovesSamplesOffAReplicaThatSlowsAndBackWhenItRecovers) {
  ShareBalancer b = armed({8, 8}, {0.1, 0.1});
  // Replica 1 computes 25% slower for a spell.
  bool moved = false;
  for (int k = 0; k < 4; ++k) moved |= b.observe(compute_of(b.shares(), {0.1, 0.125}));
  ASSERT_TRUE(moved);
  EXPECT_EQ(b.shares(), (std::vector<int64_t>{9, 7}));
  EXPECT_NE(b.last_change().find("8/8 -> 9/7"), std::string::npos) << b.last_change();
  // 9 x 0.1 against 7 x 0.125: 0.9 s where the even cut took 1.0 s.
  EXPECT_NEAR(b.predicted_s(b.shares()), 0.9, 0.01);
  for (int k = 0; k < 6; ++k) b.observe(compute_of(b.shares(), {0.1, 0.1}));
  EXPECT_EQ(b.shares(), (std::vector<int64_t>{8, 8}));
}

TEST(ShareBalancer, NoiseUnderTheGainLeavesTheCut) {
  ShareBalancer b = armed({8, 8}, {0.1, 0.1});
  // 2% slower: moving a sample would make the other replica the slower one (9 x 0.1 > 8 x 0.102).
  for (int k = 0; k < 6; ++k) EXPECT_FALSE(b.observe(compute_of(b.shares(), {0.1, 0.102})));
  EXPECT_EQ(b.shares(), (std::vector<int64_t>{8, 8}));
}

TEST(ShareBalancer, KeepsEachReplicasSlackScaledWithItsSpeed) {
  // Replica 1 has 0.2 s besides its 10 samples (the plan's slack: 20 x 0.05 = 1.0 = 10 x 0.08 + 0.2).
  ShareBalancer b = armed({20, 10}, {0.05, 0.08});
  // The fast replica slows by half: its 20 samples now take 1.5 s, the other's 10 take 1.0 s.
  for (int k = 0; k < 8; ++k) b.observe(compute_of(b.shares(), {0.075, 0.08}));
  const auto& s = b.shares();
  EXPECT_EQ(s[0] + s[1], 30);
  // The best cut at these speeds: s0 x 0.075 against s1 x 0.08 + 0.2, i.e. 17 / 13 (1.275 / 1.24 s).
  EXPECT_EQ(s, (std::vector<int64_t>{17, 13}));
}

TEST(ShareBalancer, ArmsOnlyAfterItsReferenceSteps) {
  ShareBalancerOptions o;
  o.reference_steps = 3;
  ShareBalancer b({4, 4}, o);
  EXPECT_FALSE(b.arm());
  for (int k = 0; k < 3; ++k) b.observe({0.4, 0.4});  // the first is the warm-up, left out
  EXPECT_FALSE(b.arm());
  b.observe({0.4, 0.4});
  EXPECT_TRUE(b.arm());
  EXPECT_TRUE(b.armed());
  // A step where a replica measured nothing changes nothing.
  EXPECT_FALSE(b.observe({0.0, 0.4}));
}

TEST(ShareBalancer, RejectsAReplicaWithoutSamples) {
  const std::string e = alloy::testing::error_of([] { ShareBalancer({4, 0}); });
  EXPECT_HAS(e, "train.rebalance");
  EXPECT_HAS(e, "replica 1");
}

RC_GTEST_PROP(ShareBalancer, CutIsTheBestMinMaxAndKeepsTheBatch, ()) {
  const size_t n = *rc::gen::inRange<size_t>(2, 5);
  std::vector<int64_t> base;
  std::vector<double> ref, now;
  for (size_t i = 0; i < n; ++i) {
    base.push_back(*rc::gen::inRange<int64_t>(1, 12));
    ref.push_back(*rc::gen::inRange(1, 100) / 100.0);
    now.push_back(ref.back() * *rc::gen::inRange(50, 200) / 100.0);
  }
  ShareBalancerOptions o;
  o.smoothing = 1.0;  // the newest step is the speed
  o.min_gain = 0.0;
  ShareBalancer b(base, o);
  for (int k = 0; k <= o.reference_steps; ++k) b.observe(compute_of(base, ref));
  RC_ASSERT(b.arm());
  b.observe(compute_of(b.shares(), now));
  const auto& s = b.shares();
  const int64_t total = std::accumulate(base.begin(), base.end(), int64_t{0});
  RC_ASSERT(std::accumulate(s.begin(), s.end(), int64_t{0}) == total);
  RC_ASSERT(*std::min_element(s.begin(), s.end()) >= 1);
  // No cut of the batch (at least one sample each) has a shorter slowest replica: brute force.
  double best = 1e300;
  std::vector<int64_t> c(n, 1);
  std::function<void(size_t, int64_t)> walk = [&](size_t i, int64_t left) {
    if (i + 1 == n) {
      c[i] = left;
      best = std::min(best, b.predicted_s(c));
      return;
    }
    for (int64_t k = 1; k <= left - static_cast<int64_t>(n - i - 1); ++k) {
      c[i] = k;
      walk(i + 1, left - k);
    }
  };
  walk(0, total);
  RC_ASSERT(b.predicted_s(s) <= best + 1e-12);
}
