// Fuzz target: ClusterSpec YAML (`--cluster FILE`, ClusterSpec::from_yaml_string).
// A spec that loads must answer every question the planner asks of it (links between all host
// pairs, device types, indices), hold names that JSON can carry (plans and profiles name devices
// and hosts) and survive to_yaml -> from_yaml_string (`alloy cluster import` writes specs with
// to_yaml for users to edit and load again).
#include <nlohmann/json.hpp>

#include "alloy/plan/cluster.h"
#include "fuzz_util.h"

using alloy::InputError;
using alloy::plan::ClusterSpec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ClusterSpec spec;
  try {
    spec = ClusterSpec::from_yaml_string(std::string(alloy_fuzz::as_view(data, size)), "fuzz-cluster.yaml");
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  const auto hosts = spec.hosts();
  for (const auto& a : hosts)
    for (const auto& b : hosts) {
      const auto l = spec.link(a, b);
      FUZZ_CHECK(l.bandwidth_gbps > 0 && l.latency_ms >= 0, "link " + a + " - " + b);
    }
  for (const auto& d : spec.devices) (void)nlohmann::json({d.name, d.host, d.type, d.kind}).dump();
  for (const auto& [g, hs] : spec.groups) (void)nlohmann::json({g, hs}).dump();
  for (size_t i = 0; i < spec.devices.size(); ++i) {
    FUZZ_CHECK(spec.device_index(spec.devices[i].name) == static_cast<int>(i), spec.devices[i].name);
    (void)spec.link_between_devices(static_cast<int>(i), 0);
  }
  (void)spec.types();
  const std::string yaml = spec.to_yaml();
  try {
    ClusterSpec back = ClusterSpec::from_yaml_string(yaml, "round trip");
    FUZZ_CHECK(back.to_yaml() == yaml, "to_yaml -> from_yaml_string changed the spec:\n" + yaml + "\n" + back.to_yaml());
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("ClusterSpec::from_yaml_string(spec.to_yaml())", __FILE__, __LINE__,
                             std::string(e.what()) + "\n" + yaml);
  }
  return 0;
}
