#pragma once
// Megatron-LM checkpoints (what Megatron-LM and SynerFuse write with --save, in the "torch" format:
// DIR/latest_checkpointed_iteration.txt and DIR/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt)
// read into Alloy's weights: every tensor-parallel piece and pipeline stage joined into the whole
// model, fused QKV and SwiGLU projections separated, under Alloy's (HuggingFace's) names.
//
// Both of Megatron's model codes are read: the legacy one (language_model.encoder.layers.N.*,
// checkpoint_version 2 and 3) and Megatron-Core's (decoder.layers.N.*, with or without Transformer
// Engine's fused norms). A GPT model with LayerNorm and learned positions becomes Alloy's gpt2, one
// with RMSNorm, rotary positions and SwiGLU its llama (grouped-query attention included). The
// optimizer state and RNG states are not read: a run starts from these weights with fresh AdamW
// moments, as Megatron's --finetune does.
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "alloy/core/config.h"

namespace alloy::model {

class Transformer;

struct MegatronCheckpoint {
  std::string dir;             // the iteration's directory (or the one .pt file)
  int64_t iteration = 0;       // -1 for a "release" checkpoint
  int tp = 1, pp = 1;          // tensor- and pipeline-parallel sizes it was saved with
  std::string code;            // "legacy" or "core"
  double version = 0;          // checkpoint_version (0 and 1 order the fused QKV rows differently)
  bool has_args = false;       // the files carried Megatron's arguments
  ModelConfig model;           // the model they describe (from args, else the one given)
  int64_t max_positions = 0;   // gpt2: rows of the position embedding
  std::vector<std::string> notes;              // where the checkpoint's model differs from Alloy's
  std::map<std::string, at::Tensor> weights;   // Alloy's names, whole tensors, the files' dtype
  std::map<std::string, std::string> origin;   // Alloy's name -> the Megatron tensor it came from
};

// Whether PATH looks like a Megatron checkpoint: a directory with latest_checkpointed_iteration.txt,
// an iteration directory holding mp_rank_* directories, or a model_optim_rng.pt file.
bool is_megatron_checkpoint(const std::string& path);

// Reads PATH (any of the above). MODEL, when given, is the model the weights are for: it must agree
// with the checkpoint's arguments (unless ONLY_WITHOUT_ARGS: then the arguments win), and stands
// for them when the files carry none. Throws InputError naming the file and tensor at fault.
// PROGRESS shows the pieces read (a 7B model's checkpoint is tens of GB).
MegatronCheckpoint read_megatron_checkpoint(const std::string& path, const ModelConfig* model = nullptr, bool only_without_args = false,
                                            bool progress = false);

// The ModelConfig Megatron's arguments (the args Namespace's fields) describe; WHERE names them in errors.
ModelConfig model_config_from_megatron_args(const std::map<std::string, std::string>& args, const std::string& where,
                                            int64_t* max_positions = nullptr, std::vector<std::string>* notes = nullptr);

// Copies C's weights into M by name, converted to M's dtype; a gpt2 position table longer than
// M's sequence keeps its first rows. Every parameter of M must be there with its shape.
void load_megatron_weights(Transformer& m, const MegatronCheckpoint& c);

}  // namespace alloy::model
