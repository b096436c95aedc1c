// Fuzz target: SynerFuse/Megatron parallelism flags (`alloy plan convert --synerfuse ...`,
// parse_synerfuse_args + plan_from_synerfuse). Input: the argument list, whitespace-separated.
// A converted plan must validate (plan_from_synerfuse promises it does).
#include <cctype>

#include "alloy/core/config.h"
#include "alloy/core/plan_convert.h"
#include "fuzz_util.h"

using alloy::InputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> argv;
  std::string cur;
  for (size_t i = 0; i < size; ++i) {
    if (std::isspace(data[i])) {
      if (!cur.empty()) argv.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  if (!cur.empty()) argv.push_back(cur);
  alloy::SynerFuseArgs a;
  try {
    a = alloy::parse_synerfuse_args(argv);
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  (void)alloy::default_micro_batch(alloy::Config(), a, 6);
  // As `alloy plan` does: what the flags leave out comes from the config (here the default one).
  const alloy::Config cfg;
  if (a.num_layers <= 0) a.num_layers = cfg.model.layers;
  if (a.global_batch_size <= 0) a.global_batch_size = cfg.train.global_batch;
  if (a.micro_batch_size <= 0) a.micro_batch_size = alloy::default_micro_batch(cfg, a, 0);
  alloy::Plan p;
  try {
    p = alloy::plan_from_synerfuse(a);
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  alloy::ModelConfig model;
  model.layers = a.num_layers;
  try {
    p.validate(model, "converted plan");
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("plan_from_synerfuse(a).validate()", __FILE__, __LINE__, e.what());
  }
  (void)p.describe();
  return 0;
}
