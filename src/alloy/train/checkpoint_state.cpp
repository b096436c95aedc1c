#include "alloy/train/checkpoint_state.h"

#include <cmath>

#include <climits>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/json_file.h"
#include "alloy/core/tensorboard.h"

namespace fs = std::filesystem;

namespace alloy::train {

namespace {
// CRC32C of a file's bytes, read in chunks; its size into BYTES.
uint32_t file_crc32c(const std::string& path, uint64_t* bytes) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw InputError(path, "cannot be read");
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0;
  *bytes = 0;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), f)) > 0;) {
    crc = crc32c_extend(crc, buf.data(), n);
    *bytes += n;
  }
  std::fclose(f);
  return crc;
}
std::string crc_hex(uint32_t crc) {
  char b[16];
  std::snprintf(b, sizeof b, "%08x", crc);
  return b;
}
}  // namespace

nlohmann::json file_manifest(const std::string& dir) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file() || e.path().filename() == "state.json") continue;
    uint64_t bytes = 0;
    const uint32_t crc = file_crc32c(e.path().string(), &bytes);
    files[e.path().filename().string()] = {{"bytes", bytes}, {"crc32c", crc_hex(crc)}};
  }
  return files;
}

std::string checkpoint_problem(const std::string& dir) {
  const std::string state = dir + "/state.json";
  if (!file_exists(state)) return state + " is missing";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(state));
  } catch (const std::exception& e) {
    return state + " is not valid JSON (" + e.what() + ")";
  }
  if (!j.is_object() || !j.contains("files")) return "";  // version 1: no list to check against
  if (!j["files"].is_object()) return state + ": field 'files' is not an object";
  for (const auto& [name, f] : j["files"].items()) {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      return state + ": field 'files' names '" + name + "', which is not a file of this directory";
    if (!f.is_object() || !f.contains("bytes") || !f["bytes"].is_number_unsigned() || !f.contains("crc32c") || !f["crc32c"].is_string())
      return state + ": field 'files." + name + "' must be {\"bytes\": N, \"crc32c\": \"hex\"}";
    const std::string path = dir + "/" + name;
    if (!file_exists(path)) return path + " is missing";
    uint64_t bytes = 0;
    const uint32_t crc = file_crc32c(path, &bytes);
    const uint64_t want = f.value("bytes", uint64_t{0});
    if (bytes != want) return path + " has " + std::to_string(bytes) + " bytes, state.json says " + std::to_string(want);
    if (crc_hex(crc) != f.value("crc32c", std::string()))
      return path + ": CRC32C " + crc_hex(crc) + " differs from state.json's " + f.value("crc32c", std::string()) + " (corrupt)";
  }
  return "";
}

CheckpointState read_checkpoint_state(const std::string& ckpt_dir) {
  std::string file = ckpt_dir + "/state.json";
  nlohmann::json j = read_json_file(file);
  if (!j.is_object()) throw InputError(file, "must be a JSON object (an Alloy checkpoint's state)");
  if (!j.contains("format") || j["format"] != kCheckpointFormat)
    throw InputError(file, "field 'format' is not \"" + std::string(kCheckpointFormat) + "\": not an Alloy checkpoint");
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int>() < 1 ||
      j["version"].get<int>() > kCheckpointVersion)
    throw InputError(file, "field 'version' is " + j.value("version", nlohmann::json()).dump() +
                               ", this Alloy reads versions 1 to " + std::to_string(kCheckpointVersion));
  CheckpointState st;
  // Whole, non-negative counts only: a float such as 1e300 would be undefined behaviour to convert.
  auto count = [&](const char* key) -> int64_t {
    if (!j.contains(key)) throw InputError(file, std::string("field '") + key + "' is missing");
    const auto& v = j[key];
    if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) : v.get<int64_t>() < 0))
      throw InputError(file, std::string("field '") + key + "' must be a whole number >= 0, got " + v.dump());
    return v.get<int64_t>();
  };
  st.step = count("step");
  st.consumed_samples = static_cast<uint64_t>(count("consumed_samples"));
  st.optimizer_steps = count("optimizer_steps");
  if (j.contains("world_size")) {
    const int64_t w = count("world_size");
    if (w < 1 || w > INT32_MAX) throw InputError(file, "field 'world_size' must be between 1 and 2^31-1, got " + std::to_string(w));
    st.world_size = static_cast<int>(w);
  }
  if (!j.contains("config")) throw InputError(file, "field 'config' is missing");
  st.config = Config::from_json(j["config"], file + " (field 'config')");
  if (j.contains("plan")) st.plan = j["plan"];
  if (j.contains("base")) {
    if (!j["base"].is_string()) throw InputError(file, "field 'base' must be a path (string)");
    st.base = j["base"].get<std::string>();
  }
  if (j.contains("loss_scale")) {
    const auto& v = j["loss_scale"];
    if (!v.is_number() || !(v.get<double>() >= 1) || std::isinf(v.get<double>()))
      throw InputError(file, "field 'loss_scale' must be a finite number >= 1");
    st.loss_scale = v.get<double>();
    if (j.contains("loss_scale_good_steps")) st.loss_scale_good_steps = count("loss_scale_good_steps");
  }
  return st;
}

}  // namespace alloy::train
