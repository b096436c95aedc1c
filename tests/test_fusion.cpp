#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "alloy/dist/compress/fusion.h"

using namespace alloy::dist::compress;

namespace {
FusionInputs inputs(std::vector<int64_t> numel, std::vector<double> ready, double alpha, double beta) {
  FusionInputs in;
  in.numel = std::move(numel);
  in.ready_s = std::move(ready);
  in.alpha_s = alpha;
  in.beta_s_per_byte = beta;
  in.wire_bytes_per_elem = 1;
  return in;
}
}  // namespace

TEST(Fusion, FixedStrategiesCutWhereTheyShould) {
  FusionInputs in = inputs({1 << 18, 1 << 18, 1 << 18, 1 << 20, 10}, {}, 1e-3, 0);
  in.cap_bytes = 2 << 20;  // 2 MiB = 512k floats
  EXPECT_EQ(plan_fusion("tensor", in).starts, (std::vector<size_t>{0, 1, 2, 3, 4}));
  // 1 MiB + 1 MiB fill the first buffer; the 4 MiB tensor is over the cap and stands alone.
  EXPECT_EQ(plan_fusion("bucket", in).starts, (std::vector<size_t>{0, 2, 3, 4}));
  EXPECT_EQ(plan_fusion("saf", in).starts, plan_fusion("bucket", in).starts);
  EXPECT_FALSE(plan_fusion("bucket", in).compress_ahead);
  EXPECT_TRUE(plan_fusion("saf", in).compress_ahead);
  EXPECT_FALSE(plan_fusion("saf", in).aligned);
  EXPECT_TRUE(plan_fusion("saf-inter", in).aligned);
  EXPECT_TRUE(plan_fusion("saf-adaptive", in).aligned);
  // Without measurements the measuring strategies start from fixed buffers.
  EXPECT_EQ(plan_fusion("saf-adaptive", in).starts, plan_fusion("bucket", in).starts);
  EXPECT_THROW(plan_fusion("wfbp", in), std::exception);
}

TEST(Fusion, ModelChargesAlphaPerBufferAndWaitsForReadiness) {
  FusionInputs in = inputs({100, 100}, {0.0, 1.0}, 0.5, 0.01);
  FusionPlan one;
  one.starts = {0};
  FusionPlan two;
  two.starts = {0, 1};
  // One buffer: waits for the second tensor (1.0), then alpha + 200 * beta.
  EXPECT_DOUBLE_EQ(simulate_fusion(one, in), 1.0 + 0.5 + 2.0);
  // Two: the first exchange (0.5 + 1.0) starts at 0 and ends at 1.5, after the second tensor is
  // ready, so the second starts at 1.5 and ends at 3.0.
  EXPECT_DOUBLE_EQ(simulate_fusion(two, in), 3.0);
  in.encode_s_per_elem = 0.001;  // compress ahead: each tensor encoded (0.1 s) on the same timeline
  two.compress_ahead = true;
  EXPECT_DOUBLE_EQ(simulate_fusion(two, in), 0.1 + 1.5 + 0.1 + 1.5);
}

TEST(Fusion, EncodingInTheHookOverlapsTheExchangesOfEarlierBuffers) {
  // Two tensors ready at 0 and 1; encoding takes 0.1 s each; exchanges 1.0 s.
  FusionInputs in = inputs({100, 100}, {0.0, 1.0}, 1.0, 0);
  in.encode_s_per_elem = 0.001;
  FusionPlan two;
  two.starts = {0, 1};
  two.compress_ahead = true;
  // On the worker: encode 0 [0, 0.1], exchange [0.1, 1.1], encode 1 [1.1, 1.2], exchange [1.2, 2.2].
  EXPECT_DOUBLE_EQ(simulate_fusion(two, in), 2.2);
  // In the hook: tensor 1 is encoded [1.0, 1.1] while the worker still exchanges buffer 0.
  in.encode_in_hook = true;
  EXPECT_DOUBLE_EQ(simulate_fusion(two, in), 2.1);
  // Hierarchical: each buffer is encoded whole once complete, on the worker.
  in.encode_in_hook = false;
  in.encode_whole = true;
  EXPECT_DOUBLE_EQ(simulate_fusion(two, in), 2.2);
}

TEST(Fusion, AdaptiveMergesWhenTheLinkIsBusyAndSplitsToOverlap) {
  // Tensors ready 10 ms apart. A costly alpha and a cheap beta: one message is best.
  std::vector<int64_t> n(8, 1000);
  std::vector<double> ready;
  for (int i = 0; i < 8; ++i) ready.push_back(0.01 * i);
  FusionInputs in = inputs(n, ready, 0.05, 1e-9);
  FusionPlan p = plan_fusion("saf-adaptive", in);
  EXPECT_LT(p.starts.size(), 3u);
  // A cheap alpha and a costly beta (8 ms per tensor): exchanging as tensors arrive overlaps.
  in = inputs(n, ready, 1e-4, 8e-6);
  p = plan_fusion("saf-adaptive", in);
  EXPECT_GE(p.starts.size(), 6u);
  FusionPlan all_in_one;
  all_in_one.starts = {0};
  all_in_one.compress_ahead = true;
  EXPECT_LT(simulate_fusion(p, in), simulate_fusion(all_in_one, in));
  // OMGS and Cupcake decide from the same model.
  EXPECT_GE(plan_fusion("omgs", in).starts.size(), 6u);
  EXPECT_FALSE(plan_fusion("cupcake", in).starts.empty());
}

RC_GTEST_PROP(Fusion, EveryPlanIsAPartitionAndAdaptiveNeverLosesToNoFusion, ()) {
  const size_t n = *rc::gen::inRange<size_t>(1, 40);
  std::vector<int64_t> numel;
  std::vector<double> ready;
  double t = 0;
  for (size_t i = 0; i < n; ++i) {
    numel.push_back(*rc::gen::inRange<int64_t>(1, 1 << 20));
    t += *rc::gen::inRange(0, 1000) * 1e-5;
    ready.push_back(t);
  }
  FusionInputs in = inputs(numel, ready, *rc::gen::inRange(1, 1000) * 1e-5, *rc::gen::inRange(0, 1000) * 1e-9);
  in.encode_s_per_elem = *rc::gen::inRange(0, 100) * 1e-9;
  in.cap_bytes = int64_t(*rc::gen::inRange(1, 64)) << 20;
  in.encode_in_hook = *rc::gen::arbitrary<bool>();
  in.encode_whole = !in.encode_in_hook && *rc::gen::arbitrary<bool>();
  for (const char* s : {"tensor", "bucket", "omgs", "cupcake", "saf", "saf-inter", "saf-adaptive"}) {
    FusionPlan p = plan_fusion(s, in);
    RC_ASSERT(!p.starts.empty());
    RC_ASSERT(p.starts.front() == 0u);
    for (size_t i = 1; i < p.starts.size(); ++i) RC_ASSERT(p.starts[i] > p.starts[i - 1]);
    RC_ASSERT(p.starts.back() < n);
  }
  // Each of the greedy's choices is at least as good as cutting there: it never loses to sending
  // every tensor alone.
  FusionPlan adaptive = plan_fusion("saf-adaptive", in), each = adaptive;
  each.starts.clear();
  for (size_t i = 0; i < n; ++i) each.starts.push_back(i);
  const double a = simulate_fusion(adaptive, in);
  RC_ASSERT(a <= simulate_fusion(each, in) * (1 + 1e-9));
}

// saf-adaptive's measured choice: untried cuts first, then the fastest by more than the margin.
TEST(Fusion, MeasuredChoiceTriesEveryCandidateThenKeepsTheFastest) {
  using Cut = std::vector<size_t>;
  const Cut model{0, 3, 7}, one{0};
  std::map<Cut, double> measured;
  EXPECT_EQ(choose_measured({model, one}, measured, Cut{0, 5}, 0.03), model);
  measured[model] = 1.20;
  EXPECT_EQ(choose_measured({model, one}, measured, model, 0.03), one);
  measured[one] = 1.15;
  EXPECT_EQ(choose_measured({model, one}, measured, one, 0.03), one) << "the running cut stays when fastest";
  EXPECT_EQ(choose_measured({model, one}, measured, model, 0.03), one) << "4% faster: switch";
  measured[one] = 1.18;
  EXPECT_EQ(choose_measured({model, one}, measured, model, 0.03), model) << "under the margin: stay";
  EXPECT_EQ(choose_measured({model, one}, measured, one, 0.03), one);
  // A new proposal of the model is tried before anything measured wins.
  const Cut again{0, 4};
  EXPECT_EQ(choose_measured({again, one}, measured, model, 0.03), again);
  // Once tried and slower, the fastest cut ever timed comes back, even if no longer proposed: the
  // starting cut, left for an untried one, is not forgotten.
  measured[again] = 1.40;
  const Cut start{0, 2};
  measured[start] = 1.00;
  EXPECT_EQ(choose_measured({again, one}, measured, again, 0.03), start);
}
