// Fuzz target: plan JSON (`--plan FILE`, Plan::load). The runtime validates a plan against the
// model before running it; here the model has as many blocks as the plan's first pipeline covers.
// A plan that validates must answer the runtime's questions (every rank's position, its schedule,
// sample offsets, the description) and survive to_json -> from_json (plans are saved with save()
// and loaded again, and sent between ranks as JSON).
#include <algorithm>

#include <nlohmann/json.hpp>

#include "alloy/core/plan.h"
#include "alloy/pipeline/schedule.h"
#include "fuzz_util.h"

using alloy::InputError;
using alloy::Plan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = alloy_fuzz::TempDir::get().write("plan.json", alloy_fuzz::as_view(data, size));
  Plan p;
  try {
    p = Plan::load(path);
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  alloy::ModelConfig model;
  model.layers = !p.pipelines.empty() && !p.pipelines[0].stages.empty() ? p.pipelines[0].stages.back().layer_end : 1;
  try {
    p.validate(model, path);
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  const int world = p.world_size();
  std::vector<int> all;
  for (int r = 0; r < world; ++r) {
    const auto at = p.locate(r);
    FUZZ_CHECK(at.pipeline >= 0 && at.stage >= 0, std::to_string(r));
    (void)p.sample_offset(at.pipeline);
    all.push_back(r);
  }
  (void)p.schedule_mismatch(all);
  // Every pipeline's schedule (its own or the plan's) is one the executor can build.
  const auto& names = alloy::pipeline::schedule_names();
  for (size_t i = 0; i < p.pipelines.size(); ++i)
    FUZZ_CHECK(std::find(names.begin(), names.end(), p.schedule_of(i)) != names.end(), "pipeline " + std::to_string(i) + ": " + p.schedule_of(i));
  for (const auto& s : p.sharding) (void)p.sharding_of(s.ranks);
  // Every micro-batch runs a non-empty range of units inside what each stage holds, and the
  // stages' ranges chain from unit 0 to the model's end (a floating boundary decides them per
  // micro-batch).
  for (const auto& pl : p.pipelines)
    for (int64_t m = 0; m < std::min<int64_t>(pl.num_micro_batches, 64); ++m) {
      int64_t at = 0;
      for (size_t s = 0; s < pl.stages.size(); ++s) {
        const auto [b, e] = pl.units_of(s, m);
        FUZZ_CHECK(b == at && b < e && b >= pl.stages[s].unit_begin() && e <= pl.stages[s].unit_end(),
                   "micro-batch " + std::to_string(m) + " stage " + std::to_string(s) + " runs [" + std::to_string(b) + ", " +
                       std::to_string(e) + ")");
        at = e;
      }
      FUZZ_CHECK(at == 2 * model.layers, "micro-batch " + std::to_string(m) + " ends at unit " + std::to_string(at));
    }
  (void)p.describe();
  const nlohmann::json j = p.to_json();
  try {
    Plan back = Plan::from_json(nlohmann::json::parse(j.dump()), "round trip");
    back.validate(model, "round trip");
    FUZZ_CHECK(back.to_json() == j, "to_json -> from_json changed the plan:\n" + j.dump() + "\n" + back.to_json().dump());
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("Plan::from_json(p.to_json())", __FILE__, __LINE__, std::string(e.what()) + "\n" + j.dump());
  }
  return 0;
}
