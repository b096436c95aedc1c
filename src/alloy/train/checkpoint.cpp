#include "alloy/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <cstdio>
#include <filesystem>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/model/weights.h"

namespace fs = std::filesystem;

namespace alloy::train {
namespace {
std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}
}  // namespace

std::string save_checkpoint(const std::string& run_dir, const CheckpointState& st, const model::Transformer& m,
                            const AdamW* opt) {
  std::string root = run_dir + "/checkpoints";
  ensure_writable_dir(root);
  std::string name = step_name(st.step);
  std::string final_dir = root + "/" + name;
  std::string tmp_dir = root + "/." + name + ".partial";
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  ensure_writable_dir(tmp_dir);

  std::map<std::string, std::string> meta = {{"format", "alloy-model"}, {"arch", m.config().arch}};
  model::save_weights(m, tmp_dir + "/model.safetensors", meta);
  if (opt) {
    std::vector<std::pair<std::string, model::TensorBlob>> blobs;
    for (const auto& [n, t] : opt->state()) blobs.emplace_back(n, model::to_blob(t));
    blobs.emplace_back("rng.cpu", model::to_blob(at::detail::getDefaultCPUGenerator().get_state()));
    model::write_safetensors(tmp_dir + "/optimizer.safetensors", blobs, {{"format", "alloy-optimizer"}});
  }
  nlohmann::json j = {{"format", kCheckpointFormat},
                      {"version", kCheckpointVersion},
                      {"step", st.step},
                      {"consumed_samples", st.consumed_samples},
                      {"optimizer_steps", opt ? opt->steps_taken() : 0},
                      {"has_optimizer", opt != nullptr},
                      {"config", st.config.to_json()}};
  write_file_atomic(tmp_dir + "/state.json", j.dump(2) + "\n");
  fsync_dir(tmp_dir);

  // Replace an older checkpoint of the same step only after the new one is complete.
  std::string old_dir = root + "/." + name + ".old";
  fs::remove_all(old_dir, ec);
  if (fs::exists(final_dir)) fs::rename(final_dir, old_dir);
  fs::rename(tmp_dir, final_dir);
  fsync_dir(root);
  write_file_atomic(root + "/latest", name + "\n");
  fs::remove_all(old_dir, ec);
  return final_dir;
}

std::string resolve_checkpoint(const std::string& path) {
  if (file_exists(path + "/state.json")) return path;
  for (const std::string& root : {path + "/checkpoints", path}) {
    if (file_exists(root + "/latest")) {
      std::string name = read_file(root + "/latest");
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
      std::string dir = root + "/" + name;
      if (!file_exists(dir + "/state.json"))
        throw InputError(root + "/latest", "points at '" + name + "', which has no state.json");
      return dir;
    }
  }
  throw InputError(path, "no checkpoint here (expected state.json, or checkpoints/latest in a run directory)");
}

CheckpointState read_checkpoint_state(const std::string& ckpt_dir) {
  std::string file = ckpt_dir + "/state.json";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(file));
  } catch (const nlohmann::json::exception& e) {
    throw InputError(file, std::string("not valid JSON: ") + e.what());
  }
  if (j.value("format", "") != kCheckpointFormat)
    throw InputError(file, "field 'format' is not \"" + std::string(kCheckpointFormat) + "\": not an Alloy checkpoint");
  if (j.value("version", -1) != kCheckpointVersion)
    throw InputError(file, "field 'version' is " + j.value("version", nlohmann::json()).dump() + ", this Alloy reads version " +
                               std::to_string(kCheckpointVersion));
  CheckpointState st;
  try {
    st.step = j.at("step").get<int64_t>();
    st.consumed_samples = j.at("consumed_samples").get<uint64_t>();
    st.optimizer_steps = j.at("optimizer_steps").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw InputError(file, std::string("missing or ill-typed field: ") + e.what());
  }
  if (!j.contains("config")) throw InputError(file, "field 'config' is missing");
  st.config = Config::from_json(j["config"], file + " (field 'config')");
  return st;
}

void load_checkpoint(const std::string& ckpt_dir, model::Transformer& m, AdamW* opt) {
  CheckpointState st = read_checkpoint_state(ckpt_dir);
  auto diffs = model_differences(st.config.model, m.config());
  if (!diffs.empty()) {
    std::string msg = "is a checkpoint of another model (checkpoint vs this run):";
    for (const auto& d : diffs) msg += "\n  " + d;
    throw InputError(ckpt_dir + "/state.json", msg);
  }
  auto weights = model::SafetensorsFile::open(ckpt_dir + "/model.safetensors");
  model::load_weights(m, weights);
  if (opt) {
    std::string ofile = ckpt_dir + "/optimizer.safetensors";
    if (!file_exists(ofile)) throw InputError(ofile, "missing: this checkpoint holds weights only and cannot be resumed");
    auto f = model::SafetensorsFile::open(ofile);
    auto tensors = model::read_all(f);
    opt->load_state(tensors, st.optimizer_steps, ofile);
    auto it = tensors.find("rng.cpu");
    if (it != tensors.end()) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle to the global generator
      gen.set_state(it->second);
    }
  }
}

}  // namespace alloy::train
