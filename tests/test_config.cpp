#include <gtest/gtest.h>

#include "alloy/core/config.h"
#include "alloy/core/error.h"

using alloy::Config;
using alloy::InputError;

namespace {
std::string error_of(const std::string& yaml, std::vector<std::string> sets = {}) {
  try {
    Config::from_yaml_string(yaml, "cfg.yaml", sets);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, LoadsSectionsAndDefaults) {
  Config c = Config::from_yaml_string("model:\n  arch: llama\n  layers: 6\n  hidden: 96\n  heads: 6\n  kv_heads: 2\ntrain:\n  lr: 1e-3\n", "x");
  EXPECT_EQ(c.model.arch, "llama");
  EXPECT_EQ(c.model.layers, 6);
  EXPECT_EQ(c.model.kv_heads_resolved(), 2);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);
  EXPECT_EQ(c.train.global_batch, 8);  // default
  EXPECT_EQ(c.model.ffn_resolved(), 256);  // 8/3*96 = 256, already a multiple of 32
}

TEST(Config, OverridesApplyInOrderAndAreTyped) {
  Config c = Config::from_yaml_string("train:\n  steps: 5\n", "x", {"train.steps=7", "model.arch=llama", "train.steps=9"});
  EXPECT_EQ(c.train.steps, 9);
  EXPECT_EQ(c.model.arch, "llama");
  EXPECT_NE(error_of("", {"train.steps=many"}).find("train.steps' must be a integer, got 'many'"), std::string::npos);
}

TEST(Config, MisspelledKeySuggestsTheRightOne) {
  std::string e = error_of("train:\n  stpes: 5\n");
  EXPECT_NE(e.find("cfg.yaml"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key 'train.stpes'"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'train.steps'"), std::string::npos) << e;
}

TEST(Config, IllTypedValueNamesFileLineAndKey) {
  std::string e = error_of("model:\n  layers: four\n");
  EXPECT_NE(e.find("cfg.yaml (line 2)"), std::string::npos) << e;
  EXPECT_NE(e.find("model.layers"), std::string::npos) << e;
  EXPECT_NE(error_of("model:\n  layers: 2.5\n"), "");
  EXPECT_NE(error_of("output:\n  tensorboard: maybe\n"), "");
  EXPECT_NE(error_of("model:\n  layers: [1, 2]\n").find("single value"), std::string::npos);
}

TEST(Config, UnknownSectionAndBadYaml) {
  EXPECT_NE(error_of("trian:\n  steps: 1\n").find("unknown section 'trian'"), std::string::npos);
  EXPECT_NE(error_of("model: [\n").find("not valid YAML"), std::string::npos);
}

TEST(Config, CrossFieldValidation) {
  EXPECT_NE(error_of("model:\n  hidden: 100\n  heads: 3\n").find("does not divide model.hidden"), std::string::npos);
  EXPECT_NE(error_of("train:\n  global_batch: 10\n  micro_batch: 4\n").find("train.micro_batch"), std::string::npos);
  EXPECT_NE(error_of("model:\n  arch: bert\n").find("gpt2 or llama"), std::string::npos);
  EXPECT_NE(error_of("model:\n  arch: llama\n  heads: 4\n  kv_heads: 3\n").find("model.kv_heads"), std::string::npos);
}

TEST(Config, JsonRoundTripAndDifferences) {
  Config c = Config::from_yaml_string("model:\n  layers: 3\ntrain:\n  lr: 0.00123\ndata:\n  prefix: /tmp/x y\n", "x");
  Config d = Config::from_json(c.to_json(), "json");
  EXPECT_EQ(c.to_json(), d.to_json());
  Config e = Config::from_yaml_string(c.to_yaml(), "yaml");
  EXPECT_EQ(c.to_json(), e.to_json());
  d.model.layers = 5;
  auto diffs = alloy::model_differences(c.model, d.model);
  ASSERT_EQ(diffs.size(), 1u);
  EXPECT_EQ(diffs[0], "model.layers: 3 vs 5");
}

TEST(Config, GradSyncSectionIsCheckedWithAllowedValues) {
  Config c = Config::from_yaml_string("grad_sync:\n  compression: dgc\n  density: 0.001\n  fusion: saf-inter\n", "x");
  EXPECT_EQ(c.grad_sync.compression, "dgc");
  EXPECT_DOUBLE_EQ(c.grad_sync.density, 0.001);
  EXPECT_TRUE(c.is_set("grad_sync.compression"));
  EXPECT_FALSE(c.is_set("grad_sync.scope"));
  EXPECT_TRUE(c.grad_sync.error_feedback);  // default on for every lossy method
  std::string e = error_of("grad_sync:\n  compression: dcg\n");
  EXPECT_NE(e.find("key 'grad_sync.compression': unknown value 'dcg' (did you mean 'dgc'?)"), std::string::npos) << e;
  EXPECT_NE(e.find("allowed: none, fp16, bf16, topk, randomk, dgc, gaussiank, redsync, sidco, oktopk, powersgd"), std::string::npos) << e;
  EXPECT_NE(error_of("", {"grad_sync.density=0"}).find("key 'grad_sync.density': must be in (0, 1]"), std::string::npos);
  EXPECT_NE(error_of("", {"grad_sync.density=1.5"}).find("must be in (0, 1]"), std::string::npos);
  EXPECT_NE(error_of("", {"grad_sync.powersgd_rank=0"}).find("key 'grad_sync.powersgd_rank': must be >= 1"), std::string::npos);
  EXPECT_NE(error_of("", {"grad_sync.compression=dgc", "grad_sync.dense_steps=0"}).find("key 'grad_sync.dense_steps': must be >= 1"),
            std::string::npos);
  EXPECT_EQ(error_of("", {"grad_sync.compression=dgc", "grad_sync.density=1", "grad_sync.dense_steps=0"}), "");
  EXPECT_NE(error_of("", {"grad_sync.fusion=saf-intra"}).find("did you mean 'saf-inter'"), std::string::npos);
  EXPECT_NE(error_of("", {"grad_sync.scope=slow"}).find("allowed: all, slow-links"), std::string::npos);
  EXPECT_EQ(Config::from_yaml_string("", "x").grad_sync.allreduce, "auto");
  EXPECT_NE(error_of("", {"grad_sync.allreduce=rign"}).find("key 'grad_sync.allreduce': unknown value 'rign' (did you mean 'ring'?)"),
            std::string::npos);
  // SAFusion's names map to Alloy's.
  EXPECT_EQ(Config::from_yaml_string("", "x", {"grad_sync.compression=gaussian"}).grad_sync.compression, "gaussiank");
  EXPECT_EQ(Config::from_yaml_string("", "x", {"grad_sync.compression=eftopk"}).grad_sync.compression, "topk");
  EXPECT_EQ(Config::from_yaml_string("", "x", {"grad_sync.fusion=wfbp"}).grad_sync.fusion, "bucket");
  // grad_sync.dtype: reduced-precision exact sync, the casting compression of that name.
  const Config bf = Config::from_yaml_string("grad_sync:\n  dtype: bf16\n", "x");
  EXPECT_EQ(bf.grad_sync.compression, "bf16");
  EXPECT_EQ(Config::from_yaml_string("", "x", {"grad_sync.dtype=fp32"}).grad_sync.compression, "none");
  EXPECT_EQ(error_of("", {"grad_sync.compression=fp16", "grad_sync.dtype=fp16"}), "");
  EXPECT_NE(error_of("", {"grad_sync.dtype=bf16", "grad_sync.compression=dgc"}).find("key 'grad_sync.dtype': bf16 sums exact sync's"),
            std::string::npos);
  EXPECT_NE(error_of("", {"grad_sync.dtype=half"}).find("allowed: fp32, bf16, fp16"), std::string::npos);
}

TEST(Config, AHeteroShardFileGivenAsTheConfigSaysWhereItGoes) {
  const std::string e = error_of("{\"version\": 1, \"shard_plan\": [{\"id\": \"local\"}]}", {});
  EXPECT_NE(e.find("is a HeteroShard hetero_config.json, not an Alloy config: give it as --hetero-config"), std::string::npos) << e;
}
