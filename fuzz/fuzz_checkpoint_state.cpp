// Fuzz target: a checkpoint's manifest, state.json (`alloy train --resume`, `alloy eval`,
// `alloy model export`): train::read_checkpoint_state and the JSON half of
// train::checkpoint_problem in src/alloy/train/checkpoint.cpp. Those live in the LibTorch library,
// which fuzz targets do not link, so their bodies are mirrored here (the config inside goes
// through the real Config::from_json), with the fixes for what this target found; each is marked
// FIX. Keep the two in step, or better, move the parsing into alloy_base and call it from here.
#include <climits>

#include <nlohmann/json.hpp>

#include "alloy/core/config.h"
#include "alloy/core/fs.h"
#include "alloy/core/json_file.h"
#include "fuzz_util.h"

using alloy::Config;
using alloy::InputError;

namespace {

struct CheckpointState {  // train::CheckpointState without LibTorch
  int64_t step = 0;
  uint64_t consumed_samples = 0;
  int64_t optimizer_steps = 0;
  Config config;
  int world_size = 1;
  nlohmann::json plan;
  std::string base;
};

constexpr const char* kCheckpointFormat = "alloy-checkpoint";
constexpr int kCheckpointVersion = 2;

// checkpoint_problem without the CRC32C: the checks of state.json's "files" list.
std::string checkpoint_problem(const std::string& dir) {
  const std::string state = dir + "/state.json";
  if (!alloy::file_exists(state)) return state + " is missing";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(alloy::read_file(state));
  } catch (const std::exception& e) {
    return state + " is not valid JSON (" + e.what() + ")";
  }
  if (!j.is_object() || !j.contains("files")) return "";  // version 1: no list to check against
  if (!j["files"].is_object()) return state + ": field 'files' is not an object";
  for (const auto& [name, f] : j["files"].items()) {
    const std::string path = dir + "/" + name;
    // FIX: value() throws type_error on an entry that is not an object or a field of another type,
    // and get<uint64_t>() of a float past uint64's range is undefined.
    if (!f.is_object() || !f.contains("bytes") || !f["bytes"].is_number_unsigned() || !f.contains("crc32c") ||
        !f["crc32c"].is_string())
      return state + ": files." + name + " must be {\"bytes\": <size>, \"crc32c\": \"<hex>\"}";
    if (!alloy::file_exists(path)) return path + " is missing";
    const uint64_t want = f.value("bytes", uint64_t{0});
    const std::string crc = f.value("crc32c", std::string());
    (void)want, (void)crc;  // (the mirror stops short of reading the file)
  }
  return "";
}

CheckpointState read_checkpoint_state(const std::string& ckpt_dir) {
  std::string file = ckpt_dir + "/state.json";
  nlohmann::json j = alloy::read_json_file(file);
  // FIX: value() throws type_error on a document that is not an object ([], 5) and on a "format"
  // that is not a string.
  if (!j.is_object()) throw InputError(file, std::string("expected a JSON object, got ") + j.type_name());
  if (!j.contains("format") || j["format"] != kCheckpointFormat)
    throw InputError(file, "field 'format' is not \"" + std::string(kCheckpointFormat) + "\": not an Alloy checkpoint");
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int>() < 1 ||
      j["version"].get<int>() > kCheckpointVersion)
    throw InputError(file, "field 'version' is " + j.value("version", nlohmann::json()).dump() +
                               ", this Alloy reads versions 1 to " + std::to_string(kCheckpointVersion));
  CheckpointState st;
  // FIX: get<int64_t>() / get<uint64_t>() / get<int>() of a float past the type's range (1e300, -1.5
  // for an unsigned) is undefined behaviour; and a negative consumed_samples or a world_size past int
  // wrapped silently. Counts must be integers within range.
  auto count = [&](const char* key, bool required, int64_t max) -> int64_t {
    if (!j.contains(key)) {
      if (required) throw InputError(file, std::string("field '") + key + "' is missing");
      return -1;
    }
    const auto& v = j[key];
    if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(max)
                                                            : v.get<int64_t>() < 0 || v.get<int64_t>() > max))
      throw InputError(file, std::string("field '") + key + "' must be a whole number from 0 to " + std::to_string(max) +
                                 ", got " + v.dump());
    return v.get<int64_t>();
  };
  st.step = count("step", true, INT64_MAX);
  st.consumed_samples = static_cast<uint64_t>(count("consumed_samples", true, INT64_MAX));
  st.optimizer_steps = count("optimizer_steps", true, INT64_MAX);
  const int64_t world = count("world_size", false, INT_MAX);
  st.world_size = world < 0 ? 1 : static_cast<int>(world);
  if (!j.contains("config")) throw InputError(file, "field 'config' is missing");
  st.config = Config::from_json(j["config"], file + " (field 'config')");
  if (j.contains("plan")) st.plan = j["plan"];
  if (j.contains("base")) {
    if (!j["base"].is_string()) throw InputError(file, "field 'base' must be a path (string)");
    st.base = j["base"].get<std::string>();
  }
  return st;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto& dir = alloy_fuzz::TempDir::get();
  dir.write("state.json", alloy_fuzz::as_view(data, size));
  (void)checkpoint_problem(dir.path());
  try {
    CheckpointState st = read_checkpoint_state(dir.path());
    (void)alloy::model_differences(st.config.model, alloy::ModelConfig());
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
  }
  return 0;
}
