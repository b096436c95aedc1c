// Fuzz target: HeteroShard's hetero_config.json, read three ways: the layout
// (plan_from_hetero_config_file, `alloy plan --shard-plan`), the run settings
// (hetero_run_settings_file, `alloy train --hetero-config`, whose config overrides are then applied
// to the run's config) and the cluster (plan::import_hetero_config, `alloy cluster import`).
#include "alloy/core/config.h"
#include "alloy/core/plan_convert.h"
#include "alloy/plan/cluster.h"
#include "fuzz_util.h"

using alloy::InputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = alloy_fuzz::TempDir::get().write("hetero_config.json", alloy_fuzz::as_view(data, size));
  // (blocks, global batch, micro-batch): blocks 0 = what the shard_plan covers.
  const int64_t shapes[][3] = {{0, 8, 2}, {32, 16, 4}};
  for (const auto& s : shapes) {
    try {
      alloy::Plan p = alloy::plan_from_hetero_config_file(path, s[0], s[1], s[2]);
      alloy::ModelConfig model;
      model.layers = p.pipelines.at(0).stages.back().layer_end;
      try {
        p.validate(model, path);
      } catch (const InputError& e) {
        alloy_fuzz::check_failed("plan_from_hetero_config_file(...).validate()", __FILE__, __LINE__, e.what());
      }
      (void)p.describe();
    } catch (const InputError& e) {
      alloy_fuzz::rejected(e);
    }
  }
  try {
    alloy::HeteroShardRun r = alloy::hetero_run_settings_file(path);
    alloy::Config cfg;
    try {
      for (const auto& o : r.config_overrides) cfg.apply_override(o);
      cfg.validate();
    } catch (const InputError& e) {
      alloy_fuzz::rejected(e);
    }
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
  }
  try {
    alloy::plan::ClusterSpec spec = alloy::plan::import_hetero_config(path);
    // num_gpus multiplies: a 3 KB file can describe 250,000 devices, whose YAML takes seconds to
    // write and read back (linear, not a bug); the round trip is checked on smaller pools.
    if (spec.devices.size() > 4096) return 0;
    const std::string yaml = spec.to_yaml();
    try {
      (void)alloy::plan::ClusterSpec::from_yaml_string(yaml, "round trip");
    } catch (const InputError& e) {
      alloy_fuzz::check_failed("ClusterSpec::from_yaml_string(spec.to_yaml())", __FILE__, __LINE__,
                               std::string(e.what()) + "\n" + yaml);
    }
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
  }
  return 0;
}
