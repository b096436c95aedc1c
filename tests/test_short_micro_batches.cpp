// Short last micro-batches (PipelinePlan::last_micro_batch_size): the plan's field, its price in
// the cost model, and the planner's use of it to balance unlike replicas.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "alloy/core/error.h"
#include "alloy/core/plan.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/planner.h"
#include "alloy/plan/search.h"
#include "planner_fixtures.h"

using namespace alloy;
using namespace alloy::plan;
using namespace alloy::plan::testing;

namespace {

ModelConfig model8() { return base_profile(8).model; }  // llama, 8 blocks

PipelinePlan replica(int rank, int64_t samples, int64_t m, const std::string& dev = "") {
  PipelinePlan pl;
  pl.set_samples(samples, m);
  pl.stages.push_back(stage(rank, 0, 8, dev));
  return pl;
}

std::string error_of(const Plan& p) {
  try {
    p.validate(model8(), "p.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ShortMicroBatches, APipelineTakesAnyNumberOfSamples) {
  PipelinePlan pl;
  pl.set_samples(14, 6);
  EXPECT_EQ(pl.micro_batch_size, 6);
  EXPECT_EQ(pl.num_micro_batches, 3);
  EXPECT_EQ(pl.last_size(), 2);
  EXPECT_TRUE(pl.short_last());
  EXPECT_EQ(pl.samples(), 14);
  EXPECT_EQ(pl.batch_text(), "6 x 3 (the last of 2)");
  pl.set_samples(12, 6);  // a multiple: no short one
  EXPECT_EQ(pl.num_micro_batches, 2);
  EXPECT_EQ(pl.last_micro_batch_size, 0);
  EXPECT_FALSE(pl.short_last());
  EXPECT_EQ(pl.batch_text(), "6 x 2");
  pl.set_samples(5, 6);  // fewer than one micro-batch
  EXPECT_EQ(pl.num_micro_batches, 1);
  EXPECT_EQ(pl.samples(), 5);
}

TEST(ShortMicroBatches, ThePlanFileCarriesAndChecksTheLastSize) {
  Plan p;
  p.global_batch = 26;
  p.pipelines = {replica(0, 14, 6), replica(1, 12, 6)};
  ASSERT_EQ(error_of(p), "");
  const nlohmann::json j = p.to_json();
  EXPECT_EQ(j["version"], 9);
  EXPECT_EQ(j["pipelines"][0]["last_micro_batch_size"], 2);
  EXPECT_FALSE(j["pipelines"][1].contains("last_micro_batch_size"));
  const Plan back = Plan::from_json(j, "p.json");
  EXPECT_EQ(back.pipelines[0].last_micro_batch_size, 2);
  EXPECT_EQ(back.pipelines[0].samples(), 14);
  EXPECT_EQ(back.to_json(), j);
  EXPECT_NE(back.describe().find("pipeline 0: 6 x 3 (the last of 2) = 14 samples"), std::string::npos) << back.describe();
  // Without a short one the file stays at the version older readers know.
  Plan whole = p;
  whole.pipelines[0].set_samples(12, 6);
  whole.global_batch = 24;
  EXPECT_EQ(whole.to_json()["version"], 1);

  Plan bad = p;
  bad.pipelines[0].last_micro_batch_size = 6;  // not shorter
  EXPECT_NE(error_of(bad).find("pipelines[0].last_micro_batch_size: must be 1..5"), std::string::npos) << error_of(bad);
  bad.pipelines[0].last_micro_batch_size = -1;
  EXPECT_NE(error_of(bad).find("pipelines[0].last_micro_batch_size"), std::string::npos) << error_of(bad);
  bad = p;
  bad.global_batch = 30;
  EXPECT_NE(error_of(bad).find("30 != the pipelines' samples"), std::string::npos) << error_of(bad);
  EXPECT_NE(error_of(bad).find("6x3-4 + 6x2 = 26"), std::string::npos) << error_of(bad);
  nlohmann::json ill = j;
  ill["pipelines"][0]["last_micro_batch_size"] = 1.5;
  try {
    Plan::from_json(ill, "p.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("pipelines[0].last_micro_batch_size"), std::string::npos) << e.what();
  }
}

TEST(ShortMicroBatches, AShortMicroBatchCostsWhatItsSizeCosts) {
  Profile prof = base_profile(8);
  prof.devices["t"] = dev_profile(1);
  ClusterSpec c;
  c.devices = {device("a", "h0", "t"), device("b", "h0", "t")};
  auto one = [&](int64_t samples, int64_t m) {
    Plan p;
    p.global_batch = samples;
    p.pipelines = {replica(0, samples, m, "a")};
    return simulate_plan(p, c, prof);
  };
  // A replica's compute is its micro-batches' compute: 6 + 6 + 2 = (6 + 6) + (2).
  const PlanCost with = one(14, 6), whole = one(12, 6), rest = one(2, 2);
  EXPECT_NEAR(with.stages[0].forward_s, whole.stages[0].forward_s + rest.stages[0].forward_s, 1e-12);
  EXPECT_NEAR(with.stages[0].backward_s, whole.stages[0].backward_s + rest.stages[0].backward_s, 1e-12);
  EXPECT_NEAR(with.pipelines[0].phase_s, whole.pipelines[0].phase_s + rest.pipelines[0].phase_s, 1e-12);
  EXPECT_LT(with.pipelines[0].phase_s, one(18, 6).pipelines[0].phase_s);  // less than a whole third micro-batch

  // Through a 2-stage pipeline: between the whole micro-batches' schedules on either side.
  auto piped = [&](int64_t samples) {
    Plan p;
    p.global_batch = samples;
    PipelinePlan pl;
    pl.set_samples(samples, 6);
    pl.stages = {stage(0, 0, 4, "a"), stage(1, 4, 8, "b")};
    p.pipelines = {pl};
    return simulate_plan(p, c, prof);
  };
  const double p12 = piped(12).pipelines[0].phase_s, p14 = piped(14).pipelines[0].phase_s, p18 = piped(18).pipelines[0].phase_s;
  EXPECT_LT(p12, p14);
  EXPECT_LT(p14, p18);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_NEAR(piped(14).stages[s].forward_s, piped(12).stages[s].forward_s + piped(2).stages[s].forward_s, 1e-12);
    EXPECT_NEAR(piped(14).stages[s].backward_s, piped(12).stages[s].backward_s + piped(2).stages[s].backward_s, 1e-12);
  }
}

TEST(ShortMicroBatches, ThePlannerBalancesUnlikeReplicasWithThem) {
  // Speeds 1 : 1/2 : 1/4 on fast links want 54.9 / 27.4 / 13.7 of 96 samples; whole micro-batches
  // allow 56 / 28 / 12 at best (in fours), short last ones 55 / 27 / 14.
  Profile prof = base_profile(8);
  prof.devices["fast"] = dev_profile(1);
  prof.devices["half"] = dev_profile(2);
  prof.devices["quarter"] = dev_profile(4);
  ClusterSpec c;
  c.devices = {device("f", "h0", "fast", 1), device("m", "h1", "half", 1), device("s", "h2", "quarter", 1)};
  c.default_link = Link{10, 0.1};
  SearchOptions o;
  o.global_batch = 96;
  o.tensor_parallel = false;
  o.short_micro_batches = false;
  const PlanReport off = make_plan(c, prof, o, false);
  o.short_micro_batches = true;
  const PlanReport on = make_plan(c, prof, o, false);
  SCOPED_TRACE("whole: " + off.chosen.plan.describe() + "short: " + on.chosen.plan.describe());
  for (const auto& pl : off.chosen.plan.pipelines) EXPECT_FALSE(pl.short_last());
  bool any_short = false;
  int64_t total = 0;
  for (const auto& pl : on.chosen.plan.pipelines) any_short = any_short || pl.short_last(), total += pl.samples();
  EXPECT_TRUE(any_short);
  EXPECT_EQ(total, 96);
  EXPECT_NO_THROW(on.chosen.plan.validate(prof.model, "planner"));
  EXPECT_LT(on.chosen.cost.step_s, off.chosen.cost.step_s * (1 - 0.005));
  // What the planner reports is the plan's own simulation.
  EXPECT_DOUBLE_EQ(on.chosen.cost.step_s, simulate_plan(on.chosen.plan, c, prof).step_s);
  EXPECT_DOUBLE_EQ(on.chosen.search_step_s, on.chosen.cost.step_s);
  bool noted = false;
  for (const auto& n : on.chosen.notes) noted = noted || n.find("short last micro-batches") != std::string::npos;
  EXPECT_TRUE(noted);
}
