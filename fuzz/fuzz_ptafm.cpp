// Fuzz target: PTAFM's data-centre description (`alloy cluster import --ptafm FILE`,
// plan::import_ptafm). The spec it returns has been validated, so it must also load back from
// its own YAML.
#include "alloy/plan/cluster.h"
#include "fuzz_util.h"

using alloy::InputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = alloy_fuzz::TempDir::get().write("ptafm.txt", alloy_fuzz::as_view(data, size));
  alloy::plan::PtafmCluster c;
  try {
    c = alloy::plan::import_ptafm(path);
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  FUZZ_CHECK(c.num_stages >= 1, std::to_string(c.num_stages));
  // GPU counts multiply: a short file can describe 100,000 devices, whose YAML takes seconds to
  // write and read back (linear, not a bug); the round trip is checked on smaller pools.
  if (c.spec.devices.size() > 4096) return 0;
  const std::string yaml = c.spec.to_yaml();
  try {
    (void)alloy::plan::ClusterSpec::from_yaml_string(yaml, "round trip");
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("ClusterSpec::from_yaml_string(spec.to_yaml())", __FILE__, __LINE__,
                             std::string(e.what()) + "\n" + yaml);
  }
  return 0;
}
