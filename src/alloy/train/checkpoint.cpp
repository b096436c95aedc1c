#include "alloy/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include "alloy/core/error.h"
#include "alloy/model/tensor_parallel.h"
#include "alloy/core/json_file.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/model/weights.h"

namespace fs = std::filesystem;

namespace alloy::train {
std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

namespace {
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

void remove_stale_staging(const std::string& run_dir) {
  const std::string root = run_dir + "/checkpoints";
  if (!fs::is_directory(root)) return;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind(".step_", 0) == 0) remove_tree(e.path().string());
  }
}

void begin_checkpoint(const std::string& run_dir, int64_t step) {
  ensure_writable_dir(run_dir + "/checkpoints");
  std::string tmp = checkpoint_staging_dir(run_dir, step);
  remove_tree(tmp);
  ensure_writable_dir(tmp);
}

ShardSnapshot snapshot_shard(int rank, int world_size, const std::vector<const model::Param*>& params, const AdamW* opt) {
  ShardSnapshot s;
  s.rank = rank;
  s.world_size = world_size;
  for (const auto* p : params) s.model.emplace_back(p->name, model::to_blob(p->tensor));
  if (!opt) return s;
  std::map<std::string, bool> mine;
  for (const auto* p : params) mine[p->name] = true;
  for (const auto& [n, t] : opt->state()) {
    std::string pname = n.substr(n.find('.') + 1);  // "exp_avg.NAME" -> NAME
    // A slice ("exp_avg.NAME@BEGIN") is this rank's alone (ZeRO): always saved; a whole tensor by
    // the parameter's first holder.
    if (pname.find('@') != std::string::npos || mine.count(pname)) s.optimizer.emplace_back(n, model::to_blob(t));
  }
  s.optimizer.emplace_back("rng.cpu", model::to_blob(at::detail::getDefaultCPUGenerator().get_state()));
  return s;
}

int64_t ShardSnapshot::bytes() const {
  int64_t n = 0;
  for (const auto* v : {&model, &optimizer, &sync})
    for (const auto& [name, b] : *v) n += static_cast<int64_t>(b.data.size());
  return n;
}

void write_shard(const std::string& dir, const ShardSnapshot& s) {
  model::write_safetensors(dir + "/" + shard_name("model", s.rank, s.world_size), s.model, {{"format", "alloy-model"}});
  if (!s.optimizer.empty())
    model::write_safetensors(dir + "/" + shard_name("optimizer", s.rank, s.world_size), s.optimizer, {{"format", "alloy-optimizer"}});
  if (!s.sync.empty())
    model::write_safetensors(dir + "/" + shard_name("gradsync", s.rank, 2), s.sync, {{"format", "alloy-gradsync"}, {"key", s.sync_key}});
}

void write_checkpoint_shard(const std::string& dir, int rank, int world, const std::vector<const model::Param*>& params,
                            const AdamW* opt) {
  write_shard(dir, snapshot_shard(rank, world, params, opt));
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
  if (st.loss_scale > 0) {
    j["loss_scale"] = st.loss_scale;
    j["loss_scale_good_steps"] = st.loss_scale_good_steps;
  }
  // Every shard is complete by now (the ranks wrote theirs before the barrier that precedes this).
  j["files"] = file_manifest(tmp);
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

void check_same_model(const std::string& ckpt_dir, const CheckpointState& st, const ModelConfig& m) {
  auto diffs = model_differences(st.config.model, m);
  if (diffs.empty()) return;
  std::string msg = "is a checkpoint of another model (checkpoint vs this run):";
  for (const auto& d : diffs) msg += "\n  " + d;
  throw InputError(ckpt_dir + "/state.json", msg);
}

namespace {

// What a checkpoint lacks under a tensor-parallel name, made from what it holds (model::tp_resolve):
// each whole parameter is joined once, however many pieces are then cut from it, and the model's
// shape is read from state.json once, when first needed.
class TpTensors {
 public:
  TpTensors(std::string ckpt_dir, std::function<at::Tensor(const std::string&)> lookup, std::vector<std::string> names)
      : dir_(std::move(ckpt_dir)), lookup_(std::move(lookup)), names_(std::move(names)) {}
  // Over tensors already read (by reference: TENSORS must outlive it; names are those it holds now).
  static TpTensors over(std::string ckpt_dir, const std::map<std::string, at::Tensor>& tensors) {
    std::vector<std::string> names;
    for (const auto& [n, t] : tensors) names.push_back(n);
    return TpTensors(std::move(ckpt_dir), [&tensors](const std::string& n) {
      auto it = tensors.find(n);
      return it == tensors.end() ? at::Tensor() : it->second;
    }, std::move(names));
  }
  at::Tensor get(const std::string& name) {
    if (!model_) model_ = std::make_unique<ModelConfig>(read_checkpoint_state(dir_).config.model);
    std::string base;
    int64_t a = 0, b = 0;
    if (!model::parse_piece(name, &base, &a, &b)) return model::tp_resolve(name, lookup_, names_, *model_);
    auto it = wholes_.find(base);
    if (it == wholes_.end()) it = wholes_.emplace(base, model::tp_resolve(base, lookup_, names_, *model_)).first;
    return it->second.defined() ? model::tp_cut(it->second, model::tp_param(base), a, b, *model_) : at::Tensor();
  }

 private:
  std::string dir_;
  std::function<at::Tensor(const std::string&)> lookup_;
  std::vector<std::string> names_;
  std::unique_ptr<ModelConfig> model_;
  std::map<std::string, at::Tensor> wholes_;
};

}  // namespace

std::map<std::string, at::Tensor> read_checkpoint_tensors(const std::string& ckpt_dir,
                                                          const std::function<bool(const std::string&)>& keep) {
  std::map<std::string, at::Tensor> out;
  auto files = shards(ckpt_dir, "model");
  if (files.empty()) throw InputError(ckpt_dir, "holds no model*.safetensors");
  std::map<std::string, std::vector<std::string>> pieces;  // whole name -> its pieces' names
  for (const auto& path : files) {
    auto f = model::SafetensorsFile::open(path);
    for (const auto& n : f.names()) {
      std::string base;
      int64_t h0 = 0, h1 = 0;
      if (model::parse_piece(n, &base, &h0, &h1)) {
        if (keep(base)) out[n] = model::read_tensor(f, n), pieces[base].push_back(n);
      } else if (keep(n)) {
        out[n] = model::read_tensor(f, n);
      }
    }
  }
  // A tensor-parallel run's pieces are joined: readers see whole parameters under their names.
  if (!pieces.empty()) {
    TpTensors tp = TpTensors::over(ckpt_dir, out);
    for (const auto& [base, ns] : pieces) {
      at::Tensor whole = tp.get(base);
      if (!whole.defined()) throw InputError(ckpt_dir, "the tensor-parallel pieces of '" + base + "' do not cover its heads");
      out[base] = whole;
    }
    for (const auto& [base, ns] : pieces)
      for (const auto& n : ns) out.erase(n);
  }
  return out;
}

void load_params(const std::string& ckpt_dir, const std::vector<model::Param*>& params) {
  at::NoGradGuard ng;
  std::vector<model::SafetensorsFile> files;
  for (const auto& f : shards(ckpt_dir, "model")) files.push_back(model::SafetensorsFile::open(f));
  if (files.empty()) throw InputError(ckpt_dir, "holds no model*.safetensors");
  std::unique_ptr<TpTensors> tp;  // made when a parameter is not stored under its own name
  for (auto* p : params) {
    const model::SafetensorsFile* src = nullptr;
    for (const auto& f : files)
      if (f.has(p->name)) src = &f;
    if (!src) {
      // Tensor parallelism: the checkpoint may hold this piece's whole parameter, or other pieces.
      if (!tp) {
        std::vector<std::string> names;
        for (const auto& f : files)
          for (const auto& n : f.names()) names.push_back(n);
        tp = std::make_unique<TpTensors>(ckpt_dir, [&files](const std::string& n) {
          for (const auto& f : files)
            if (f.has(n)) return model::read_tensor(f, n);
          return at::Tensor();
        }, names);
      }
      at::Tensor t = tp->get(p->name);
      if (!t.defined()) throw InputError(ckpt_dir, "no shard holds tensor '" + p->name + "' (is this a checkpoint of another model?)");
      if (t.sizes() != p->tensor.sizes())
        throw InputError(ckpt_dir, "tensor '" + p->name + "' made from its tensor-parallel pieces has shape " +
                                       std::string(c10::str(t.sizes())) + ", the model needs " + std::string(c10::str(p->tensor.sizes())));
      p->tensor.copy_(t);
      continue;
    }
    const auto& info = src->info(p->name);
    if (at::IntArrayRef(info.shape) != p->tensor.sizes())
      throw InputError(src->path(), "tensor '" + p->name + "' has shape " + std::string(c10::str(at::IntArrayRef(info.shape))) +
                                        ", the model needs " + std::string(c10::str(p->tensor.sizes())));
    p->tensor.copy_(model::read_tensor(*src, p->name));
  }
}

namespace {
// Optimizer state a ZeRO run saved as slices of the flattened tensor ("exp_avg.NAME@BEGIN", each by
// its owner), joined on demand: another tensor-parallel layout joins and cuts whole tensors and
// pieces (TpTensors), which needs them whole. Shaped as NAME's weight in the checkpoint's model
// files (weights are saved whole). Slices that do not cover their tensor are an error naming it
// (join_state_slices), as on a resume under the same layout.
class SlicedState {
 public:
  SlicedState(const std::string& ckpt_dir, const std::map<std::string, at::Tensor>& all) : dir_(ckpt_dir), all_(all) {
    for (const auto& [key, t] : all)
      if (const auto at_pos = key.rfind('@'); at_pos != std::string::npos) sliced_.insert(key.substr(0, at_pos));
  }
  // What is stored, and the tensors its slices make.
  std::vector<std::string> names() const {
    std::vector<std::string> out(sliced_.begin(), sliced_.end());
    for (const auto& [n, t] : all_) out.push_back(n);
    return out;
  }
  at::Tensor get(const std::string& key) {
    if (auto it = all_.find(key); it != all_.end()) return it->second;
    if (auto it = joined_.find(key); it != joined_.end()) return it->second;
    if (!sliced_.count(key)) return {};
    if (shapes_.empty())  // read once, when a slice is first needed whole (not on a same-layout resume)
      for (const auto& f : shards(dir_, "model")) {
        auto st = model::SafetensorsFile::open(f);
        for (const auto& n : st.names()) shapes_[n] = st.info(n).shape;
      }
    const auto dot = key.find('.');  // "exp_avg.NAME" -> NAME
    const auto shape = dot == std::string::npos ? shapes_.end() : shapes_.find(key.substr(dot + 1));
    if (shape == shapes_.end()) return {};
    int64_t n = 1;
    for (int64_t d : shape->second) n *= d;
    return joined_[key] = join_state_slices(all_, key, n, dir_).view(shape->second);
  }

 private:
  std::string dir_;
  const std::map<std::string, at::Tensor>& all_;
  std::set<std::string> sliced_;
  std::map<std::string, std::vector<int64_t>> shapes_;
  std::map<std::string, at::Tensor> joined_;
};
}  // namespace

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
  // Tensor parallelism: state stored for other pieces (or whole where this run holds pieces, or the
  // reverse), whole or in ZeRO slices, is joined and cut to what this run holds.
  SlicedState stored(ckpt_dir, all);
  TpTensors tp(ckpt_dir, [&stored](const std::string& n) { return stored.get(n); }, stored.names());
  for (const auto& [key, t] : opt.state()) {
    const std::string want = key.substr(0, key.find('@'));
    const auto sliced = all.lower_bound(want + "@");
    if (all.count(want) || (sliced != all.end() && sliced->first.rfind(want + "@", 0) == 0)) continue;
    if (at::Tensor r = tp.get(want); r.defined()) all[want] = r;
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
