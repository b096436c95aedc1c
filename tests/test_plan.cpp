#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <fstream>

#include "alloy/core/error.h"
#include "alloy/core/plan.h"
#include "alloy/pipeline/schedule.h"
#include "expect_error.h"
#include "temp_dir.h"

using alloy::testing::TempDir;
using alloy::InputError;
using alloy::PipelinePlan;
using alloy::Plan;
using alloy::StagePlan;

namespace {

alloy::ModelConfig model_with(int64_t layers) {
  alloy::ModelConfig m;
  m.layers = layers;
  return m;
}

std::string validate_error(const Plan& p, int64_t layers) {
  try {
    p.validate(model_with(layers), "p.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

// Two pipelines over an 8-block model: ranks 0,1 split it [0,3) + [3,8); rank 2 holds all of it.
Plan sample_plan() {
  Plan p;
  p.global_batch = 8;
  PipelinePlan a;
  a.micro_batch_size = 2;
  a.num_micro_batches = 3;
  a.stages = {StagePlan{{0}, 0, 3, "gpu-a"}, StagePlan{{1}, 3, 8, ""}};
  PipelinePlan b;
  b.micro_batch_size = 1;
  b.num_micro_batches = 2;
  b.stages = {StagePlan{{2}, 0, 8, "gpu-b"}};
  p.pipelines = {a, b};
  return p;
}

}  // namespace

TEST(Plan, ValidPlanPasses) {
  Plan p = sample_plan();
  EXPECT_EQ(validate_error(p, 8), "");
  EXPECT_EQ(p.world_size(), 3);
}

TEST(Plan, GapBetweenStagesIsNamed) {
  Plan p = sample_plan();
  p.pipelines[0].stages[1].layer_begin = 4;
  std::string e = validate_error(p, 8);
  EXPECT_HAS(e, "p.json: pipelines[0].stages[1].layers");
  EXPECT_HAS(e, "starts at block 4 but the previous stage ended at 3 (a gap)");
}

TEST(Plan, OverlapBetweenStagesIsNamed) {
  Plan p = sample_plan();
  p.pipelines[0].stages[1].layer_begin = 2;
  EXPECT_HAS(validate_error(p, 8), "starts at block 2 but the previous stage ended at 3 (an overlap)");
}

TEST(Plan, FirstStageMustStartAtZero) {
  Plan p = sample_plan();
  p.pipelines[1].stages[0].layer_begin = 1;
  EXPECT_HAS(validate_error(p, 8),
             "pipelines[1].stages[0].layers: starts at block 1 but the previous stage ended at 0 (a gap)");
}

TEST(Plan, EmptyStageIsRejected) {
  Plan p = sample_plan();
  p.pipelines[0].stages[0].layer_end = 0;
  p.pipelines[0].stages[1].layer_begin = 0;
  EXPECT_HAS(validate_error(p, 8), "pipelines[0].stages[0].layers: [0, 0) is empty");
}

TEST(Plan, LayerCountMismatchNamesBothCounts) {
  std::string e = validate_error(sample_plan(), 10);
  EXPECT_HAS(e, "pipelines[0].stages: cover blocks [0, 8) but the model has 10 (model.layers)");
  e = validate_error(sample_plan(), 6);
  EXPECT_HAS(e, "cover blocks [0, 8) but the model has 6");
}

TEST(Plan, BatchSumMismatchShowsTheArithmetic) {
  Plan p = sample_plan();
  p.global_batch = 9;
  EXPECT_HAS(validate_error(p, 8),
             "global_batch: 9 != the pipelines' samples, micro_batch_size x num_micro_batches less a short last one's gap (2x3 + 1x2 = 8)");
}

TEST(Plan, DuplicateRankNamesBothPlaces) {
  Plan p = sample_plan();
  p.pipelines[1].stages[0].ranks = {1};
  EXPECT_HAS(validate_error(p, 8), "pipelines[1].stages[0].ranks: rank 1 already appears in pipelines[0].stages[1]");
}

TEST(Plan, MissingRankIsNamed) {
  Plan p = sample_plan();
  p.pipelines[1].stages[0].ranks = {3};
  EXPECT_HAS(validate_error(p, 8), "ranks must be 0..2 with none missing; rank 2 is missing");
}

TEST(Plan, NegativeAndEmptyRankListsAreRejected) {
  Plan p = sample_plan();
  p.pipelines[1].stages[0].ranks = {-1};
  EXPECT_HAS(validate_error(p, 8), "rank -1 is negative");
  p = sample_plan();
  p.pipelines[1].stages[0].ranks = {};
  EXPECT_HAS(validate_error(p, 8), "pipelines[1].stages[0].ranks: a stage needs a rank");
}

TEST(Plan, ScalarFieldsAreChecked) {
  Plan p = sample_plan();
  p.schedule = "zb";
  EXPECT_HAS(validate_error(p, 8), "schedule: must be 1f1b, eager-1f1b, eager-1f1b-2, eager-1f1b-3, eager-1f1b-4, gpipe, zb-h1 or interleaved-1f1b, got 'zb'");
  p = sample_plan();
  p.grad_sync.bucket_mb = 0;
  EXPECT_HAS(validate_error(p, 8), "key 'grad_sync.bucket_mb': must be > 0");
  p = sample_plan();
  p.grad_sync.compression = "powersdg";
  EXPECT_HAS(validate_error(p, 8), "key 'grad_sync.compression': unknown value 'powersdg' (did you mean 'powersgd'?)");
  p = sample_plan();
  p.grad_sync.compression = "dgc";
  p.grad_sync.density = 0;
  EXPECT_HAS(validate_error(p, 8), "key 'grad_sync.density': must be in (0, 1], got 0");
  p = sample_plan();
  p.grad_sync.compression = "powersgd";
  p.grad_sync.powersgd_rank = 0;
  EXPECT_HAS(validate_error(p, 8), "key 'grad_sync.powersgd_rank': must be >= 1, got 0");
  p = sample_plan();
  p.slow_links = {{0, 7}};
  EXPECT_HAS(validate_error(p, 8), "grad_sync.slow_links: [0, 7] must name two different ranks");
  p = sample_plan();
  p.pipelines[1].micro_batch_size = 0;
  EXPECT_HAS(validate_error(p, 8), "pipelines[1].micro_batch_size: must be >= 1, got 0");
  p = sample_plan();
  p.pipelines[0].num_micro_batches = -2;
  EXPECT_HAS(validate_error(p, 8), "pipelines[0].num_micro_batches: must be >= 1, got -2");
  p = sample_plan();
  p.pipelines[1].stages.clear();
  EXPECT_HAS(validate_error(p, 8), "pipelines[1].stages: a pipeline needs at least one stage");
  EXPECT_HAS(validate_error(Plan{}, 8), "pipelines: the plan has no pipelines");
}

TEST(Plan, JsonRoundTripKeepsEveryField) {
  Plan p = sample_plan();
  p.schedule = "gpipe";
  p.grad_sync.bucket_mb = 12.5;
  p.predicted = {{"step_ms", 41.5}};
  nlohmann::json j = p.to_json();
  EXPECT_EQ(j["format"], "alloy-plan");
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["pipelines"][0]["stages"][1]["layers"], nlohmann::json::array({3, 8}));
  EXPECT_FALSE(j["pipelines"][0]["stages"][1].contains("device"));  // empty device is left out

  Plan q = Plan::from_json(j, "x");
  EXPECT_EQ(q.global_batch, 8);
  EXPECT_EQ(q.schedule, "gpipe");
  EXPECT_DOUBLE_EQ(q.grad_sync.bucket_mb, 12.5);
  EXPECT_EQ(q.grad_sync.compression, "none");
  EXPECT_EQ(q.predicted, p.predicted);
  ASSERT_EQ(q.pipelines.size(), 2u);
  EXPECT_EQ(q.pipelines[0].micro_batch_size, 2);
  EXPECT_EQ(q.pipelines[0].num_micro_batches, 3);
  ASSERT_EQ(q.pipelines[0].stages.size(), 2u);
  EXPECT_EQ(q.pipelines[0].stages[0].device, "gpu-a");
  EXPECT_EQ(q.pipelines[0].stages[1].ranks, std::vector<int>{1});
  EXPECT_EQ(q.pipelines[0].stages[1].layer_begin, 3);
  EXPECT_EQ(q.pipelines[0].stages[1].layer_end, 8);
  EXPECT_EQ(q.to_json(), j);
  EXPECT_EQ(validate_error(q, 8), "");
}

TEST(Plan, JsonRoundTripKeepsCompression) {
  Plan p = sample_plan();
  p.grad_sync.compression = "dgc";
  p.grad_sync.density = 0.001;
  p.grad_sync.fusion = "saf-inter";
  p.grad_sync.error_feedback = false;
  p.grad_sync.warmup_steps = 7;
  p.grad_sync.dense_steps = 3;
  p.grad_sync.scope = "slow-links";
  p.slow_links = {{0, 2}, {1, 2}};
  Plan q = Plan::from_json(p.to_json(), "x");
  EXPECT_EQ(q.grad_sync.compression, "dgc");
  EXPECT_DOUBLE_EQ(q.grad_sync.density, 0.001);
  EXPECT_EQ(q.grad_sync.fusion, "saf-inter");
  EXPECT_FALSE(q.grad_sync.error_feedback);
  EXPECT_EQ(q.grad_sync.warmup_steps, 7);
  EXPECT_EQ(q.grad_sync.dense_steps, 3);
  EXPECT_EQ(q.grad_sync.scope, "slow-links");
  EXPECT_EQ(q.slow_links, p.slow_links);
  EXPECT_EQ(q.to_json(), p.to_json());
  // SAFusion's method names are read as Alloy's.
  auto j = p.to_json();
  j["grad_sync"]["compression"] = "gaussian";
  EXPECT_EQ(Plan::from_json(j, "x").grad_sync.compression, "gaussiank");
  // The exact sums' route: auto (trees around slow links) is the default and not written; ring is.
  EXPECT_FALSE(p.to_json()["grad_sync"].contains("allreduce"));
  p.grad_sync.allreduce = "ring";
  EXPECT_EQ(Plan::from_json(p.to_json(), "x").grad_sync.allreduce, "ring");
  j = p.to_json();
  j["grad_sync"]["allreduce"] = "tree";
  EXPECT_HAS(validate_error(Plan::from_json(j, "x"), 8), "allreduce': unknown value 'tree'");
  EXPECT_HAS(validate_error(Plan::from_json(j, "x"), 8), "allowed: auto, ring");
}

// ZeRO per holder set: version 2 when present, version 1 stays readable and is written without it.
TEST(Plan, ShardingEntriesRoundTripAndAreValidatedByField) {
  Plan p = sample_plan();
  EXPECT_EQ(p.to_json()["version"], 1);
  p.sharding = {alloy::ShardingPlan{{0, 2}, 2, {3, 1}}, alloy::ShardingPlan{{1, 2}, 1, {}}};
  const auto j = p.to_json();
  EXPECT_EQ(j["version"], 2);
  Plan q = Plan::from_json(j, "x");
  ASSERT_EQ(q.sharding.size(), 2u);
  EXPECT_EQ(q.sharding[0].ranks, (std::vector<int>{0, 2}));
  EXPECT_EQ(q.sharding[0].stage, 2);
  EXPECT_EQ(q.sharding[0].shares, (std::vector<double>{3, 1}));
  EXPECT_TRUE(q.sharding[1].shares.empty());
  EXPECT_EQ(q.sharding_of({1, 2}), &q.sharding[1]);
  EXPECT_EQ(q.sharding_of({0, 1}), nullptr);
  EXPECT_EQ(validate_error(q, 8), "");
  EXPECT_NE(q.describe().find("sharding: ranks 0,2 ZeRO-2, shares 3:1"), std::string::npos) << q.describe();

  auto bad = [&](auto edit, const std::string& needle) {
    Plan b = q;
    edit(b);
    const std::string e = validate_error(b, 8);
    EXPECT_NE(e.find(needle), std::string::npos) << "'" << e << "' lacks '" << needle << "'";
  };
  bad([](Plan& b) { b.sharding[0].stage = 4; }, "sharding[0].stage: must be 0, 1, 2 or 3, got 4");
  bad([](Plan& b) { b.sharding[0].stage = 7; }, "sharding[0].stage");
  bad([](Plan& b) { b.sharding[1].shares = {1, 1, 1}; }, "sharding[1].shares: has 3 entries for 2 ranks");
  bad([](Plan& b) { b.sharding[0].ranks = {2, 0}; }, "sharding[0].ranks: must be ascending");
  bad([](Plan& b) { b.sharding[0].ranks = {0, 5}; }, "sharding[0].ranks: rank 5 is not in the plan");
  bad([](Plan& b) { b.sharding[1].ranks = {0, 2}; }, "sharding[1].ranks: the same ranks as sharding[0]");
  bad([](Plan& b) { b.sharding[0].shares = {3, 0}; }, "sharding[0].shares: must be positive");
  // A recomputing stage alone also makes version 2, and round-trips.
  Plan r = sample_plan();
  r.pipelines[0].stages[1].recompute = true;
  EXPECT_EQ(r.to_json()["version"], 2);
  EXPECT_TRUE(Plan::from_json(r.to_json(), "x").pipelines[0].stages[1].recompute);
  EXPECT_NE(r.describe().find("recompute"), std::string::npos);
  auto v4 = j;  // a version this Alloy does not know
  v4["version"] = 11;
  EXPECT_THROW(Plan::from_json(v4, "x"), InputError);
}

TEST(Plan, HalfBlockStagesRoundTripAsVersion3AndValidateInUnits) {
  // 4 blocks = 8 half-block units: a stage of 2.5 blocks and one of 1.5.
  Plan p = Plan::from_json(nlohmann::json::parse(R"({"version": 3, "global_batch": 4, "pipelines": [
      {"micro_batch_size": 2, "num_micro_batches": 2, "stages": [
        {"ranks": [0], "units": [0, 5]}, {"ranks": [1], "units": [5, 8], "layers": [2, 4]}]}]})"),
                           "x");
  const auto& a = p.pipelines[0].stages[0];
  const auto& b = p.pipelines[0].stages[1];
  EXPECT_EQ(a.layer_begin, 0);
  EXPECT_EQ(a.layer_end, 3);  // touches block 2 (its attention half)
  EXPECT_TRUE(a.to_attention);
  EXPECT_FALSE(a.from_mlp);
  EXPECT_EQ(b.layer_begin, 2);
  EXPECT_TRUE(b.from_mlp);
  EXPECT_DOUBLE_EQ(a.blocks(), 2.5);
  EXPECT_DOUBLE_EQ(b.blocks(), 1.5);
  EXPECT_EQ(validate_error(p, 4), "");
  EXPECT_EQ(p.to_json()["version"], 3);
  EXPECT_EQ(p.to_json()["pipelines"][0]["stages"][0]["units"], nlohmann::json::array({0, 5}));
  EXPECT_EQ(Plan::from_json(p.to_json(), "x").to_json(), p.to_json());
  EXPECT_HAS(p.describe(), "units [0,5)");
  // Whole-block plans keep version 1 and no "units".
  Plan w = Plan::from_json(nlohmann::json::parse(R"({"global_batch": 4, "pipelines": [
      {"micro_batch_size": 2, "num_micro_batches": 2, "stages": [{"ranks": [0], "units": [0, 4]}, {"ranks": [1], "layers": [2, 4]}]}]})"),
                           "x");
  EXPECT_EQ(w.to_json()["version"], 1);
  EXPECT_FALSE(w.to_json()["pipelines"][0]["stages"][0].contains("units"));
  // Gaps and overlaps are named in units once a boundary is inside a block.
  Plan gap = p;
  gap.pipelines[0].stages[1].set_units(6, 8);
  EXPECT_HAS(validate_error(gap, 4), "stages[1].units: starts at unit 6 but the previous stage ended at 5 (a gap)");
  Plan short_ = p;
  short_.pipelines[0].stages[1].set_units(5, 7);
  EXPECT_HAS(validate_error(short_, 4), "cover units [0, 7) (half blocks) but the model has 8 (model.layers)");
  // "layers" beside "units" must name the blocks the units touch.
  EXPECT_THROW(Plan::from_json(nlohmann::json::parse(R"({"global_batch": 4, "pipelines": [
      {"micro_batch_size": 2, "num_micro_batches": 2, "stages": [{"ranks": [0], "units": [0, 5], "layers": [0, 2]},
                                                                  {"ranks": [1], "units": [5, 8]}]}]})"),
                               "x"),
               InputError);
  EXPECT_THROW(Plan::from_json(nlohmann::json::parse(R"({"global_batch": 4, "pipelines": [
      {"micro_batch_size": 4, "num_micro_batches": 1, "stages": [{"ranks": [0], "units": [3, 3]}]}]})"),
                               "x"),
               InputError);
}

TEST(Plan, FloatingBoundariesShareAUnitRunInAnEvenlySpreadShareOfMicroBatches) {
  // 4 blocks = 8 units; stage 0 holds [0, 6) and stage 1 [5, 8): they share unit 5 (block 2's MLP
  // half), which stage 0 runs in 2/3 of the 9 micro-batches.
  Plan p = Plan::from_json(nlohmann::json::parse(R"({"version": 5, "global_batch": 9, "pipelines": [
      {"micro_batch_size": 1, "num_micro_batches": 9, "stages": [
        {"ranks": [0], "units": [0, 6], "float_share": 0.6666666666666666}, {"ranks": [1], "units": [5, 8]}]}]})"),
                           "x");
  EXPECT_EQ(validate_error(p, 4), "");
  const PipelinePlan& pl = p.pipelines[0];
  EXPECT_TRUE(pl.floats());
  EXPECT_EQ(pl.float_count(0), 6);
  std::vector<int64_t> cuts;
  for (int64_t m = 0; m < 9; ++m) {
    cuts.push_back(pl.cut(0, m));
    EXPECT_EQ(pl.units_of(0, m), std::make_pair(int64_t{0}, cuts.back()));
    EXPECT_EQ(pl.units_of(1, m), std::make_pair(cuts.back(), int64_t{8}));
  }
  // Six late cuts (stage 0 runs unit 5), spread: never three of a kind in a row.
  EXPECT_EQ(cuts, (std::vector<int64_t>{5, 6, 6, 5, 6, 6, 5, 6, 6}));
  // The share, not a count, is stored: another number of micro-batches keeps the ratio.
  Plan ten = p;
  ten.pipelines[0].num_micro_batches = 10;
  ten.global_batch = 10;
  EXPECT_EQ(ten.pipelines[0].float_count(0), 7);
  EXPECT_EQ(p.to_json()["version"], 5);
  EXPECT_EQ(Plan::from_json(p.to_json(), "x").to_json(), p.to_json());
  EXPECT_HAS(p.describe(), "runs unit 5 for 6 of 9 micro-batches");
  // Without a float_share the overlap is an overlap.
  Plan no_share = p;
  no_share.pipelines[0].stages[0].float_share = 0;
  EXPECT_HAS(validate_error(no_share, 4), "stages[1].units: starts at unit 5 but the previous stage ended at 6 (an overlap)");
  // A float_share needs the next stage to start at the shared unit.
  Plan apart = p;
  apart.pipelines[0].stages[1].set_units(6, 8);
  EXPECT_HAS(validate_error(apart, 4), "the two share unit 5: start at 5");
  Plan bad = p;
  bad.pipelines[0].stages[0].float_share = 1.5;
  EXPECT_HAS(validate_error(bad, 4), "stages[0].float_share: must be in (0, 1)");
  Plan last = p;
  last.pipelines[0].stages[1].float_share = 0.5;
  EXPECT_HAS(validate_error(last, 4), "stages[1].float_share: the last stage has no next stage");
  // A middle stage sharing both its ends must keep a unit of its own.
  Plan squeezed = Plan::from_json(nlohmann::json::parse(R"({"global_batch": 2, "pipelines": [
      {"micro_batch_size": 1, "num_micro_batches": 2, "stages": [
        {"ranks": [0], "units": [0, 4], "float_share": 0.5}, {"ranks": [1], "units": [3, 5], "float_share": 0.5},
        {"ranks": [2], "units": [4, 8]}]}]})"),
                                  "x");
  EXPECT_HAS(validate_error(squeezed, 4), "stages[1].float_share: the stage holds units [3, 5) and shares its first and last");
  Plan tp = p;
  tp.pipelines[0].stages[1].ranks = {1, 2};
  EXPECT_HAS(validate_error(tp, 4), "a floating boundary needs one rank on each side");
}

TEST(Plan, ACutMlpSharesItsUnitByColumnsAndDoublesTheMessageAcross) {
  // 4 blocks = 8 units; stage 0 holds [0, 6) and stage 1 [5, 8): they share unit 5 (block 2's MLP
  // half), stage 0 computing the columns of 1 of the 4 heads in every micro-batch.
  Plan p = Plan::from_json(nlohmann::json::parse(R"({"version": 8, "global_batch": 4, "pipelines": [
      {"micro_batch_size": 1, "num_micro_batches": 4, "stages": [
        {"ranks": [0], "units": [0, 6], "mlp_cut": 1}, {"ranks": [1], "units": [5, 8]}]}]})"),
                           "x");
  EXPECT_EQ(validate_error(p, 4), "");
  const PipelinePlan& pl = p.pipelines[0];
  EXPECT_TRUE(p.cuts_mlp());
  EXPECT_TRUE(p.has_pieces());
  EXPECT_FALSE(pl.floats());
  EXPECT_EQ(pl.message_width(0, 128), 256);
  for (int64_t m = 0; m < 4; ++m) {  // both stages run the shared unit every time
    EXPECT_EQ(pl.units_of(0, m), std::make_pair(int64_t{0}, int64_t{6}));
    EXPECT_EQ(pl.units_of(1, m), std::make_pair(int64_t{5}, int64_t{8}));
  }
  EXPECT_EQ(p.to_json()["version"], 8);
  EXPECT_EQ(p.to_json()["pipelines"][0]["stages"][0]["mlp_cut"], 1);
  EXPECT_EQ(Plan::from_json(p.to_json(), "x").to_json(), p.to_json());
  EXPECT_HAS(p.describe(), "unit 5's MLP columns of 1 heads");
  Plan apart = p;
  apart.pipelines[0].stages[1].set_units(6, 8);
  EXPECT_HAS(validate_error(apart, 4), "previous stage has an mlp_cut, so the two share unit 5: start at 5");
  Plan range = p;
  range.pipelines[0].stages[0].mlp_cut = 4;
  EXPECT_HAS(validate_error(range, 4), "stages[0].mlp_cut: must be in [1, 3]");
  Plan attention = p;  // a cut goes inside an MLP half, not an attention half
  attention.pipelines[0].stages[0].set_units(0, 5);
  attention.pipelines[0].stages[1].set_units(4, 8);
  EXPECT_HAS(validate_error(attention, 4), "the stage's last unit 4 is an attention half");
  Plan last = p;
  last.pipelines[0].stages[1].mlp_cut = 2;
  EXPECT_HAS(validate_error(last, 4), "stages[1].mlp_cut: the last stage has no next stage");
  Plan both = p;
  both.pipelines[0].stages[0].float_share = 0.5;
  EXPECT_HAS(validate_error(both, 4), "either in a float (float_share) or inside an MLP");
  Plan tp = p;
  tp.pipelines[0].stages[1].ranks = {1, 2};
  EXPECT_HAS(validate_error(tp, 4), "a cut MLP needs one rank on each side");
  EXPECT_THROW(Plan::from_json(nlohmann::json::parse(R"({"global_batch": 1, "pipelines": [
      {"micro_batch_size": 1, "num_micro_batches": 1, "stages": [{"ranks": [0], "units": [0, 6], "mlp_cut": 0.5}]}]})"),
                               "x"),
               InputError);
}

namespace {
alloy::ModelConfig heads_model(int64_t heads, int64_t kv_heads) {
  alloy::ModelConfig m = model_with(8);
  m.arch = "llama";
  m.heads = heads;
  m.kv_heads = kv_heads;
  m.hidden = heads * 16;
  m.ffn = heads * 24;
  return m;
}
}  // namespace

// A pipeline's own schedule (version 6): written only where it differs from the plan's, read
// back, shown by describe(), validated by name and against tensor parallelism per pipeline, and
// part of what ZeRO-3 needs its members to share.
TEST(Plan, PipelineSchedulesRoundTripAsVersion6AndAreValidatedPerPipeline) {
  Plan p = sample_plan();
  p.pipelines[0].schedule = "zb-h1";
  EXPECT_NO_THROW(p.validate(heads_model(8, 4), "p.json"));
  EXPECT_EQ(p.schedule_of(0), "zb-h1");
  EXPECT_EQ(p.schedule_of(1), "1f1b");
  EXPECT_TRUE(alloy::pipeline::splits_backward(p.schedule_of(0)));
  EXPECT_EQ(p.schedules_text(), "1f1b (pipeline 0 zb-h1)");
  EXPECT_HAS(p.describe(), "blocks [3,8) | schedule zb-h1\n");
  EXPECT_EQ(p.to_json()["version"], 6);
  EXPECT_EQ(p.to_json()["pipelines"][0]["schedule"], "zb-h1");
  EXPECT_EQ(Plan::from_json(p.to_json(), "x").to_json(), p.to_json());
  // The same as the plan's: nothing to write, and the version stays what the rest needs.
  Plan same = sample_plan();
  same.pipelines[1].schedule = "1f1b";
  EXPECT_EQ(same.to_json()["version"], 1);
  EXPECT_FALSE(same.to_json()["pipelines"][1].contains("schedule"));
  EXPECT_FALSE(alloy::pipeline::splits_backward(same.schedule_of(1)));
  // Ranks of pipelines on different schedules do not run the same one.
  Plan twins = sample_plan();
  twins.pipelines[1].stages = {StagePlan{{2}, 0, 3, ""}, StagePlan{{3}, 3, 8, ""}};
  twins.pipelines[1].micro_batch_size = 2;
  twins.pipelines[1].num_micro_batches = 1;
  twins.global_batch = 8;
  twins.pipelines[0].num_micro_batches = twins.pipelines[1].num_micro_batches = 2;
  EXPECT_EQ(twins.schedule_mismatch({0, 2}), "");
  twins.pipelines[1].schedule = "gpipe";
  EXPECT_HAS(twins.schedule_mismatch({0, 2}), "on 1f1b, rank 2 runs units [0, 6) as stage 0 of 2 with 2 micro-batches on gpipe");
  p.pipelines[1].schedule = "zb";
  EXPECT_HAS(validate_error(p, 8), "pipelines[1].schedule: must be 1f1b, eager-1f1b, eager-1f1b-2, eager-1f1b-3, eager-1f1b-4, gpipe, zb-h1 or interleaved-1f1b, got 'zb'");
  // A split backward runs tensor-parallel stages too (their pieces' weight passes).
  Plan tp = sample_plan();
  tp.pipelines[1].stages[0].ranks = {2, 3};
  tp.schedule = "zb-h1";
  auto err = [&](const Plan& q) {
    try {
      q.validate(heads_model(8, 4), "p.json");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(err(tp), "");
  tp.schedule = "1f1b";
  tp.pipelines[1].schedule = "zb-h1";
  EXPECT_EQ(err(tp), "");
}

TEST(Plan, LoraTrainsOnTensorParallelStagesOverAnyBase) {
  Plan p = sample_plan();
  alloy::Config cfg;
  cfg.lora.rank = 4;
  EXPECT_EQ(p.training_problem(cfg), "");
  p.pipelines[1].stages[0].ranks = {2, 3};
  EXPECT_EQ(p.training_problem(cfg), "");
  cfg.lora.base_dtype = "nf4";
  EXPECT_EQ(p.training_problem(cfg), "");
  p.pipelines[1].stages[0].ranks = {2};
  EXPECT_EQ(p.training_problem(cfg), "");
  // Sequence parallelism needs a position for every member: heads 7:1 of 8 over 4 positions is 3:1,
  // 1:15 of 16 over 8 positions leaves the first member none.
  alloy::Config sp;
  sp.train.sequence_parallel = true;
  sp.model.heads = 8, sp.model.seq_len = 4;
  p.pipelines[1].stages[0].ranks = {2, 3};
  p.pipelines[1].stages[0].tp_split = {7, 1};
  EXPECT_EQ(p.training_problem(sp), "");
  sp.model.heads = 16, sp.model.seq_len = 8;
  p.pipelines[1].stages[0].tp_split = {1, 15};
  EXPECT_HAS(p.training_problem(sp), "pipelines[1].stages[0]: sequence parallelism gives rank 2 (heads 0-1 of 16) none of the 8 positions");
  sp.train.sequence_parallel = false;
  EXPECT_EQ(p.training_problem(sp), "");
}

TEST(Plan, TensorParallelStagesRoundTripAsVersion4AndCheckTheirSplit) {
  Plan p = sample_plan();
  p.pipelines[1].stages[0].ranks = {2, 3};
  p.pipelines[1].stages[0].tp_split = {6, 2};
  const auto m = heads_model(8, 4);
  EXPECT_NO_THROW(p.validate(m, "p.json"));
  EXPECT_TRUE(p.has_tensor_parallel());
  EXPECT_EQ(p.world_size(), 4);
  EXPECT_EQ(p.locate(3).tp_rank, 1);
  EXPECT_EQ(p.locate(2).tp_rank, 0);
  EXPECT_EQ(p.to_json()["version"], 4);
  EXPECT_EQ(Plan::from_json(p.to_json(), "x").to_json(), p.to_json());
  EXPECT_HAS(p.describe(), "ranks 2+3 (tp heads 6:2)");
  EXPECT_EQ(p.pipelines[1].stages[0].tp_bounds(8), (std::vector<int64_t>{0, 6, 8}));
  auto err = [&](const alloy::ModelConfig& model) {
    try {
      p.validate(model, "p.json");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // GQA: 8 heads on 4 key/value heads come in groups of 2, and 5:3 cuts one; the error says a split that works.
  p.pipelines[1].stages[0].tp_split = {5, 3};
  EXPECT_HAS(err(m), "pipelines[1].stages[0].tp_split: with 4 key/value heads each serves 2 query heads, and heads 5 3 cut a group (e.g. tp_split 4 4)");
  p.pipelines[1].stages[0].tp_split = {6, 1};
  EXPECT_HAS(err(m), "heads 6 1 sum to 7, the model has 8");
  p.pipelines[1].stages[0].tp_split = {6, 0};
  EXPECT_HAS(err(m), "every rank needs at least one head");
  p.pipelines[1].stages[0].tp_split = {6, 1, 1};
  EXPECT_HAS(err(m), "tp_split: has 3 entries for 2 ranks");
  // Even by default; 4 heads over 3 ranks do not split evenly, and the error gives a split.
  p.pipelines[1].stages[0].ranks = {2, 3, 4};
  p.pipelines[1].stages[0].tp_split.clear();
  EXPECT_HAS(err(heads_model(4, 0)), "4 heads do not split evenly over 3 tensor-parallel ranks: give tp_split [2, 1, 1]");
  p.pipelines[1].stages[0].tp_split = {2, 1, 1};
  EXPECT_EQ(err(heads_model(4, 0)), "");
  // MLP columns must follow the heads.
  auto odd = heads_model(4, 0);
  odd.ffn = 30;
  EXPECT_HAS(err(odd), "the MLP's 30 columns do not divide by the 4 heads");
  EXPECT_EQ(alloy::even_tp_split(heads_model(8, 4), 3), (std::vector<int64_t>{4, 2, 2}));
  EXPECT_TRUE(alloy::even_tp_split(heads_model(8, 2), 3).empty());  // 2 key/value groups cannot feed 3 ranks
}

TEST(Plan, SequenceParallelStagesRoundTripAsVersion7OnTensorParallelStagesOnly) {
  Plan p = sample_plan();
  p.pipelines[1].stages[0].ranks = {2, 3};
  p.pipelines[1].stages[0].tp_split = {6, 2};
  p.pipelines[1].stages[0].sequence_parallel = true;
  const auto m = heads_model(8, 4);
  EXPECT_NO_THROW(p.validate(m, "p.json"));
  EXPECT_EQ(p.to_json()["version"], 7);
  EXPECT_EQ(p.to_json()["pipelines"][1]["stages"][0]["sequence_parallel"], true);
  EXPECT_FALSE(p.to_json()["pipelines"][0]["stages"][0].contains("sequence_parallel"));
  EXPECT_EQ(Plan::from_json(p.to_json(), "x").to_json(), p.to_json());
  EXPECT_HAS(p.describe(), "ranks 2+3 (tp heads 6:2, sequence parallel)");
  // The stage's own flag asks what train.sequence_parallel asks: a position for every member.
  alloy::Config cfg;
  cfg.model.heads = 16, cfg.model.seq_len = 8;
  p.pipelines[1].stages[0].tp_split = {1, 15};
  EXPECT_HAS(p.training_problem(cfg), "pipelines[1].stages[0]: sequence parallelism gives rank 2 (heads 0-1 of 16) none of the 8 positions");
  // Validation says so too, by field, where the model is known.
  auto few_positions = heads_model(16, 0);
  few_positions.seq_len = 8;
  try {
    p.validate(few_positions, "p.json");
    ADD_FAILURE() << "a member without positions validated";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), "pipelines[1].stages[0].sequence_parallel: rank 2 would hold none of the 8 positions");
  }
  p.pipelines[1].stages[0].sequence_parallel = false;
  EXPECT_EQ(p.training_problem(cfg), "");
  EXPECT_NO_THROW(p.validate(few_positions, "p.json"));
  // On a stage of one rank there is no group to split positions over.
  Plan one = sample_plan();
  one.pipelines[0].stages[0].sequence_parallel = true;
  try {
    one.validate(m, "p.json");
    ADD_FAILURE() << "a one-rank stage with sequence_parallel validated";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), "pipelines[0].stages[0].sequence_parallel: needs a tensor-parallel stage");
  }
  nlohmann::json bad = p.to_json();
  bad["pipelines"][1]["stages"][0]["sequence_parallel"] = "yes";
  try {
    Plan::from_json(bad, "p.json");
    ADD_FAILURE() << "a string sequence_parallel was read";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), "pipelines[1].stages[0].sequence_parallel");
  }
}

TEST(Plan, FromJsonDefaultsOptionalFields) {
  Plan p = Plan::from_json(nlohmann::json::parse(R"({"global_batch": 4,
      "pipelines": [{"micro_batch_size": 2, "num_micro_batches": 2, "stages": [{"ranks": [0], "layers": [0, 4]}]}]})"),
                           "x");
  EXPECT_EQ(p.schedule, "1f1b");
  EXPECT_DOUBLE_EQ(p.grad_sync.bucket_mb, 25.0);
  EXPECT_EQ(p.grad_sync.compression, "none");
  EXPECT_TRUE(p.predicted.is_null());
  EXPECT_EQ(validate_error(p, 4), "");
}

TEST(Plan, FromJsonNamesTheBadField) {
  auto error_of = [](const std::string& text) -> std::string {
    try {
      Plan::from_json(nlohmann::json::parse(text), "plan.json");
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_HAS(error_of(R"({"format": "other", "global_batch": 1, "pipelines": []})"), "field 'format' is \"other\"");
  EXPECT_HAS(error_of(R"({"version": 11, "global_batch": 1, "pipelines": []})"), "this Alloy reads versions 1 to 10");
  EXPECT_HAS(error_of(R"({"version": 2.5, "global_batch": 1, "pipelines": []})"), "this Alloy reads versions 1 to 10");
  EXPECT_HAS(error_of(R"({"pipelines": []})"), "plan.json: field 'global_batch' is missing or ill-typed");
  EXPECT_HAS(
      error_of(
          R"({"global_batch": 1, "pipelines": [{"micro_batch_size": "two", "num_micro_batches": 1, "stages": []}]})"),
      "field 'pipelines[0]' is missing or ill-typed");
  EXPECT_HAS(error_of(R"({"global_batch": 1, "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1,
                         "stages": [{"ranks": [0], "layers": [0, 4, 8]}]}]})"),
             "pipelines[0].stages[0].layers: must be [begin, end)");
  EXPECT_HAS(error_of(R"({"global_batch": 1, "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1,
                         "stages": [{"layers": [0, 4]}]}]})"),
             "field 'pipelines[0].stages[0]' is missing or ill-typed");
  EXPECT_HAS(error_of(R"([1, 2])"), "field 'global_batch' is missing or ill-typed");
}

TEST(Plan, SaveAndLoadRoundTrip) {
  TempDir t;
  Plan p = sample_plan();
  p.save(t.file("plan.json"));
  Plan q = Plan::load(t.file("plan.json"));
  EXPECT_EQ(q.to_json(), p.to_json());

  std::ofstream(t.file("broken.json")) << "{\"global_batch\": ";
  try {
    Plan::load(t.file("broken.json"));
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), t.file("broken.json") + ": not valid JSON");
  }
  EXPECT_THROW(Plan::load(t.file("absent.json")), InputError);
}

TEST(Plan, DescribeShowsEveryStage) {
  std::string d = sample_plan().describe();
  EXPECT_HAS(d, "global batch 8, schedule 1f1b, 2 pipelines, 3 ranks\n");
  EXPECT_HAS(d, "pipeline 0: 2 x 3 = 6 samples | rank 0 blocks [0,3) (gpu-a) -> rank 1 blocks [3,8)\n");
  EXPECT_HAS(d, "pipeline 1: 1 x 2 = 2 samples | rank 2 blocks [0,8) (gpu-b)\n");
  EXPECT_HAS(Plan::data_parallel(4, {{4, 1}}).describe(), "1 pipeline, 1 rank\n");
}

TEST(Plan, LocateFindsEveryRankAndNamesUnknownOnes) {
  Plan p = sample_plan();
  EXPECT_EQ(p.locate(0).pipeline, 0);
  EXPECT_EQ(p.locate(0).stage, 0);
  EXPECT_EQ(p.locate(1).pipeline, 0);
  EXPECT_EQ(p.locate(1).stage, 1);
  EXPECT_EQ(p.locate(2).pipeline, 1);
  EXPECT_EQ(p.locate(2).stage, 0);
  try {
    p.locate(7);
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), "rank 7 does not appear in the plan (world size 3)");
  }
}

TEST(Plan, SampleOffsetsAreConsecutiveSlices) {
  Plan p = sample_plan();
  EXPECT_EQ(p.sample_offset(0), 0);
  EXPECT_EQ(p.sample_offset(1), 6);
  EXPECT_EQ(p.sample_offset(2), 8);  // one past the last pipeline: the whole batch
}

TEST(Plan, SingleDeviceRunsTheWholeModel) {
  alloy::Config cfg;
  cfg.model.layers = 6;
  cfg.train.global_batch = 8;
  cfg.train.micro_batch = 2;
  Plan p = Plan::single_device(cfg);
  EXPECT_EQ(validate_error(p, 6), "");
  ASSERT_EQ(p.pipelines.size(), 1u);
  EXPECT_EQ(p.pipelines[0].micro_batch_size, 2);
  EXPECT_EQ(p.pipelines[0].num_micro_batches, 4);
}

RC_GTEST_PROP(PlanProperty, DataParallelPlansValidateAndPartitionTheBatch, ()) {
  const int64_t layers = *rc::gen::inRange<int64_t>(1, 64);
  const auto mbs_nmb = *rc::gen::nonEmpty(rc::gen::container<std::vector<std::pair<int64_t, int64_t>>>(
      rc::gen::pair(rc::gen::inRange<int64_t>(1, 32), rc::gen::inRange<int64_t>(1, 16))));
  const std::string schedule = *rc::gen::element(std::string("1f1b"), std::string("gpipe"));
  Plan p = Plan::data_parallel(layers, mbs_nmb, schedule);
  p.validate(model_with(layers), "dp");
  RC_ASSERT(p.world_size() == static_cast<int>(mbs_nmb.size()));

  // Pipeline P owns samples [offset(P), offset(P) + samples(P)); together they tile [0, global).
  std::vector<int> owner(static_cast<size_t>(p.global_batch), -1);
  for (size_t i = 0; i < p.pipelines.size(); ++i) {
    const int64_t off = p.sample_offset(static_cast<int>(i));
    RC_ASSERT(p.pipelines[i].samples() == mbs_nmb[i].first * mbs_nmb[i].second);
    for (int64_t s = off; s < off + p.pipelines[i].samples(); ++s) {
      RC_ASSERT(s >= 0);
      RC_ASSERT(s < p.global_batch);
      RC_ASSERT(owner[static_cast<size_t>(s)] == -1);
      owner[static_cast<size_t>(s)] = static_cast<int>(i);
    }
    RC_ASSERT(p.locate(static_cast<int>(i)).pipeline == static_cast<int>(i));
  }
  for (int o : owner) RC_ASSERT(o != -1);
  RC_ASSERT(Plan::from_json(p.to_json(), "rt").to_json() == p.to_json());
}

namespace {
// 8 blocks interleaved over ranks 0 and 1, two chunks each: [0,3) r0, [3,4) r1, [4,7) r0, [7,8) r1.
Plan interleaved_plan() {
  Plan p;
  p.global_batch = 8;
  p.schedule = "interleaved-1f1b";
  PipelinePlan a;
  a.micro_batch_size = 2;
  a.num_micro_batches = 4;
  a.virtual_stages = 2;
  a.stages = {StagePlan{{0}, 0, 3}, StagePlan{{1}, 3, 4}, StagePlan{{0}, 4, 7}, StagePlan{{1}, 7, 8}};
  p.pipelines = {a};
  return p;
}
}  // namespace

TEST(Plan, InterleavedPipelinesRoundTripAsVersion10AndLocateEachRanksChunks) {
  const Plan p = interleaved_plan();
  EXPECT_EQ(validate_error(p, 8), "");
  EXPECT_EQ(p.world_size(), 2);
  EXPECT_EQ(p.pipelines[0].depth(), 2);
  EXPECT_EQ(p.locate(1).stage, 1);
  EXPECT_EQ(p.chunks_of(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(p.chunks_of(1), (std::vector<int>{1, 3}));
  const auto j = p.to_json();
  EXPECT_EQ(j["version"], 10);
  const Plan back = Plan::from_json(j, "x");
  EXPECT_EQ(back.pipelines[0].virtual_stages, 2);
  EXPECT_EQ(back.chunks_of(1), (std::vector<int>{1, 3}));
  EXPECT_EQ(validate_error(back, 8), "");
}

TEST(Plan, InterleavedPipelinesAreValidatedByField) {
  {
    Plan p = interleaved_plan();
    p.pipelines[0].stages[3].ranks = {0};  // chunk 3 must be rank 1's, as chunk 1
    EXPECT_HAS(validate_error(p, 8), "pipelines[0].stages[3].ranks: chunk 3 runs on the ranks of chunk 1");
  }
  {
    Plan p = interleaved_plan();
    p.schedule = "1f1b";
    EXPECT_HAS(validate_error(p, 8), "pipelines[0].virtual_stages: virtual stages run on the interleaved-1f1b schedule only");
  }
  {
    Plan p = interleaved_plan();
    p.pipelines[0].virtual_stages = 1;
    EXPECT_HAS(validate_error(p, 8), "schedule: interleaved-1f1b needs the pipeline's virtual_stages");
  }
  {
    Plan p = interleaved_plan();
    p.pipelines[0].virtual_stages = 4;  // 4 stages are one rank's 4 chunks: no pipeline
    EXPECT_HAS(validate_error(p, 8), "pipelines[0].virtual_stages: 4 stages do not make 4 chunks for each of two or more ranks");
  }
  {
    Plan p = interleaved_plan();
    p.pipelines[0].micro_batch_size = 1;
    p.pipelines[0].num_micro_batches = 3;  // > 2 ranks and not a multiple of them
    p.global_batch = 3;
    EXPECT_HAS(validate_error(p, 8), "pipelines[0].num_micro_batches: 3 on 2 ranks: interleaving needs a multiple of the ranks");
  }
  {
    Plan p = interleaved_plan();
    p.pipelines[0].stages[0].float_share = 0.5;
    EXPECT_HAS(validate_error(p, 8), "pipelines[0].stages[0].float_share: chunks of an interleaved pipeline meet at whole units");
  }
  {
    Plan p = interleaved_plan();
    p.pipelines[0].stages[0].ranks = {0, 2};
    p.pipelines[0].stages[2].ranks = {0, 2};
    EXPECT_HAS(validate_error(p, 8), "pipelines[0].stages[0].ranks: an interleaved pipeline has one rank a chunk");
  }
}
