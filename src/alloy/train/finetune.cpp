#include "alloy/train/finetune.h"

#include <ATen/core/grad_mode.h>

#include <filesystem>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/json_file.h"
#include "alloy/model/lora.h"
#include "alloy/model/megatron_checkpoint.h"
#include "alloy/model/weights.h"
#include "alloy/train/checkpoint.h"

namespace alloy::train {

void load_base_weights(model::Transformer& m, const std::string& src, std::vector<std::string>* notes) {
  namespace fs = std::filesystem;
  // A Megatron-LM (or SynerFuse) checkpoint: its pieces and stages joined into the whole model.
  if (model::is_megatron_checkpoint(src)) {
    const model::MegatronCheckpoint c = model::read_megatron_checkpoint(src, &m.config());
    model::load_megatron_weights(m, c);
    if (notes) *notes = c.notes;
    return;
  }
  // A HuggingFace model directory (or its index file): its shards, as one set of weights.
  const bool hf_dir = fs::is_directory(src) && !fs::exists(src + "/state.json") && !fs::exists(src + "/checkpoints") &&
                      !fs::exists(src + "/latest") &&
                      (fs::exists(src + "/model.safetensors.index.json") || fs::exists(src + "/model.safetensors"));
  if (hf_dir || (!fs::is_directory(src) && src.size() > 5 && src.compare(src.size() - 5, 5, ".json") == 0)) {
    std::vector<model::SafetensorsFile> files;
    for (const auto& f : model::hf_weight_files(src)) files.push_back(model::SafetensorsFile::open(f));
    std::vector<const model::SafetensorsFile*> ptrs;
    for (const auto& f : files) ptrs.push_back(&f);
    model::load_weights(m, ptrs);
    return;
  }
  if (std::filesystem::is_directory(src)) {
    const std::string dir = resolve_checkpoint(src);
    const CheckpointState st = read_checkpoint_state(dir);
    check_same_model(dir, st, m.config());
    if (st.config.lora.enabled()) {
      // A fine-tuned checkpoint as the next run's base: its weights with the adapters folded in.
      auto full = load_checkpoint_model(dir);
      std::map<std::string, at::Tensor> merged;
      for (auto& [n, t] : full->merged_weights()) merged[n] = t;
      at::NoGradGuard ng;
      for (auto* p : m.parameters()) p->tensor.copy_(merged.at(p->name));
      return;
    }
    load_params(dir, m.parameters());
    return;
  }
  if (!file_exists(src)) throw InputError(src, "no such file or checkpoint directory (--init-from)");
  auto f = model::SafetensorsFile::open(src);
  model::load_weights(m, f);
}

std::unique_ptr<model::Transformer> load_checkpoint_model(const std::string& ckpt_dir) {
  const CheckpointState st = read_checkpoint_state(ckpt_dir);
  const Config& cfg = st.config;
  auto m = model::Transformer::full(cfg.model, static_cast<uint64_t>(cfg.train.seed));
  if (!cfg.lora.enabled()) {
    load_params(ckpt_dir, m->parameters());
    return m;
  }
  if (!st.base.empty()) load_base_weights(*m, st.base);
  m->apply_lora(cfg.lora, static_cast<uint64_t>(cfg.train.seed));
  load_params(ckpt_dir, m->trainable());
  return m;
}

void write_peft_adapter(const std::string& ckpt_dir, const std::string& out_dir) {
  const CheckpointState st = read_checkpoint_state(ckpt_dir);
  const Config& cfg = st.config;
  if (!cfg.lora.enabled()) throw InputError(ckpt_dir, "is not a LoRA run (lora.rank is 0): it has no adapters");
  auto tensors = read_checkpoint_tensors(ckpt_dir, [](const std::string& n) { return model::is_adapter_name(n); });
  const size_t want = 2 * model::lora_modules(cfg.model, cfg.lora).size();
  if (tensors.size() != want)
    throw InputError(ckpt_dir, "holds " + std::to_string(tensors.size()) + " adapter tensors, the config asks for " +
                                   std::to_string(want));
  std::vector<std::pair<std::string, model::TensorBlob>> blobs;
  for (const auto& [n, t] : tensors) blobs.emplace_back(model::peft_name(cfg.model.arch, n), model::to_blob(t));
  ensure_writable_dir(out_dir);
  model::write_safetensors(out_dir + "/adapter_model.safetensors", blobs, {{"format", "pt"}});
  const std::string base = st.base.empty() ? "alloy:seed=" + std::to_string(cfg.train.seed) : st.base;
  write_file_atomic(out_dir + "/adapter_config.json", model::peft_adapter_config(cfg.model, cfg.lora, base).dump(2) + "\n");
}

std::map<std::string, at::Tensor> read_peft_adapter(const std::string& path, const ModelConfig& m) {
  const std::string file = std::filesystem::is_directory(path) ? path + "/adapter_model.safetensors" : path;
  auto f = model::SafetensorsFile::open(file);
  std::map<std::string, at::Tensor> out;
  for (const auto& n : f.names()) {
    const std::string ours = model::from_peft_name(m.arch, n);
    if (ours.empty())
      throw InputError(file, "tensor '" + n + "' is not a LoRA adapter of a " + m.arch +
                                 " model under PEFT's names (base_model.model." + (m.arch == "gpt2" ? "transformer." : "") +
                                 "<module>.lora_A.weight)");
    out[ours] = model::read_tensor(f, n);
  }
  return out;
}

}  // namespace alloy::train
