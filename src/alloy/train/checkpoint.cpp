#include "alloy/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <map>

#include "alloy/core/error.h"
#include "alloy/core/json_file.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/core/tensorboard.h"
#include "alloy/model/weights.h"

namespace fs = std::filesystem;

namespace alloy::train {
std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

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
std::string shard_name(const std::string& base, int rank, int world) {
  if (world == 1) return base + ".safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-rank%05d.safetensors", base.c_str(), rank);
  return buf;
}
// Every shard file of one kind ("model" or "optimizer") in a checkpoint directory.
std::vector<std::string> shards(const std::string& dir, const std::string& base) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string n = e.path().filename().string();
    if (n == base + ".safetensors" || (n.rfind(base + "-rank", 0) == 0 && n.size() > 12 &&
                                       n.compare(n.size() - 12, 12, ".safetensors") == 0))
      out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

std::string checkpoint_staging_dir(const std::string& run_dir, int64_t step) {
  return run_dir + "/checkpoints/." + step_name(step) + ".partial";
}

void begin_checkpoint(const std::string& run_dir, int64_t step) {
  ensure_writable_dir(run_dir + "/checkpoints");
  std::string tmp = checkpoint_staging_dir(run_dir, step);
  remove_tree(tmp);
  ensure_writable_dir(tmp);
}

void write_checkpoint_shard(const std::string& dir, int rank, int world, const std::vector<const model::Param*>& params,
                            const AdamW* opt) {
  std::vector<std::pair<std::string, model::TensorBlob>> blobs;
  for (const auto* p : params) blobs.emplace_back(p->name, model::to_blob(p->tensor));
  model::write_safetensors(dir + "/" + shard_name("model", rank, world), blobs, {{"format", "alloy-model"}});
  if (!opt) return;
  std::map<std::string, bool> mine;
  for (const auto* p : params) mine[p->name] = true;
  std::vector<std::pair<std::string, model::TensorBlob>> ob;
  for (const auto& [n, t] : opt->state()) {
    std::string pname = n.substr(n.find('.') + 1);  // "exp_avg.NAME" -> NAME
    // A slice ("exp_avg.NAME@BEGIN") is this rank's alone (ZeRO): always saved; a whole tensor by
    // the parameter's first holder.
    if (pname.find('@') != std::string::npos || mine.count(pname)) ob.emplace_back(n, model::to_blob(t));
  }
  ob.emplace_back("rng.cpu", model::to_blob(at::detail::getDefaultCPUGenerator().get_state()));
  model::write_safetensors(dir + "/" + shard_name("optimizer", rank, world), ob, {{"format", "alloy-optimizer"}});
}

void write_sync_state(const std::string& dir, int rank, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::string& key) {
  if (tensors.empty()) return;
  std::vector<std::pair<std::string, model::TensorBlob>> blobs;
  for (const auto& [n, t] : tensors) blobs.emplace_back(n, model::to_blob(t));
  model::write_safetensors(dir + "/" + shard_name("gradsync", rank, 2), blobs, {{"format", "alloy-gradsync"}, {"key", key}});
}

std::map<std::string, at::Tensor> read_sync_state(const std::string& ckpt_dir, int rank, const std::string& key) {
  std::string path = ckpt_dir + "/" + shard_name("gradsync", rank, 2);
  if (!file_exists(path)) return {};
  auto f = model::SafetensorsFile::open(path);
  auto it = f.metadata().find("format");
  if (it == f.metadata().end() || it->second != "alloy-gradsync")
    throw InputError(path, "metadata 'format' is not \"alloy-gradsync\"");
  auto k = f.metadata().find("key");
  if (k == f.metadata().end() || k->second != key) return {};
  return model::read_all(f);
}

std::string publish_checkpoint(const std::string& run_dir, const CheckpointState& st) {
  std::string root = run_dir + "/checkpoints";
  std::string name = step_name(st.step);
  std::string tmp = checkpoint_staging_dir(run_dir, st.step);
  nlohmann::json j = {{"format", kCheckpointFormat},
                      {"version", kCheckpointVersion},
                      {"step", st.step},
                      {"consumed_samples", st.consumed_samples},
                      {"optimizer_steps", st.optimizer_steps},
                      {"world_size", st.world_size},
                      {"config", st.config.to_json()}};
  if (!st.plan.is_null()) j["plan"] = st.plan;
  if (!st.base.empty()) j["base"] = st.base;
  // Every shard is complete by now (the ranks wrote theirs before the barrier that precedes this).
  j["files"] = nlohmann::json::object();
  for (const auto& e : fs::directory_iterator(tmp)) {
    if (!e.is_regular_file() || e.path().filename() == "state.json") continue;
    uint64_t bytes = 0;
    const uint32_t crc = file_crc32c(e.path().string(), &bytes);
    j["files"][e.path().filename().string()] = {{"bytes", bytes}, {"crc32c", crc_hex(crc)}};
  }
  write_file_atomic(tmp + "/state.json", j.dump(2) + "\n");
  fsync_dir(tmp);
  // Replace an older checkpoint of the same step only once the new one is complete.
  std::string final_dir = root + "/" + name, old_dir = root + "/." + name + ".old";
  remove_tree(old_dir);
  if (fs::exists(final_dir)) fs::rename(final_dir, old_dir);
  fs::rename(tmp, final_dir);
  fsync_dir(root);
  write_file_atomic(root + "/latest", name + "\n");
  remove_tree(old_dir);
  return final_dir;
}

std::string save_checkpoint(const std::string& run_dir, const CheckpointState& st, const model::Transformer& m,
                            const AdamW* opt) {
  begin_checkpoint(run_dir, st.step);
  write_checkpoint_shard(checkpoint_staging_dir(run_dir, st.step), 0, 1, m.parameters(), opt);
  CheckpointState s = st;
  s.optimizer_steps = opt ? opt->steps_taken() : 0;
  return publish_checkpoint(run_dir, s);
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

std::string resolve_checkpoint(const std::string& path) {
  if (file_exists(path + "/state.json")) {
    if (const std::string why = checkpoint_problem(path); !why.empty()) throw InputError(path, "cannot be used: " + why);
    return path;
  }
  for (const std::string& root : {path + "/checkpoints", path}) {
    if (!file_exists(root + "/latest")) continue;
    std::string name = read_file(root + "/latest");
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    std::string why = checkpoint_problem(root + "/" + name);
    if (why.empty()) return root + "/" + name;
    // The newest is torn or corrupt: fall back to the newest step directory that checks out.
    std::vector<std::string> steps;
    for (const auto& e : fs::directory_iterator(root)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step_", 0) == 0 && n != name) steps.push_back(n);
    }
    std::sort(steps.rbegin(), steps.rend());
    for (const auto& n : steps)
      if (checkpoint_problem(root + "/" + n).empty()) {
        log_error("checkpoint " + root + "/" + name + " cannot be used (" + why + "); using the previous complete one, " +
                  root + "/" + n);
        return root + "/" + n;
      }
    throw InputError(root + "/" + name, "cannot be used (" + why + ") and no earlier checkpoint checks out");
  }
  throw InputError(path, "no checkpoint here (expected state.json, or checkpoints/latest in a run directory)");
}

std::vector<std::string> prune_checkpoints(const std::string& run_dir, int64_t keep) {
  std::vector<std::string> removed;
  const std::string root = run_dir + "/checkpoints";
  if (keep <= 0 || !fs::is_directory(root)) return removed;
  std::string latest;
  if (file_exists(root + "/latest")) {
    latest = read_file(root + "/latest");
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  }
  std::vector<std::string> steps;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step_", 0) == 0) steps.push_back(n);
  }
  std::sort(steps.rbegin(), steps.rend());  // newest first (names are zero-padded)
  for (size_t i = static_cast<size_t>(keep); i < steps.size(); ++i) {
    if (steps[i] == latest) continue;
    remove_tree(root + "/" + steps[i]);
    removed.push_back(root + "/" + steps[i]);
  }
  return removed;
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
  return st;
}

void check_same_model(const std::string& ckpt_dir, const CheckpointState& st, const ModelConfig& m) {
  auto diffs = model_differences(st.config.model, m);
  if (diffs.empty()) return;
  std::string msg = "is a checkpoint of another model (checkpoint vs this run):";
  for (const auto& d : diffs) msg += "\n  " + d;
  throw InputError(ckpt_dir + "/state.json", msg);
}

std::map<std::string, at::Tensor> read_checkpoint_tensors(const std::string& ckpt_dir,
                                                          const std::function<bool(const std::string&)>& keep) {
  std::map<std::string, at::Tensor> out;
  auto files = shards(ckpt_dir, "model");
  if (files.empty()) throw InputError(ckpt_dir, "holds no model*.safetensors");
  for (const auto& path : files) {
    auto f = model::SafetensorsFile::open(path);
    for (const auto& n : f.names())
      if (keep(n)) out[n] = model::read_tensor(f, n);
  }
  return out;
}

void load_params(const std::string& ckpt_dir, const std::vector<model::Param*>& params) {
  at::NoGradGuard ng;
  std::vector<model::SafetensorsFile> files;
  for (const auto& f : shards(ckpt_dir, "model")) files.push_back(model::SafetensorsFile::open(f));
  if (files.empty()) throw InputError(ckpt_dir, "holds no model*.safetensors");
  for (auto* p : params) {
    const model::SafetensorsFile* src = nullptr;
    for (const auto& f : files)
      if (f.has(p->name)) src = &f;
    if (!src) throw InputError(ckpt_dir, "no shard holds tensor '" + p->name + "' (is this a checkpoint of another model?)");
    const auto& info = src->info(p->name);
    if (at::IntArrayRef(info.shape) != p->tensor.sizes())
      throw InputError(src->path(), "tensor '" + p->name + "' has shape " + std::string(c10::str(at::IntArrayRef(info.shape))) +
                                        ", the model needs " + std::string(c10::str(p->tensor.sizes())));
    p->tensor.copy_(model::read_tensor(*src, p->name));
  }
}

void load_optimizer(const std::string& ckpt_dir, AdamW& opt, int64_t optimizer_steps) {
  std::map<std::string, at::Tensor> all;
  auto files = shards(ckpt_dir, "optimizer");
  if (files.empty())
    throw InputError(ckpt_dir, "holds no optimizer*.safetensors: it has weights only and cannot be resumed (use --init-weights)");
  for (const auto& f : files) {
    auto st = model::SafetensorsFile::open(f);
    for (const auto& n : st.names())
      if (n != "rng.cpu") all[n] = model::read_tensor(st, n);
    if (st.has("rng.cpu") && files.size() == 1) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle to the global generator
      gen.set_state(model::read_tensor(st, "rng.cpu"));
    }
  }
  opt.load_state(all, optimizer_steps, ckpt_dir);
}

void load_checkpoint(const std::string& ckpt_dir, model::Transformer& m, AdamW* opt) {
  CheckpointState st = read_checkpoint_state(ckpt_dir);
  check_same_model(ckpt_dir, st, m.config());
  load_params(ckpt_dir, m.parameters());
  if (opt) load_optimizer(ckpt_dir, *opt, st.optimizer_steps);
}

}  // namespace alloy::train
