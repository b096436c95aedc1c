// Fuzz target: the run configuration (Config::from_yaml_string, what `alloy train --config` and
// every other command read) and `--set section.key=value` overrides.
// Input: the YAML text, optionally followed by the part separator and one override per line.
// Beyond "no crash": a config that loads must survive the round trips the program relies on:
// to_json -> from_json (a checkpoint's state.json keeps the config that way) and to_yaml ->
// from_yaml_string (`alloy sweep` writes each cell's config with to_yaml and trains from it).
#include <nlohmann/json.hpp>

#include "alloy/core/config.h"
#include "alloy/core/plan.h"
#include "fuzz_util.h"

using alloy::Config;
using alloy::InputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = alloy_fuzz::split_parts(alloy_fuzz::as_view(data, size), 2);
  std::vector<std::string> overrides;
  if (!parts[1].empty()) {
    size_t pos = 0;
    while (pos <= parts[1].size()) {
      size_t eol = parts[1].find('\n', pos);
      if (eol == std::string::npos) eol = parts[1].size();
      overrides.push_back(parts[1].substr(pos, eol - pos));
      pos = eol + 1;
    }
  }
  Config c;
  try {
    c = Config::from_yaml_string(parts[0], "fuzz.yaml", overrides);
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  // What the rest of the program derives from any config that loads.
  (void)c.model.kv_heads_resolved();
  (void)c.model.ffn_resolved();
  (void)c.model.head_dim();
  (void)c.train.micro_batch_resolved();
  (void)c.train.shard_shares();
  (void)c.lora.target_list(c.model.arch);
  (void)c.grad_sync.local_velocity();
  (void)c.grad_sync.linear_adam();
  alloy::Plan::single_device(c).validate(c.model, "single-device plan");

  const nlohmann::json j = c.to_json();
  try {
    Config back = Config::from_json(j, "round trip through JSON");
    FUZZ_CHECK(back.to_json() == j, "to_json -> from_json changed the config:\n" + j.dump() + "\n" + back.to_json().dump());
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("Config::from_json(c.to_json())", __FILE__, __LINE__, e.what());
  }
  const std::string yaml = c.to_yaml();
  try {
    Config back = Config::from_yaml_string(yaml, "round trip through YAML");
    FUZZ_CHECK(back.to_json() == j, "to_yaml -> from_yaml_string changed the config:\n" + yaml + "\n" + back.to_yaml());
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("Config::from_yaml_string(c.to_yaml())", __FILE__, __LINE__, std::string(e.what()) + "\n" + yaml);
  }
  return 0;
}
