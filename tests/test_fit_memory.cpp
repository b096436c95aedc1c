// The cost model's sharding and recomputation terms, and plans made to fit memory (fit_memory.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <string>

#include "alloy/core/error.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/fit_memory.h"
#include "alloy/plan/search.h"
#include "planner_fixtures.h"

using namespace alloy;
using namespace alloy::plan;
using namespace alloy::plan::testing;

namespace {

// Two replicas of the whole 4-block model (8 MB of parameters: 4 blocks of 1 MB, embedding and
// head of 2 MB each) on devices a and b of one host; A_GB / B_GB their memory.
struct TwoReplicas {
  ClusterSpec cluster;
  Profile profile = base_profile(4);
  Plan plan;
  static constexpr double P = 8e6;
  TwoReplicas(double a_gb = 0, double b_gb = 0) {
    profile.devices["t"] = dev_profile(1);
    cluster.devices = {device("a", "h0", "t", a_gb), device("b", "h0", "t", b_gb)};
    plan.global_batch = 8;
    for (int r = 0; r < 2; ++r) {
      PipelinePlan pl;
      pl.micro_batch_size = 4;
      pl.num_micro_batches = 1;
      pl.stages = {stage(r, 0, 4, r ? "b" : "a")};
      plan.pipelines.push_back(pl);
    }
  }
};

double parts(const StageCost& s) {
  return s.weight_bytes + s.grad_bytes + s.optimizer_bytes + s.bucket_bytes + s.gathered_bytes + s.activation_bytes;
}

}  // namespace

TEST(CostModelSharding, FullReplicasHoldEverythingTwiceOverInGradients) {
  TwoReplicas t;
  const PlanCost c = simulate_plan(t.plan, t.cluster, t.profile);
  for (const auto& s : c.stages) {
    EXPECT_DOUBLE_EQ(s.weight_bytes, t.P);
    EXPECT_DOUBLE_EQ(s.grad_bytes, t.P);
    EXPECT_DOUBLE_EQ(s.optimizer_bytes, 2 * t.P);
    EXPECT_DOUBLE_EQ(s.bucket_bytes, t.P);
    EXPECT_DOUBLE_EQ(s.gathered_bytes, 0);
    const auto& mem = t.profile.memory;
    EXPECT_DOUBLE_EQ(s.activation_bytes, 4 * (4 * mem.act_bytes_per_sample_block + mem.act_bytes_per_sample_embed + mem.act_bytes_per_sample_head) +
                                             4 * mem.act_bytes_per_sample_block);  // kept for 1 micro-batch of 4, + the backward's working set
    EXPECT_DOUBLE_EQ(s.memory_bytes, parts(s));
    EXPECT_EQ(s.zero_stage, 0);
  }
  EXPECT_DOUBLE_EQ(c.param_gather_s, 0);
}

TEST(CostModelSharding, ZeroOneKeepsTheOptimizerShareAndGathersAfterTheStep) {
  TwoReplicas t;
  const PlanCost full = simulate_plan(t.plan, t.cluster, t.profile);
  t.plan.sharding = {{{0, 1}, 1, {3, 1}}};
  const PlanCost c = simulate_plan(t.plan, t.cluster, t.profile);
  EXPECT_DOUBLE_EQ(c.stages[0].optimizer_bytes, 2 * 0.75 * t.P);
  EXPECT_DOUBLE_EQ(c.stages[1].optimizer_bytes, 2 * 0.25 * t.P);
  for (const auto& s : c.stages) {
    EXPECT_DOUBLE_EQ(s.weight_bytes, t.P);
    EXPECT_DOUBLE_EQ(s.grad_bytes, t.P);
    EXPECT_DOUBLE_EQ(s.memory_bytes, parts(s));
    EXPECT_EQ(s.zero_stage, 1);
    EXPECT_GT(s.param_gather_s, 0);
  }
  EXPECT_DOUBLE_EQ(c.stages[1].shard, 0.25);
  // AdamW covers each share only; the gather is paid after it.
  EXPECT_LT(c.stages[1].optimizer_s, full.stages[1].optimizer_s);
  EXPECT_GT(c.param_gather_s, 0);
  EXPECT_NEAR(c.step_s, c.sync_done_s + c.straggler_s + c.world_allreduce_s + c.optimizer_s + c.param_gather_s, 1e-12);
}

TEST(CostModelSharding, ZeroThreeShardsWeightsAndGradientsAndPaysPerLayerGathers) {
  TwoReplicas t;
  const PlanCost full = simulate_plan(t.plan, t.cluster, t.profile);
  t.plan.sharding = {{{0, 1}, 3, {3, 1}}};
  const PlanCost c = simulate_plan(t.plan, t.cluster, t.profile);
  const double share[2] = {0.75, 0.25};
  for (size_t r = 0; r < 2; ++r) {
    const StageCost& s = c.stages[r];
    EXPECT_DOUBLE_EQ(s.weight_bytes, share[r] * t.P);
    EXPECT_DOUBLE_EQ(s.grad_bytes, share[r] * t.P);
    EXPECT_DOUBLE_EQ(s.optimizer_bytes, 2 * share[r] * t.P);
    EXPECT_DOUBLE_EQ(s.bucket_bytes, t.P);         // the gradients, once, in the reducer's buckets
    EXPECT_DOUBLE_EQ(s.gathered_bytes, 2e6 + 2e6);  // the two largest layers: embedding and head
    EXPECT_DOUBLE_EQ(s.memory_bytes, parts(s));
    EXPECT_LT(s.memory_bytes, full.stages[r].memory_bytes);
    EXPECT_GT(s.gather_s, 0);
    EXPECT_GT(s.forward_s, full.stages[r].forward_s);
    EXPECT_DOUBLE_EQ(s.param_gather_s, 0);  // parameters stay sharded after the step
  }
}

TEST(CostModelSharding, RecomputationKeepsBlockInputsAndRerunsTheForward) {
  TwoReplicas t;
  const PlanCost full = simulate_plan(t.plan, t.cluster, t.profile);
  t.plan.pipelines[1].stages[0].recompute = true;
  const PlanCost c = simulate_plan(t.plan, t.cluster, t.profile);
  const StageCost& s = c.stages[1];
  const double m = 4, hidden_state = 16 * 32 * 4;  // seq_len * hidden * fp32
  const auto& mem = t.profile.memory;
  EXPECT_TRUE(s.recompute);
  EXPECT_DOUBLE_EQ(s.activation_bytes, s.peak_in_flight * m * (4 * hidden_state + mem.act_bytes_per_sample_embed + mem.act_bytes_per_sample_head) +
                                           2 * m * mem.act_bytes_per_sample_block);  // the working set, doubled
  EXPECT_LT(s.activation_bytes, full.stages[1].activation_bytes);
  const DeviceProfile& d = t.profile.devices["t"];
  EXPECT_NEAR(s.backward_s - full.stages[1].backward_s, 4 * d.block_fwd.at(m), 1e-12);
  EXPECT_DOUBLE_EQ(c.stages[0].activation_bytes, full.stages[0].activation_bytes);
}

TEST(FitMemory, LeavesAPlanThatFitsAlone) {
  TwoReplicas t(1, 1);
  const FitResult f = fit_memory(t.plan, t.cluster, t.profile);
  EXPECT_TRUE(f.fits);
  EXPECT_TRUE(t.plan.sharding.empty());
  EXPECT_TRUE(f.changes.empty());
}

TEST(FitMemory, ShardsOrRecomputesUntilTheSmallDeviceFitsAndSaysSo) {
  // b: 36 MB. A replica needs 46 MB there (weights, gradients, buckets 8 MB each, AdamW 16 MB,
  // activations 6 MB); recomputation alone leaves 43.6 MB, even ZeRO-1 38 MB.
  TwoReplicas t(1, 0.036);
  ASSERT_FALSE(simulate_plan(t.plan, t.cluster, t.profile).fits);
  const FitResult f = fit_memory(t.plan, t.cluster, t.profile);
  ASSERT_TRUE(f.fits) << f.cost.explanation;
  ASSERT_EQ(t.plan.sharding.size(), 1u);
  EXPECT_EQ(t.plan.sharding[0].ranks, (std::vector<int>{0, 1}));
  EXPECT_GE(t.plan.sharding[0].stage, 1);
  const PlanCost again = simulate_plan(t.plan, t.cluster, t.profile);
  EXPECT_TRUE(again.fits);
  EXPECT_DOUBLE_EQ(again.step_s, f.cost.step_s);
  EXPECT_LE(again.stages[1].memory_bytes, 0.036e9);
  bool named = false;
  for (const auto& c : f.changes) named = named || c.find("ZeRO-") != std::string::npos;
  EXPECT_TRUE(named);
}

TEST(FitMemory, SaysWhoDoesNotFitWhenNothingHelps) {
  TwoReplicas t(1, 0.001);
  const FitResult f = fit_memory(t.plan, t.cluster, t.profile);
  EXPECT_FALSE(f.fits);
  EXPECT_NE(f.cost.explanation.find("device 'b' (rank 1"), std::string::npos) << f.cost.explanation;
  EXPECT_NE(f.cost.explanation.find("but has 1 MB"), std::string::npos) << f.cost.explanation;
}

TEST(SearchWithMemory, ErrorNamesTheRankAndTheBytesWhenNothingFits) {
  TwoReplicas t(1, 0.001);  // b cannot hold one block with its state, sharded or not
  SearchOptions o;
  o.global_batch = 8;
  try {
    search(t.cluster, t.profile, o);
    FAIL() << "a plan was found";
  } catch (const InputError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("with sharding and recomputation too"), std::string::npos) << w;
    EXPECT_NE(w.find("device 'b' (rank 1) would need at least (sharded and recomputing)"), std::string::npos) << w;
    EXPECT_NE(w.find("but has 0.001 GB"), std::string::npos) << w;
  }
}

// On random pools with small memories: the plan fits, is priced as simulate_plan prices it, and is
// never slower than the best plan of full replicas.
TEST(SearchWithMemory, FitsAndIsNeverSlowerThanFullReplicas) {
  check_times(25, [] {
    const int n = *rc::gen::inRange(2, 5);
    Profile profile = base_profile(4);
    profile.devices["fast"] = dev_profile(1);
    profile.devices["slow"] = dev_profile(*rc::gen::element(2.0, 4.0));
    ClusterSpec cluster;
    for (int i = 0; i < n; ++i)
      cluster.devices.push_back(device("d" + std::to_string(i), "h" + std::to_string(*rc::gen::inRange(0, 2)), i % 2 ? "slow" : "fast",
                                       *rc::gen::element(0.0, 0.015, 0.025, 0.035, 0.05)));
    cluster.rules.push_back({"h0", "h1", Link{*rc::gen::element(0.5, 5.0), 0.1}});
    SearchOptions o;
    o.global_batch = 8;
    o.max_micro_batch = 4;
    o.split_schedule_min_gain = 0;  // fitting's own choices, not the schedule margin's (tested on its own)
    std::string err_plain, err_fit;
    SearchResult plain, fit;
    SearchOptions op = o;
    op.fit_memory = false;
    try {
      plain = search(cluster, profile, op);
    } catch (const InputError& e) {
      err_plain = e.what();
    }
    try {
      fit = search(cluster, profile, o);
    } catch (const InputError& e) {
      err_fit = e.what();
    }
    RC_CLASSIFY(!err_plain.empty() && err_fit.empty(), "fits only with sharding/recomputation");
    RC_CLASSIFY(!fit.plan.sharding.empty(), "sharded");
    if (!err_plain.empty()) RC_ASSERT(err_fit.empty() || err_fit.find(err_plain) != std::string::npos);
    if (!err_fit.empty()) {
      RC_ASSERT(!err_plain.empty());
      return;
    }
    RC_ASSERT(fit.cost.fits);
    const PlanCost again = simulate_plan(fit.plan, cluster, profile);
    RC_ASSERT(again.fits);
    RC_ASSERT(std::fabs(again.step_s - fit.cost.step_s) <= 1e-12 * again.step_s);
    if (err_plain.empty()) RC_ASSERT(fit.cost.step_s <= plain.cost.step_s * (1 + 1e-12));
  });
}
