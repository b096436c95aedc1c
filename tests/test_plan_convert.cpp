#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/core/plan.h"
#include "alloy/core/plan_convert.h"
#include "expect_error.h"
#include "temp_dir.h"

using alloy::testing::TempDir;
using alloy::InputError;
using alloy::Plan;
using alloy::SynerFuseArgs;
using nlohmann::json;

namespace {

using Args = std::vector<std::string>;

Plan from_flags(const Args& argv) { return alloy::plan_from_synerfuse(alloy::parse_synerfuse_args(argv)); }

std::string flags_error(const Args& argv) {
  try {
    from_flags(argv);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

std::string sf_error(const SynerFuseArgs& a) {
  try {
    alloy::plan_from_synerfuse(a);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

Args concat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string validate_error(const Plan& p, int64_t layers) {
  alloy::ModelConfig m;
  m.layers = layers;
  try {
    p.validate(m, "converted");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

// The README's heterogeneous data-parallel example, which needs a model size the README leaves out.
const Args kReadmeDp = {"--num-layers",
                        "4",
                        "--global-batch-size",
                        "32",
                        "--use-tp-pp-dp-mapping",
                        "--micro-batch-size-per-dp",
                        "1",
                        "6",
                        "1",
                        "2",
                        "--num-micro-batches-per-dp",
                        "1",
                        "4",
                        "1",
                        "4"};

}  // namespace

// ---- SynerFuse ----------------------------------------------------------------------------

TEST(SynerFuse, ReadmePipelineExample) {
  Plan p = from_flags({"--num-layers", "8", "--pipeline-model-parallel-size", "2", "--hetero-pipeline-stages", "1", "6",
                       "1", "2", "--global-batch-size", "8", "--micro-batch-size", "2"});
  EXPECT_EQ(validate_error(p, 8), "");
  ASSERT_EQ(p.pipelines.size(), 1u);
  const auto& pl = p.pipelines[0];
  ASSERT_EQ(pl.stages.size(), 2u);
  EXPECT_EQ(pl.stages[0].ranks, std::vector<int>{0});
  EXPECT_EQ(pl.stages[0].layer_begin, 0);
  EXPECT_EQ(pl.stages[0].layer_end, 6);
  EXPECT_EQ(pl.stages[1].ranks, std::vector<int>{1});
  EXPECT_EQ(pl.stages[1].layer_begin, 6);
  EXPECT_EQ(pl.stages[1].layer_end, 8);
  EXPECT_EQ(pl.stages[0].device, "");
  EXPECT_EQ(pl.micro_batch_size, 2);
  EXPECT_EQ(pl.num_micro_batches, 4);  // 8 / (dp 1 x mbs 2)
  EXPECT_EQ(p.schedule, "1f1b");
}

TEST(SynerFuse, ReadmeDataParallelExample) {
  Plan p = from_flags(kReadmeDp);
  EXPECT_EQ(validate_error(p, 4), "");
  EXPECT_EQ(p.global_batch, 32);
  ASSERT_EQ(p.pipelines.size(), 2u);
  EXPECT_EQ(p.pipelines[0].micro_batch_size, 6);
  EXPECT_EQ(p.pipelines[0].num_micro_batches, 4);
  EXPECT_EQ(p.pipelines[1].micro_batch_size, 2);
  EXPECT_EQ(p.pipelines[1].num_micro_batches, 4);
  EXPECT_EQ(p.pipelines[0].stages[0].ranks, std::vector<int>{0});
  EXPECT_EQ(p.pipelines[1].stages[0].ranks, std::vector<int>{1});
  EXPECT_EQ(p.pipelines[1].stages[0].layer_end, 4);
  EXPECT_EQ(p.sample_offset(1), 24);  // 6 x 4 samples go to the first group
}

TEST(SynerFuse, PipelineTimesDataParallelIsPipelineMajor) {
  // pp 2 (5 + 3 layers) x dp 3; the two lists group the data-parallel indices differently:
  // mbs = [4, 4, 2], nmb = [3, 2, 2] -> 12 + 8 + 4 = 24.
  Plan p = from_flags({"--num-layers",
                       "8",
                       "--pipeline-model-parallel-size",
                       "2",
                       "--hetero-pipeline-stages",
                       "1",
                       "5",
                       "1",
                       "3",
                       "--world-size",
                       "6",
                       "--global-batch-size",
                       "24",
                       "--micro-batch-size-per-dp",
                       "2",
                       "4",
                       "1",
                       "2",
                       "--num-micro-batches-per-dp",
                       "1",
                       "3",
                       "2",
                       "2"});
  EXPECT_EQ(validate_error(p, 8), "");
  ASSERT_EQ(p.pipelines.size(), 3u);
  const std::vector<int64_t> mbs = {4, 4, 2}, nmb = {3, 2, 2};
  for (int d = 0; d < 3; ++d) {
    const auto& pl = p.pipelines[static_cast<size_t>(d)];
    EXPECT_EQ(pl.micro_batch_size, mbs[static_cast<size_t>(d)]) << d;
    EXPECT_EQ(pl.num_micro_batches, nmb[static_cast<size_t>(d)]) << d;
    ASSERT_EQ(pl.stages.size(), 2u);
    EXPECT_EQ(pl.stages[0].ranks, std::vector<int>{2 * d});
    EXPECT_EQ(pl.stages[1].ranks, std::vector<int>{2 * d + 1});
    EXPECT_EQ(pl.stages[0].layer_end, 5);
    EXPECT_EQ(pl.stages[1].layer_begin, 5);
    EXPECT_EQ(pl.stages[1].layer_end, 8);
  }
  EXPECT_EQ(p.locate(5).pipeline, 2);
  EXPECT_EQ(p.locate(5).stage, 1);
  EXPECT_EQ(p.world_size(), 6);
}

TEST(SynerFuse, OnlyMicroBatchSizesGivesEqualCounts) {
  Plan p =
      from_flags({"--num-layers", "4", "--global-batch-size", "32", "--micro-batch-size-per-dp", "1", "6", "1", "2"});
  ASSERT_EQ(p.pipelines.size(), 2u);
  EXPECT_EQ(p.pipelines[0].num_micro_batches, 4);
  EXPECT_EQ(p.pipelines[1].num_micro_batches, 4);
  std::string e =
      flags_error({"--num-layers", "4", "--global-batch-size", "30", "--micro-batch-size-per-dp", "1", "6", "1", "2"});
  EXPECT_HAS(e, "--global-batch-size 30 is not a multiple of the sum of n_i x mbs_i = 1x6 + 1x2 = 8");
}

TEST(SynerFuse, UniformFallbackUsesMicroBatchSize) {
  Plan p = from_flags({"--num-layers", "9", "--pipeline-model-parallel-size", "3", "--data-parallel-size", "2",
                       "--global-batch-size", "16", "--micro-batch-size", "2"});
  ASSERT_EQ(p.pipelines.size(), 2u);
  for (const auto& pl : p.pipelines) {
    EXPECT_EQ(pl.micro_batch_size, 2);
    EXPECT_EQ(pl.num_micro_batches, 4);
    ASSERT_EQ(pl.stages.size(), 3u);
    EXPECT_EQ(pl.stages[1].layer_begin, 3);
    EXPECT_EQ(pl.stages[1].layer_end, 6);
  }
  // Megatron's default order tp-dp-pp: stage s of pipeline d is rank s * dp + d.
  EXPECT_EQ(p.pipelines[1].stages[0].ranks, std::vector<int>{1});
  EXPECT_EQ(p.pipelines[0].stages[2].ranks, std::vector<int>{4});
  // --use-tp-pp-dp-mapping: consecutive ranks form a pipeline.
  Plan q = from_flags({"--num-layers", "9", "--pipeline-model-parallel-size", "3", "--data-parallel-size", "2",
                       "--global-batch-size", "16", "--micro-batch-size", "2", "--use-tp-pp-dp-mapping"});
  EXPECT_EQ(q.pipelines[1].stages[0].ranks, std::vector<int>{3});
  EXPECT_EQ(q.pipelines[0].stages[2].ranks, std::vector<int>{2});
  EXPECT_HAS(flags_error({"--num-layers", "9", "--pipeline-model-parallel-size", "3", "--data-parallel-size", "2",
                          "--global-batch-size", "10", "--micro-batch-size", "2"}),
             "--global-batch-size 10 is not a multiple of the data-parallel size 2 x --micro-batch-size 2 = 4");
  EXPECT_HAS(flags_error({"--num-layers", "8", "--pipeline-model-parallel-size", "3", "--global-batch-size", "8",
                          "--micro-batch-size", "1"}),
             "--num-layers 8 is not divisible by --pipeline-model-parallel-size 3");
}

TEST(SynerFuse, ScheduleIsPassedThroughAndChecked) {
  SynerFuseArgs a = alloy::parse_synerfuse_args(kReadmeDp);
  a.schedule = "gpipe";
  EXPECT_EQ(alloy::plan_from_synerfuse(a).schedule, "gpipe");
  a.schedule = "zb";
  EXPECT_HAS(sf_error(a), "schedule: must be 1f1b, eager-1f1b, eager-1f1b-2, eager-1f1b-3, eager-1f1b-4, gpipe, zb-h1 or interleaved-1f1b, got 'zb'");
}

TEST(SynerFuse, StageCountsMustSumToPipelineSize) {
  std::string e = flags_error({"--num-layers", "8", "--pipeline-model-parallel-size", "4", "--hetero-pipeline-stages",
                               "1", "6", "1", "2", "--global-batch-size", "8", "--micro-batch-size", "1"});
  EXPECT_HAS(e, "SynerFuse arguments: --hetero-pipeline-stages 1 6 1 2");
  EXPECT_HAS(e, "the stage counts n_i sum to 1 + 1 = 2, but --pipeline-model-parallel-size is 4");
}

TEST(SynerFuse, LayerCountsMustSumToNumLayers) {
  std::string e = flags_error({"--num-layers", "10", "--pipeline-model-parallel-size", "2", "--hetero-pipeline-stages",
                               "1", "6", "1", "2", "--global-batch-size", "8", "--micro-batch-size", "1"});
  EXPECT_HAS(e, "the layer counts sum to 6 + 2 = 8, but --num-layers is 10");
}

TEST(SynerFuse, EveryStageNeedsALayerAndGroupsMustBeComplete) {
  const Args base = {"--num-layers",       "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                     "--micro-batch-size", "1", "--hetero-pipeline-stages"};
  EXPECT_HAS(flags_error(concat(base, {"1", "8", "1", "0"})), "layers_1_0 = 0, but every stage needs at least 1 layer");
  EXPECT_HAS(flags_error(concat(base, {"2", "9", "-1"})), "layers_0_1 = -1");
  EXPECT_HAS(flags_error(concat(base, {"3", "6", "2"})), "n0 = 3 stages, but only 2 values follow it");
  EXPECT_HAS(flags_error(concat(base, {"1", "6", "2", "1"})), "n1 = 2 stages, but only 1 value follows it");
  EXPECT_HAS(flags_error(concat(base, {"0", "1", "8"})), "n0 = 0, but a group needs at least 1 stage");
  // Two devices in one group: "2 4 4" is a valid split of 8 layers over pp 2.
  Plan p = from_flags(concat(base, {"2", "4", "4"}));
  EXPECT_EQ(p.pipelines[0].stages[1].layer_begin, 4);
}

TEST(SynerFuse, DataParallelGroupsMustSumToDataParallelSize) {
  std::string e = flags_error({"--num-layers", "8", "--pipeline-model-parallel-size", "2", "--world-size", "6",
                               "--global-batch-size", "32", "--micro-batch-size-per-dp", "1", "6", "1", "2"});
  EXPECT_HAS(e,
             "--micro-batch-size-per-dp 1 6 1 2: the group sizes n_i sum to 1 + 1 = 2, but the data-parallel size is 3 "
             "(world size 6 / --pipeline-model-parallel-size 2)");
  e = flags_error({"--num-layers", "4", "--data-parallel-size", "3", "--global-batch-size", "32",
                   "--micro-batch-size-per-dp", "1", "6", "1", "2", "--num-micro-batches-per-dp", "1", "4", "2", "4"});
  EXPECT_HAS(e,
             "--micro-batch-size-per-dp 1 6 1 2: the group sizes n_i sum to 1 + 1 = 2, but the data-parallel size is 3 "
             "(--data-parallel-size)");
  // Without a stated size the first list fixes it, and the second must agree.
  e = flags_error({"--num-layers", "4", "--global-batch-size", "32", "--micro-batch-size-per-dp", "1", "6", "1", "2",
                   "--num-micro-batches-per-dp", "3", "4"});
  EXPECT_HAS(e,
             "--num-micro-batches-per-dp 3 4: the group sizes n_i sum to 3 = 3, but the data-parallel size is 2 "
             "(the group sizes of --micro-batch-size-per-dp)");
}

TEST(SynerFuse, GlobalBatchMustEqualTheSumAndShowsTheArithmetic) {
  Args argv = kReadmeDp;
  argv[3] = "30";
  EXPECT_HAS(flags_error(argv), "--global-batch-size 30 != sum of n_i x mbs_i x nmb_i = 1x6x4 + 1x2x4 = 32");
}

TEST(SynerFuse, GroupListsMustBePairsOfPositiveNumbers) {
  const Args base = {"--num-layers", "4", "--global-batch-size", "32"};
  EXPECT_HAS(flags_error(concat(base, {"--micro-batch-size-per-dp", "1", "6", "1"})),
             "--micro-batch-size-per-dp 1 6 1: 3 values, but it takes pairs n0 mbs0 n1 mbs1 ...");
  EXPECT_HAS(flags_error(concat(base, {"--micro-batch-size-per-dp", "2", "16", "--num-micro-batches-per-dp", "2"})),
             "--num-micro-batches-per-dp 2: 1 value, but it takes pairs n0 nmb0 n1 nmb1 ...");
  EXPECT_HAS(flags_error(concat(base, {"--micro-batch-size-per-dp", "1", "0", "1", "32"})),
             "mbs0 = 0, but it must be >= 1");
  EXPECT_HAS(flags_error(concat(base, {"--micro-batch-size-per-dp", "-1", "6"})),
             "n0 = -1, but a group needs at least 1");
  EXPECT_HAS(
      flags_error(concat(base, {"--micro-batch-size-per-dp", "2", "16", "--num-micro-batches-per-dp", "2", "-3"})),
      "nmb0 = -3, but it must be >= 1");
}

TEST(SynerFuse, ScalarsMustBePositive) {
  SynerFuseArgs a = alloy::parse_synerfuse_args(kReadmeDp);
  SynerFuseArgs b = a;
  b.num_layers = 0;
  EXPECT_HAS(sf_error(b), "--num-layers must be >= 1, got 0");
  b = a;
  b.global_batch_size = -4;
  EXPECT_HAS(sf_error(b), "--global-batch-size must be >= 1, got -4");
  b = a;
  b.pipeline_model_parallel_size = 0;
  EXPECT_HAS(sf_error(b), "--pipeline-model-parallel-size must be >= 1, got 0");
  b = a;
  b.data_parallel_size = -2;
  EXPECT_HAS(sf_error(b), "--data-parallel-size must be >= 1 (or 0 to derive it), got -2");
  b = a;
  b.world_size = -1;
  EXPECT_HAS(sf_error(b), "world size must be >= 1 (or 0 to derive it), got -1");
  EXPECT_HAS(flags_error({"--num-layers", "4", "--global-batch-size", "8"}),
             "--micro-batch-size must be >= 1, got 0 (or give --micro-batch-size-per-dp)");
}

TEST(SynerFuse, TensorParallelGroupsAreConsecutiveRanksPerStage) {
  // TP innermost in both of Megatron's orders: 2 pipelines x 2 stages x TP 2 = 8 ranks.
  SynerFuseArgs a = alloy::parse_synerfuse_args({"--num-layers", "8", "--pipeline-model-parallel-size", "2",
                                                 "--tensor-model-parallel-size", "2", "--tp-split", "3", "1",
                                                 "--hetero-pipeline-stages", "1", "5", "1", "3", "--global-batch-size", "16",
                                                 "--micro-batch-size", "2", "--world-size", "8"});
  a.num_attention_heads = 4;
  Plan p = alloy::plan_from_synerfuse(a);
  ASSERT_EQ(p.pipelines.size(), 2u);
  // tp-dp-pp (Megatron's default, SynerFuse's run.sh): ranks 0-3 are stage 0 of both pipelines.
  EXPECT_EQ(p.pipelines[0].stages[0].ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(p.pipelines[1].stages[0].ranks, (std::vector<int>{2, 3}));
  EXPECT_EQ(p.pipelines[0].stages[1].ranks, (std::vector<int>{4, 5}));
  EXPECT_EQ(p.pipelines[1].stages[1].ranks, (std::vector<int>{6, 7}));
  // tp-pp-dp: each pipeline on consecutive ranks.
  a.tp_pp_dp_mapping = true;
  p = alloy::plan_from_synerfuse(a);
  EXPECT_EQ(p.pipelines[0].stages[1].ranks, (std::vector<int>{2, 3}));
  EXPECT_EQ(p.pipelines[1].stages[0].ranks, (std::vector<int>{4, 5}));
  EXPECT_EQ(p.pipelines[1].stages[1].ranks, (std::vector<int>{6, 7}));
  a.tp_pp_dp_mapping = false;
  EXPECT_EQ(p.pipelines[0].stages[1].tp_split, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(p.pipelines[0].stages[1].layer_begin, 5);
  EXPECT_EQ(p.world_size(), 8);
  a.world_size = 6;
  EXPECT_HAS(sf_error(a), "world size 6 is not a multiple of --pipeline-model-parallel-size 2 x --tensor-model-parallel-size 2");
  a.world_size = 8;
  a.tp_split = {3, 1, 1};
  EXPECT_HAS(sf_error(a), "--tp-split 3 1 1 gives 3 ranks' heads, but --tensor-model-parallel-size is 2");
  a.tp_split = {2, 1};
  EXPECT_HAS(sf_error(a), "heads 2 1 sum to 3, the model has 4");
  a.tensor_model_parallel_size = 0;
  EXPECT_HAS(sf_error(a), "--tensor-model-parallel-size must be >= 1, got 0");
}

TEST(SynerFuse, WorldSizeMustMatch) {
  Args argv = concat(kReadmeDp, {"--world-size", "3"});
  EXPECT_HAS(flags_error(argv), "the group sizes n_i sum to 1 + 1 = 2, but the data-parallel size is 3 (world size 3");
  argv = concat(kReadmeDp, {"--world-size", "3", "--data-parallel-size", "2"});
  EXPECT_HAS(
      flags_error(argv),
      "world size 3 != --pipeline-model-parallel-size 1 x data-parallel size 2 x --tensor-model-parallel-size 1 = 2");
  EXPECT_HAS(flags_error({"--num-layers", "8", "--pipeline-model-parallel-size", "2", "--world-size", "5",
                          "--global-batch-size", "8", "--micro-batch-size", "1"}),
             "world size 5 is not a multiple of --pipeline-model-parallel-size 2");
  EXPECT_EQ(flags_error(concat(kReadmeDp, {"--world-size", "2"})), "");
}

TEST(SynerFuseArgs, ParsesEveryFlagAndBothSpellings) {
  SynerFuseArgs a = alloy::parse_synerfuse_args({"--num-layers=8",
                                                 "--pipeline-model-parallel-size",
                                                 "2",
                                                 "--tensor-model-parallel-size",
                                                 "1",
                                                 "--global-batch-size",
                                                 "32",
                                                 "--micro-batch-size",
                                                 "4",
                                                 "--data-parallel-size",
                                                 "2",
                                                 "--world-size",
                                                 "4",
                                                 "--hetero-pipeline-stages=1",
                                                 "6",
                                                 "1",
                                                 "2",
                                                 "--micro-batch-size-per-dp",
                                                 "1",
                                                 "6",
                                                 "1",
                                                 "2",
                                                 "--use-tp-pp-dp-mapping",
                                                 "--num-micro-batches-per-dp",
                                                 "2",
                                                 "4"});
  EXPECT_EQ(a.num_layers, 8);
  EXPECT_EQ(a.pipeline_model_parallel_size, 2);
  EXPECT_EQ(a.tensor_model_parallel_size, 1);
  EXPECT_EQ(a.global_batch_size, 32);
  EXPECT_EQ(a.micro_batch_size, 4);
  EXPECT_EQ(a.data_parallel_size, 2);
  EXPECT_EQ(a.world_size, 4);
  EXPECT_EQ(a.hetero_pipeline_stages, (std::vector<int64_t>{1, 6, 1, 2}));
  EXPECT_EQ(a.micro_batch_size_per_dp, (std::vector<int64_t>{1, 6, 1, 2}));
  EXPECT_EQ(a.num_micro_batches_per_dp, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(a.schedule, "1f1b");
  // A repeated flag keeps its last value, as argparse does.
  EXPECT_EQ(alloy::parse_synerfuse_args({"--num-layers", "4", "--num-layers", "6"}).num_layers, 6);
  // Negative numbers are values, not flags, so the range check can name them.
  EXPECT_EQ(alloy::parse_synerfuse_args({"--micro-batch-size-per-dp", "-1", "2"}).micro_batch_size_per_dp,
            (std::vector<int64_t>{-1, 2}));
  EXPECT_TRUE(alloy::parse_synerfuse_args({}).hetero_pipeline_stages.empty());
}

TEST(SynerFuseArgs, BadTokensAreNamed) {
  auto error_of = [](const Args& argv) -> std::string {
    try {
      alloy::parse_synerfuse_args(argv);
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  std::string e = error_of({"--num-layers", "8", "--hidden-sizes", "1024"});
  EXPECT_HAS(e, "unknown flag '--hidden-sizes'");
  EXPECT_HAS(e, "--hetero-pipeline-stages");  // lists what it does read
  // run.sh's model and training flags are skipped with their values, named, and the heads kept.
  std::vector<std::string> ignored;
  SynerFuseArgs r = alloy::parse_synerfuse_args({"--num-layers", "8", "--hidden-size", "1024", "--swiglu", "--lr=3e-4",
                                                 "--num-attention-heads", "16", "--pipeline-model-parallel-size", "2"},
                                                &ignored);
  EXPECT_EQ(r.pipeline_model_parallel_size, 2);
  EXPECT_EQ(r.num_attention_heads, 16);
  EXPECT_EQ(ignored, (std::vector<std::string>{"--hidden-size", "--swiglu", "--lr"}));
  EXPECT_HAS(error_of({"--hidden-size"}), "--hidden-size needs a value");
  EXPECT_HAS(error_of({"--num-layers", "8", "9"}), "unexpected value '9'");
  EXPECT_HAS(error_of({"8"}), "unexpected value '8'");
  EXPECT_HAS(error_of({"--num-layers", "eight"}), "--num-layers: expected an integer, got 'eight'");
  EXPECT_HAS(error_of({"--num-layers", "8x"}), "--num-layers: expected an integer, got '8x'");
  EXPECT_HAS(error_of({"--num-layers="}), "--num-layers: expected an integer, got ''");
  EXPECT_HAS(error_of({"--hetero-pipeline-stages", "1", "6.5"}),
             "--hetero-pipeline-stages: expected an integer, got '6.5'");
  EXPECT_HAS(error_of({"--global-batch-size", "99999999999999999999"}), "'99999999999999999999' is out of range");
  EXPECT_HAS(error_of({"--num-layers"}), "--num-layers needs a value");
  EXPECT_HAS(error_of({"--num-layers", "--global-batch-size", "8"}), "--num-layers needs a value");
  EXPECT_HAS(error_of({"--hetero-pipeline-stages", "--num-layers", "8"}),
             "--hetero-pipeline-stages needs at least one value");
  EXPECT_HAS(error_of({"--use-tp-pp-dp-mapping=1"}), "--use-tp-pp-dp-mapping takes no value");
}

// Random SynerFuse inputs that satisfy every documented constraint, spelled as flags; the
// converter must accept them and produce exactly the pipeline-major layout the header promises.
RC_GTEST_PROP(SynerFuseProperty, ValidInputsAlwaysGiveValidPlans, ()) {
  // Pipeline split: groups of n stages, each with its own layer count.
  const auto stage_groups = *rc::gen::resize(
      4, rc::gen::nonEmpty(rc::gen::container<std::vector<std::vector<int64_t>>>(rc::gen::resize(
             3, rc::gen::nonEmpty(rc::gen::container<std::vector<int64_t>>(rc::gen::inRange<int64_t>(1, 6)))))));
  std::vector<int64_t> layers;
  Args hetero;
  for (const auto& g : stage_groups) {
    hetero.push_back(std::to_string(g.size()));
    for (int64_t l : g) {
      layers.push_back(l);
      hetero.push_back(std::to_string(l));
    }
  }
  const int64_t pp = static_cast<int64_t>(layers.size());
  int64_t num_layers = 0;
  for (int64_t l : layers) num_layers += l;

  // Per data-parallel index values, then a random grouping of equal neighbours for each list.
  const int64_t dp = *rc::gen::inRange<int64_t>(1, 7);
  // Few distinct values, so that neighbours are often equal and some get grouped.
  const auto per_dp = [&](int64_t hi) {
    return *rc::gen::container<std::vector<int64_t>>(static_cast<size_t>(dp), rc::gen::inRange<int64_t>(1, hi));
  };
  const auto grouped = [](const std::vector<int64_t>& v) {
    Args out;
    size_t i = 0;
    while (i < v.size()) {
      size_t j = i + 1;
      while (j < v.size() && v[j] == v[i] && *rc::gen::arbitrary<bool>()) ++j;
      out.push_back(std::to_string(j - i));
      out.push_back(std::to_string(v[i]));
      i = j;
    }
    return out;
  };
  const bool mbs_list = *rc::gen::arbitrary<bool>();
  const bool nmb_list = *rc::gen::arbitrary<bool>();
  const int64_t uniform_mbs = *rc::gen::inRange<int64_t>(1, 5);
  std::vector<int64_t> mbs = mbs_list ? per_dp(3) : std::vector<int64_t>(static_cast<size_t>(dp), uniform_mbs);
  // Without a count list SynerFuse gives every index the same count, so generate it that way.
  std::vector<int64_t> nmb =
      nmb_list ? per_dp(3) : std::vector<int64_t>(static_cast<size_t>(dp), *rc::gen::inRange<int64_t>(1, 5));
  int64_t global = 0;
  for (int64_t d = 0; d < dp; ++d) global += mbs[static_cast<size_t>(d)] * nmb[static_cast<size_t>(d)];

  Args argv = {"--num-layers", std::to_string(num_layers), "--global-batch-size", std::to_string(global)};
  if (pp > 1 || *rc::gen::arbitrary<bool>())
    argv = concat(argv, {"--pipeline-model-parallel-size", std::to_string(pp)});
  if (stage_groups.size() > 1 || *rc::gen::arbitrary<bool>())
    argv = concat(concat(argv, {"--hetero-pipeline-stages"}), hetero);
  else if (num_layers % pp != 0 || layers != std::vector<int64_t>(static_cast<size_t>(pp), num_layers / pp))
    argv = concat(concat(argv, {"--hetero-pipeline-stages"}), hetero);
  if (mbs_list)
    argv = concat(concat(argv, {"--micro-batch-size-per-dp"}), grouped(mbs));
  else
    argv = concat(argv, {"--micro-batch-size", std::to_string(uniform_mbs)});
  if (nmb_list) argv = concat(concat(argv, {"--num-micro-batches-per-dp"}), grouped(nmb));
  const bool mapping_flag = *rc::gen::arbitrary<bool>();
  if (mapping_flag) argv = concat(argv, {"--use-tp-pp-dp-mapping"});
  // SynerFuse's per-dp lists work only in the tp-pp-dp order; without them or the flag Megatron's
  // default tp-dp-pp applies.
  const bool pipeline_major = mapping_flag || mbs_list || nmb_list;
  // How the data-parallel size is known: stated, through the world size, or from the lists.
  const int how = *rc::gen::inRange(0, 3);
  if (how == 0 || (!mbs_list && !nmb_list && dp > 1))
    argv = concat(argv, {"--data-parallel-size", std::to_string(dp)});
  else if (how == 1)
    argv = concat(argv, {"--world-size", std::to_string(pp * dp)});
  RC_TAG(mbs_list, nmb_list);

  Plan p = from_flags(argv);  // validates against num_layers itself
  RC_ASSERT(validate_error(p, num_layers) == "");
  RC_ASSERT(p.global_batch == global);
  RC_ASSERT(p.world_size() == pp * dp);
  RC_ASSERT(p.pipelines.size() == static_cast<size_t>(dp));
  for (int64_t d = 0; d < dp; ++d) {
    const auto& pl = p.pipelines[static_cast<size_t>(d)];
    RC_ASSERT(pl.micro_batch_size == mbs[static_cast<size_t>(d)]);
    RC_ASSERT(pl.num_micro_batches == nmb[static_cast<size_t>(d)]);
    RC_ASSERT(pl.stages.size() == static_cast<size_t>(pp));
    int64_t begin = 0;
    for (int64_t s = 0; s < pp; ++s) {
      const auto& st = pl.stages[static_cast<size_t>(s)];
      RC_ASSERT(st.ranks == std::vector<int>{static_cast<int>(pipeline_major ? d * pp + s : s * dp + d)});
      RC_ASSERT(st.layer_begin == begin);
      RC_ASSERT(st.layer_end == begin + layers[static_cast<size_t>(s)]);
      begin = st.layer_end;
    }
  }
  // Any other global batch is refused when the counts are given explicitly.
  if (nmb_list) {
    Args wrong = argv;
    wrong[3] = std::to_string(global + 1);
    RC_ASSERT(flags_error(wrong).find("--global-batch-size " + std::to_string(global + 1) + " != ") !=
              std::string::npos);
  }
}

// ---- HeteroShard ----------------------------------------------------------------------------

namespace {

// A Mac coordinator, an NVIDIA box with two GPUs (workers 1 and 2) and an AMD box ("amd"); the
// shard_plan uses the AMD box before worker 1 and leaves worker 2 idle.
const char* kConfig = R"({
  "version": "0.1.0",
  "coordinator": {"hostname": "mac-studio", "ip": "10.0.0.1", "device": "mps"},
  "workers": [
    {"id": 1, "hostname": "rtx-box", "ip": "10.0.0.2", "port": 9999, "device": "cuda", "num_gpus": 1},
    {"id": 2, "hostname": "rtx-box", "ip": "10.0.0.2", "port": 10000, "device": "cuda", "num_gpus": 1},
    {"id": "amd", "hostname": "mi-box", "ip": "10.0.0.3", "port": 9999, "device": "auto"}
  ],
  "training": {"visualize": true, "visualization_format": "png", "log_level": "INFO"},
  "shard_plan": [
    {"id": "local", "start": 0, "end": 10},
    {"id": "amd", "start": 10, "end": 16},
    {"id": 1, "start": 16, "end": 32, "is_last": true}
  ],
  "checkpoint_dir": "./ckpt", "resume_step": 20
})";

std::string hc_error(const json& j, int64_t layers = 32, int64_t global = 16, int64_t micro = 4) {
  try {
    alloy::plan_from_hetero_config(j, layers, global, micro, "hetero_config.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

// kConfig with shard_plan replaced.
json with_shards(const json& shards) {
  json j = json::parse(kConfig);
  j["shard_plan"] = shards;
  return j;
}

}  // namespace

TEST(HeteroShard, ValidFileBecomesOnePipelineInShardPlanOrder) {
  TempDir t;
  std::string path = t.write("hetero_config.json", kConfig);
  Plan p = alloy::plan_from_hetero_config_file(path, 32, 16, 4);
  EXPECT_EQ(validate_error(p, 32), "");
  EXPECT_EQ(p.global_batch, 16);
  ASSERT_EQ(p.pipelines.size(), 1u);
  const auto& pl = p.pipelines[0];
  EXPECT_EQ(pl.micro_batch_size, 4);
  EXPECT_EQ(pl.num_micro_batches, 4);
  ASSERT_EQ(pl.stages.size(), 3u);
  EXPECT_EQ(pl.stages[0].ranks, std::vector<int>{0});
  EXPECT_EQ(pl.stages[0].device, "mac-studio");
  EXPECT_EQ(pl.stages[0].layer_end, 10);
  EXPECT_EQ(pl.stages[1].ranks, std::vector<int>{1});
  EXPECT_EQ(pl.stages[1].device, "mi-box");
  EXPECT_EQ(pl.stages[1].layer_begin, 10);
  EXPECT_EQ(pl.stages[1].layer_end, 16);
  EXPECT_EQ(pl.stages[2].ranks, std::vector<int>{2});
  EXPECT_EQ(pl.stages[2].device, "rtx-box");
  EXPECT_EQ(pl.stages[2].layer_end, 32);
  EXPECT_EQ(p.world_size(), 3);  // worker 2 is listed but holds no stage
}

TEST(HeteroShard, FormatsExampleAndInferredLayerCount) {
  json j = json::parse(R"({"coordinator": {"hostname": "a"}, "workers": [{"id": 1, "hostname": "b"}],
      "shard_plan": [{"id": "local", "start": 0, "end": 16}, {"id": 1, "start": 16, "end": 32, "is_last": true}]})");
  Plan p = alloy::plan_from_hetero_config(j, 0, 8, 8, "x");  // 0 layers: take the shard_plan's
  EXPECT_EQ(p.pipelines[0].stages.back().layer_end, 32);
  EXPECT_EQ(p.pipelines[0].num_micro_batches, 1);
  EXPECT_EQ(validate_error(p, 32), "");
}

TEST(HeteroShard, StringAndNumberIdsMatchAndHostnamesAreOptional) {
  json j = json::parse(R"({"workers": [{"id": 7}],
      "shard_plan": [{"id": "local", "start": 0, "end": 3}, {"id": "7", "start": 3, "end": 4, "is_last": true}]})");
  Plan p = alloy::plan_from_hetero_config(j, 4, 4, 2, "x");
  EXPECT_EQ(p.pipelines[0].stages[0].device, "");
  EXPECT_EQ(p.pipelines[0].stages[1].device, "");
  // The coordinator alone is a one-stage plan.
  json solo = json::parse(R"({"shard_plan": [{"id": "local", "start": 0, "end": 4, "is_last": true}]})");
  EXPECT_EQ(alloy::plan_from_hetero_config(solo, 4, 4, 2, "x").world_size(), 1);
}

TEST(HeteroShard, OverlapNamesFileFieldAndValues) {
  json j = with_shards(
      json::parse(R"([{"id": "local", "start": 0, "end": 16}, {"id": 1, "start": 12, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "hetero_config.json: shard_plan[1].start: 12, but the previous stage ended at 16 (overlap)");
}

TEST(HeteroShard, GapNamesTheMissingBlocks) {
  json j = with_shards(json::parse(R"([{"id": "local", "start": 0, "end": 10}, {"id": "amd", "start": 12, "end": 16},
                                        {"id": 1, "start": 16, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j),
             "hetero_config.json: shard_plan[1].start: 12, but the previous stage ended at 10 (gap: blocks [10, 12)");
  j = with_shards(json::parse(R"([{"id": "local", "start": 2, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[0].start: 2, but the first stage must start at block 0");
}

TEST(HeteroShard, RangesMustBeNonEmptyAndCoverTheModel) {
  json j = with_shards(
      json::parse(R"([{"id": "local", "start": 0, "end": 16}, {"id": 1, "start": 16, "end": 16, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[1].end: 16, but start is 16: the range [start, end) is empty");
  j = with_shards(
      json::parse(R"([{"id": "local", "start": 0, "end": 16}, {"id": 1, "start": 16, "end": 30, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[1].end: 30, but the model has 32 blocks; the stages must cover [0, 32)");
  EXPECT_HAS(hc_error(json::parse(kConfig), 40), "shard_plan[2].end: 32, but the model has 40 blocks");
}

TEST(HeteroShard, IsLastMustBeExactlyTheFinalEntry) {
  json j = with_shards(json::parse(R"([{"id": "local", "start": 0, "end": 16}, {"id": 1, "start": 16, "end": 32}])"));
  EXPECT_HAS(hc_error(j),
             "hetero_config.json: shard_plan: no stage has \"is_last\": true; the final entry, shard_plan[1], must");
  j = with_shards(json::parse(
      R"([{"id": "local", "start": 0, "end": 16, "is_last": true}, {"id": 1, "start": 16, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan: 2 stages have \"is_last\": true (shard_plan[0], shard_plan[1]); exactly one");
  j = with_shards(json::parse(
      R"([{"id": "local", "start": 0, "end": 16, "is_last": true}, {"id": 1, "start": 16, "end": 32, "is_last": false}])"));
  EXPECT_HAS(hc_error(j),
             "shard_plan[0].is_last: true, but it is not the final entry; the final entry is shard_plan[1]");
  j = with_shards(json::parse(R"([{"id": "local", "start": 0, "end": 32, "is_last": "yes"}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[0].is_last: must be true or false, got \"yes\"");
}

TEST(HeteroShard, IdsMustNameTheCoordinatorThenKnownWorkers) {
  json j = with_shards(
      json::parse(R"([{"id": "local", "start": 0, "end": 16}, {"id": 3, "start": 16, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j),
             "hetero_config.json: shard_plan[1].id: 3 matches no worker in \"workers\" (ids: 1, 2, \"amd\")");
  j = with_shards(
      json::parse(R"([{"id": 1, "start": 0, "end": 16}, {"id": 2, "start": 16, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[0].id: 1, but the first stage must be the coordinator's, \"local\"");
  j = with_shards(json::parse(
      R"([{"id": "local", "start": 0, "end": 16}, {"id": "local", "start": 16, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[1].id: \"local\" again");
  j = with_shards(json::parse(R"([{"id": "local", "start": 0, "end": 8}, {"id": 1, "start": 8, "end": 16},
                                  {"id": 1, "start": 16, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[2].id: worker 1 already holds shard_plan[1]");
  j = with_shards(json::parse(R"([{"start": 0, "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[0].id: is missing");
  json no_workers = json::parse(
      R"({"shard_plan": [{"id": "local", "start": 0, "end": 16}, {"id": 1, "start": 16, "end": 32, "is_last": true}]})");
  EXPECT_HAS(hc_error(no_workers),
             "shard_plan[1].id: 1 matches no worker in \"workers\" (the list is empty or missing)");
  json dup = json::parse(kConfig);
  dup["workers"][2]["id"] = 1;
  EXPECT_HAS(hc_error(dup), "workers[2].id: 1 is also the id of workers[0]");
}

TEST(HeteroShard, MalformedEntriesAreNamed) {
  json j = with_shards(json::parse(R"([{"id": "local", "start": 0, "end": 16.5, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[0].end: must be an integer block index, got 16.5");
  j = with_shards(json::parse(R"([{"id": "local", "end": 32, "is_last": true}])"));
  EXPECT_HAS(hc_error(j), "shard_plan[0].start: is missing");
  EXPECT_HAS(hc_error(with_shards(json::array())), "shard_plan: must be a non-empty array");
  EXPECT_HAS(hc_error(with_shards(json::parse("[[0, 32]]"))), "shard_plan[0]: must be an object");
  json j2 = json::parse(kConfig);
  j2.erase("shard_plan");
  EXPECT_HAS(hc_error(j2), "hetero_config.json: shard_plan: is missing");
  EXPECT_HAS(hc_error(json::array()), "expected a JSON object");
}

TEST(HeteroShard, BatchMustSplitIntoWholeMicroBatches) {
  EXPECT_HAS(hc_error(json::parse(kConfig), 32, 10, 4), "global batch 10 is not a multiple of micro-batch size 4");
  EXPECT_HAS(hc_error(json::parse(kConfig), 32, 8, 0), "micro-batch size must be >= 1, got 0");
}

TEST(HeteroShard, FileErrorsNameThePath) {
  TempDir t;
  std::string bad = t.write("broken.json", "{\"shard_plan\": [");
  try {
    alloy::plan_from_hetero_config_file(bad, 32, 16, 4);
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), bad + ": not valid JSON");
  }
  std::string overlap = t.write(
      "hetero_config.json",
      with_shards(
          json::parse(
              R"([{"id": "local", "start": 0, "end": 16}, {"id": 1, "start": 12, "end": 32, "is_last": true}])"))
          .dump());
  try {
    alloy::plan_from_hetero_config_file(overlap, 32, 16, 4);
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), overlap + ": shard_plan[1].start: 12");
  }
  EXPECT_THROW(alloy::plan_from_hetero_config_file(t.write("x", "") + ".absent", 32, 16, 4), InputError);
}

// training.log_level takes Python's level names; the run then drops what is below it (progress
// lines are info). A level Python's logging does not name is refused by its field.
TEST(HeteroShard, LogLevelSetsWhatTheRunPrints) {
  EXPECT_EQ(alloy::hetero_run_settings(json::parse(kConfig), "h.json").log_level, "INFO");
  json j = json::parse(kConfig);
  j["training"]["log_level"] = "LOUD";
  try {
    alloy::hetero_run_settings(j, "h.json");
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), "h.json: training.log_level: 'LOUD' is not one of DEBUG, INFO, WARNING");
  }
  EXPECT_EQ(alloy::parse_log_level("WARNING"), alloy::LogLevel::Warning);
  EXPECT_EQ(alloy::parse_log_level("critical"), alloy::LogLevel::Error);
  EXPECT_THROW(alloy::parse_log_level("verbose"), std::invalid_argument);
  // On any side of the subcommand, not after "--" (another command's line).
  std::vector<std::string> line = {"alloy", "launch", "--log-level", "warning", "--nproc", "2", "--", "alloy", "train", "--log-level", "debug"};
  std::vector<char*> args;
  for (auto& a : line) args.push_back(a.data());
  EXPECT_EQ(alloy::take_log_level_option(&args), "warning");
  std::vector<std::string> left(args.begin(), args.end());
  EXPECT_EQ(left, (std::vector<std::string>{"alloy", "launch", "--nproc", "2", "--", "alloy", "train", "--log-level", "debug"}));
  std::vector<std::string> eq = {"alloy", "train", "--log-level=error", "-c", "x.yaml"};
  args.clear();
  for (auto& a : eq) args.push_back(a.data());
  EXPECT_EQ(alloy::take_log_level_option(&args), "error");
  EXPECT_EQ(args.size(), 4u);

  const alloy::LogLevel before = alloy::log_level();
  auto printed = [](alloy::LogLevel level) {
    alloy::set_log_level(level);
    ::testing::internal::CaptureStderr();
    alloy::log_info("an info line");
    alloy::log_warn("a warning line");
    alloy::log_error("an error line");
    alloy::Progress p("a progress line", 1, true);
    p.update(1);
    p.finish();
    return ::testing::internal::GetCapturedStderr();
  };
  const std::string info = printed(alloy::LogLevel::Info), warning = printed(alloy::LogLevel::Warning),
                    error = printed(alloy::LogLevel::Error);
  alloy::set_log_level(before);
  for (const char* line : {"an info line", "a warning line", "an error line", "a progress line"}) EXPECT_HAS(info, line);
  EXPECT_EQ(warning.find("an info line"), std::string::npos);
  EXPECT_EQ(warning.find("a progress line"), std::string::npos);
  EXPECT_HAS(warning, "a warning line");
  EXPECT_EQ(error.find("a warning line"), std::string::npos);
  EXPECT_HAS(error, "an error line");
}

// SynerFuse's run.sh also holds the switches `alloy train` reads itself (precision, the distributed
// optimizer, sequence parallelism): a pasted argument list converts; the plan records sequence
// parallelism on its tensor-parallel stages and names the others as not its business.
TEST(SynerFuseArgs, RunShTrainingSwitchesConvert) {
  std::vector<std::string> ignored;
  SynerFuseArgs a = alloy::parse_synerfuse_args({"--num-layers", "4", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                                                 "2", "--global-batch-size", "8", "--micro-batch-size", "2", "--bf16",
                                                 "--use-distributed-optimizer", "--sequence-parallel", "--grad-reduce-in-bf16"},
                                                &ignored);
  EXPECT_TRUE(a.sequence_parallel);
  EXPECT_EQ(ignored, (std::vector<std::string>{"--bf16", "--use-distributed-optimizer", "--grad-reduce-in-bf16"}));
  a.num_attention_heads = 4;
  Plan p = alloy::plan_from_synerfuse(a);
  for (const auto& pl : p.pipelines)
    for (const auto& st : pl.stages) EXPECT_TRUE(st.sequence_parallel);
  a.sequence_parallel = false;
  p = alloy::plan_from_synerfuse(a);
  EXPECT_FALSE(p.pipelines[0].stages[0].sequence_parallel);
  try {
    alloy::parse_synerfuse_args({"--fp16=1"});
    ADD_FAILURE() << "a switch took a value";
  } catch (const InputError& e) {
    EXPECT_HAS(std::string(e.what()), "--fp16 takes no value");
  }
}

// Megatron's interleaved schedule: 8 layers on 2 stages in chunks of 2, so each rank holds two
// chunks (layers 0-1 and 4-5 on rank 0), on interleaved-1f1b; its constraints named by the flag.
TEST(SynerFuse, VirtualPipelineStagesInterleaveEachPipeline) {
  const Args base = {"--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                     "--micro-batch-size", "2", "--data-parallel-size", "2"};
  const Plan p = from_flags(concat(base, {"--num-layers-per-virtual-pipeline-stage", "2"}));
  EXPECT_EQ(p.schedule, "interleaved-1f1b");
  ASSERT_EQ(p.pipelines.size(), 2u);
  for (const auto& pl : p.pipelines) {
    EXPECT_EQ(pl.virtual_stages, 2);
    ASSERT_EQ(pl.stages.size(), 4u);
    EXPECT_EQ(pl.num_micro_batches, 4);
    for (size_t c = 0; c < 4; ++c) {
      EXPECT_EQ(pl.stages[c].layer_begin, 2 * static_cast<int64_t>(c));
      EXPECT_EQ(pl.stages[c].ranks, pl.stages[c % 2].ranks);
    }
  }
  EXPECT_EQ(p.world_size(), 4);
  EXPECT_EQ(p.chunks_of(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(validate_error(p, 8), "");
  EXPECT_HAS(flags_error(concat(base, {"--num-layers-per-virtual-pipeline-stage", "3"})),
             "--num-layers-per-virtual-pipeline-stage 3: --num-layers 8 is not a multiple of --pipeline-model-parallel-size 2 x 3");
  EXPECT_HAS(flags_error(concat(base, {"--num-layers-per-virtual-pipeline-stage", "4"})), "make one chunk a stage");
  EXPECT_HAS(flags_error({"--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "6", "--micro-batch-size",
                          "2", "--num-layers-per-virtual-pipeline-stage", "2"}),
             "runs 3 micro-batches, not a multiple of --pipeline-model-parallel-size 2");
  EXPECT_HAS(flags_error({"--num-layers", "8", "--pipeline-model-parallel-size", "2", "--hetero-pipeline-stages", "2", "5", "3",
                          "--global-batch-size", "8", "--micro-batch-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"}),
             "with --hetero-pipeline-stages the stages differ");
}
