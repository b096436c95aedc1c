// Fuzz target: profile JSON (`--profile FILE`, plan::Profile::load), what `alloy profile` measured.
// A profile that loads must give finite, non-negative compute times at the micro-batch sizes the
// planner asks about, and survive to_json -> from_json (profiles are saved and loaded again).
#include <cmath>

#include <nlohmann/json.hpp>

#include "alloy/plan/profile.h"
#include "fuzz_util.h"

using alloy::InputError;
using alloy::plan::Profile;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = alloy_fuzz::TempDir::get().write("profile.json", alloy_fuzz::as_view(data, size));
  Profile p;
  try {
    p = Profile::load(path);
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  (void)p.activation_bytes_per_sample();
  for (const auto& [type, d] : p.devices)
    for (const auto* c : {&d.block_fwd, &d.block_bwd, &d.embed_fwd, &d.embed_bwd, &d.head_fwd, &d.head_bwd})
      for (double m : {1.0, 2.0, 3.0, 8.0, 1000.0}) {
        const double t = c->at(m);
        FUZZ_CHECK(!std::isnan(t), type + " at " + std::to_string(m));
      }
  alloy::Config cfg;
  cfg.model = p.model;
  cfg.lora = p.lora;
  FUZZ_CHECK(p.mismatch(cfg).empty(), p.mismatch(cfg));
  const nlohmann::json j = p.to_json();
  try {
    Profile back = Profile::from_json(nlohmann::json::parse(j.dump()), "round trip");
    FUZZ_CHECK(back.to_json() == j, "to_json -> from_json changed the profile:\n" + j.dump() + "\n" + back.to_json().dump());
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("Profile::from_json(p.to_json())", __FILE__, __LINE__, std::string(e.what()) + "\n" + j.dump());
  }
  return 0;
}
