#pragma once
// Fine-tuning's outside edges: where a run's base weights come from (--init-from), a LoRA
// checkpoint back as a model, and adapters in PEFT's layout (OUTPUT/adapter/: adapter_model.safetensors
// under PEFT's names and adapter_config.json), so a PEFT user loads them unchanged.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "alloy/core/config.h"
#include "alloy/model/transformer.h"

namespace alloy::train {

// Copies the base weights M holds (a slice: only its own) from SRC: a safetensors file (ours or
// HuggingFace's) or a checkpoint / run directory of the same model. Call before LoRA is applied.
// NOTES, when given, receives what the caller should tell the user about the source (a Megatron
// checkpoint's differences from Alloy's model).
void load_base_weights(model::Transformer& m, const std::string& src, std::vector<std::string>* notes = nullptr);

// The full model a checkpoint holds: its weights, or for a LoRA run its base (re-read from where the
// run took it, or drawn from its seed) with its adapters.
std::unique_ptr<model::Transformer> load_checkpoint_model(const std::string& ckpt_dir);

// OUT_DIR/adapter_model.safetensors (a LoRA checkpoint's adapters under PEFT's names) and
// OUT_DIR/adapter_config.json (base_model_name_or_path: the run's --init-from).
void write_peft_adapter(const std::string& ckpt_dir, const std::string& out_dir);
// The adapters of a PEFT adapter directory (or adapter_model.safetensors), under our names;
// every tensor must be an adapter under PEFT's names for M's arch.
std::map<std::string, at::Tensor> read_peft_adapter(const std::string& path, const ModelConfig& m);

}  // namespace alloy::train
