#pragma once
// Checkpoints: one directory per saved step under OUTPUT/checkpoints/, published atomically
// (written as a temporary directory, every file fsynced, then renamed) with a `latest` pointer
// file updated last, so a crash at any moment leaves the previous checkpoint intact.
//
//   step_00000020/state.json          {"format": "alloy-checkpoint", "version": 1, step, consumed
//                                      samples, optimizer steps, full config}
//   step_00000020/model.safetensors   weights under HuggingFace names
//   step_00000020/optimizer.safetensors  AdamW moments ("exp_avg.NAME", "exp_avg_sq.NAME") and the
//                                      CPU RNG state ("rng.cpu")
#include <optional>
#include <string>

#include "alloy/core/config.h"
#include "alloy/model/transformer.h"
#include "alloy/train/optimizer.h"

namespace alloy::train {

inline constexpr const char* kCheckpointFormat = "alloy-checkpoint";
inline constexpr int kCheckpointVersion = 1;

struct CheckpointState {
  int64_t step = 0;              // optimizer steps completed
  uint64_t consumed_samples = 0; // position in the sample stream
  int64_t optimizer_steps = 0;
  Config config;
};

// Saves into DIR/checkpoints/step_XXXXXXXX and points DIR/checkpoints/latest at it. Returns the
// checkpoint directory. OPT may be null (weights only, e.g. `alloy import`).
std::string save_checkpoint(const std::string& run_dir, const CheckpointState& st, const model::Transformer& m,
                            const AdamW* opt);

// PATH is a checkpoint directory, or a run directory / its checkpoints/ (then `latest` is used).
std::string resolve_checkpoint(const std::string& path);
// Reads and validates state.json; throws InputError naming the file and field.
CheckpointState read_checkpoint_state(const std::string& ckpt_dir);
// Loads weights (and optimizer state and RNG if OPT is given) after checking the checkpoint's
// model config equals M's; a different model is an error listing the differing fields.
void load_checkpoint(const std::string& ckpt_dir, model::Transformer& m, AdamW* opt);

}  // namespace alloy::train
