// The planner and the cost model with interleaved virtual stages (plan/search.h,
// consider_interleaving; simulate_plan's chunks).
#include "alloy/plan/planner.h"
#include "planner_fixtures.h"

using namespace alloy;
using namespace alloy::plan;
using namespace alloy::plan::testing;

namespace {

// Four devices of one type on one host, blocks costing 1 forward and 2 backward (ms), ends nothing.
ClusterSpec four_alike(double memory_gb = 0) {
  ClusterSpec c;
  for (int i = 0; i < 4; ++i) c.devices.push_back(device("d" + std::to_string(i), "h0", "t", memory_gb));
  return c;
}

Profile alike_profile(int64_t layers) {
  Profile p = base_profile(layers);
  p.devices["t"] = flat(1e-3, 2e-3, 0, 0);
  return p;
}

// One pipeline over the four devices: blocks in equal stages, or each rank's two chunks of one block.
Plan pipeline_of_four(int64_t M, bool interleaved) {
  Plan plan;
  plan.global_batch = M;
  PipelinePlan pl;
  pl.micro_batch_size = 1;
  pl.num_micro_batches = M;
  if (interleaved) {
    plan.schedule = pipeline::kInterleaved;
    pl.virtual_stages = 2;
    for (int c = 0; c < 8; ++c) pl.stages.push_back(stage(c % 4, c, c + 1, "d" + std::to_string(c % 4)));
  } else {
    for (int s = 0; s < 4; ++s) pl.stages.push_back(stage(s, 2 * s, 2 * s + 2, "d" + std::to_string(s)));
  }
  plan.pipelines = {pl};
  return plan;
}

}  // namespace

// Equal stages: the interleaved pipeline's phase is (M V + S - 1) chunk-times, 1F1B's (M + S - 1)
// stage-times, each stage two chunks: 11 against 14 chunk-times at M = 4 (messages aside).
TEST(InterleavePlan, TheCostModelSeesTheSmallerBubble) {
  const ClusterSpec c = four_alike();
  const Profile p = alike_profile(8);
  const PlanCost pp = simulate_plan(pipeline_of_four(4, false), c, p);
  const PlanCost il = simulate_plan(pipeline_of_four(4, true), c, p);
  const double chunk = 3e-3;  // one block forward and backward
  EXPECT_NEAR(pp.pipelines[0].phase_s, 14 * chunk, 0.05 * 14 * chunk);
  EXPECT_NEAR(il.pipelines[0].phase_s, 11 * chunk, 0.05 * 11 * chunk);
  EXPECT_GT(il.pipelines[0].phase_s - 11 * chunk, pp.pipelines[0].phase_s - 14 * chunk);  // twice the crossings
  // One entry a rank, with its chunks; the same compute, a smaller bubble, more in flight.
  ASSERT_EQ(il.stages.size(), 4u);
  for (size_t s = 0; s < 4; ++s) {
    EXPECT_EQ(il.stages[s].rank, static_cast<int>(s));
    ASSERT_EQ(il.stages[s].chunk_units.size(), 2u);
    EXPECT_EQ(il.stages[s].chunk_units[1].first, 2 * static_cast<int64_t>(s + 4));
    EXPECT_NEAR(il.stages[s].forward_s + il.stages[s].backward_s, pp.stages[s].forward_s + pp.stages[s].backward_s, 1e-12);
    EXPECT_LT(il.stages[s].bubble_s, pp.stages[s].bubble_s);
    EXPECT_GE(il.stages[s].peak_in_flight, pp.stages[s].peak_in_flight);
  }
  // Rank 0 holds 4 + 4 chunk-micro-batches (warm-up 2 (S - 1) + (V - 1) S = 10, capped at M V).
  EXPECT_EQ(il.stages[0].peak_in_flight, 8);
  EXPECT_EQ(il.to_json()["per_stage"][0]["chunk_units"], nlohmann::json::parse("[[0, 2], [8, 10]]"));
}

// Memory holds each device to a quarter of the model, so the plan is a pipeline of four; with few
// micro-batches its bubble is most of the step, and the planner interleaves it. Not with the
// option off, and the interleaved plan validates and runs every rank's chunks.
TEST(InterleavePlan, ThePlannerInterleavesAPipelineWhoseBubbleIsTheStep) {
  Profile p = alike_profile(8);
  p.memory.act_bytes_per_sample_block = 2e4;  // activations small beside the weights
  p.memory.act_bytes_per_sample_head = 4e4;
  p.memory.param_bytes_embed = p.memory.param_bytes_head = 2e5;
  // Two blocks' weights, gradients and AdamW state (4 bytes of state a parameter byte: 8 MB) and an
  // end's, not three blocks' (12 MB): a pipeline of four equal stages.
  const ClusterSpec c = four_alike(0.0105);
  SearchOptions o;
  o.global_batch = 4;
  o.max_micro_batch = 1;
  // 1F1B alone: zb-h1's held weight passes would fill this bubble too (on these flat costs better
  // than two chunks a rank), and the planner would rightly keep it.
  o.schedules = {"1f1b"};
  o.interleave = false;
  const PlanReport plain = make_plan(c, p, o, false);
  ASSERT_EQ(plain.chosen.plan.pipelines.size(), 1u) << plain.text();
  ASSERT_EQ(plain.chosen.plan.pipelines[0].stages.size(), 4u) << plain.text();
  o.interleave = true;
  const PlanReport r = make_plan(c, p, o, false);
  const PipelinePlan& pl = r.chosen.plan.pipelines.at(0);
  ASSERT_TRUE(pl.interleaved()) << r.text();
  EXPECT_EQ(r.chosen.plan.schedule_of(0), pipeline::kInterleaved);
  EXPECT_EQ(pl.depth(), 4);
  EXPECT_LT(r.chosen.cost.step_s, plain.chosen.cost.step_s * (1 - kInterleaveMinGain));
  EXPECT_TRUE(r.chosen.cost.fits) << r.chosen.cost.explanation;
  expect_uses_every_device(r.chosen, c, p);
  bool noted = false;
  for (const auto& n : r.chosen.notes) noted = noted || n.find("interleaved virtual stages") != std::string::npos;
  EXPECT_TRUE(noted);
  // The prediction is the plan's own: the same figure when the plan is priced again from its file.
  const Plan back = Plan::from_json(r.chosen.plan.to_json(), "plan.json");
  EXPECT_NEAR(simulate_plan(back, c, p).step_s, r.chosen.cost.step_s, 1e-12);
}

// Replicas (no pipeline) and pipelines whose micro-batches the ranks do not divide are left alone.
TEST(InterleavePlan, LeavesAloneWhatCannotInterleave) {
  const ClusterSpec c = four_alike();
  const Profile p = alike_profile(8);
  SearchOptions o;
  o.global_batch = 16;
  // Four replicas of the whole model, 4 micro-batches each: no pipeline to interleave.
  SearchResult rep;
  rep.plan.global_batch = 16;
  for (int r = 0; r < 4; ++r) {
    PipelinePlan pl;
    pl.micro_batch_size = 1;
    pl.num_micro_batches = 4;
    pl.stages.push_back(stage(r, 0, 8, "d" + std::to_string(r)));
    rep.plan.pipelines.push_back(pl);
  }
  rep.cost = simulate_plan(rep.plan, c, p);
  rep.strategy = "alloy";
  const std::string before = rep.plan.to_json().dump();
  consider_interleaving(rep, c, p, o);
  EXPECT_EQ(rep.plan.to_json().dump(), before);
  SearchResult x;
  x.plan = pipeline_of_four(6, false);  // 6 micro-batches on 4 ranks
  x.cost = simulate_plan(x.plan, c, p);
  x.strategy = "alloy";
  consider_interleaving(x, c, p, o);
  EXPECT_FALSE(x.plan.pipelines[0].interleaved());
  // 32 micro-batches: the fill and drain are small beside them (67 against 70 chunk-times), under
  // the margin; the note says what was found and why it is not used.
  SearchResult y;
  y.plan = pipeline_of_four(32, false);
  y.cost = simulate_plan(y.plan, c, p);
  y.strategy = "alloy";
  consider_interleaving(y, c, p, o);
  EXPECT_FALSE(y.plan.pipelines[0].interleaved());
  ASSERT_FALSE(y.notes.empty());
  EXPECT_NE(y.notes.back().find("interleaved virtual stages: not used; the best (pipeline 0, 2 chunks a rank)"), std::string::npos)
      << y.notes.back();
}
