#pragma once
// Checkpoints: one directory per saved step under RUN/checkpoints/, published atomically: every
// rank writes its shard into a hidden temporary directory, then rank 0 writes state.json, renames
// the directory into place and updates the `latest` pointer last. A crash at any moment leaves the
// previous checkpoint intact.
//
//   step_00000020/state.json     {"format": "alloy-checkpoint", "version": 2, step, consumed
//                                 samples, optimizer steps, world size, full config, plan,
//                                 "files": {NAME: {"bytes", "crc32c"}} for every other file}
//   step_00000020/model.safetensors            weights under HuggingFace names (one process), or
//   step_00000020/model-rank00003.safetensors  the parameters rank 3 owns (several processes)
//   step_00000020/optimizer[-rankN].safetensors  AdamW moments "exp_avg.NAME", "exp_avg_sq.NAME"
//                                                (a ZeRO shard's: "exp_avg.NAME@BEGIN", elements
//                                                from BEGIN of the flattened tensor) and the CPU RNG
//                                                state "rng.cpu"
//   step_00000020/gradsync-rankN.safetensors   gradient-compression state of rank N (error-feedback
//                                               residuals, DGC velocities, PowerSGD warm starts) by
//                                               holder set, with the plan's grad_sync in its metadata
// Parameters are stored by name, so a checkpoint loads into any other split of the same model.
// Every file's size and CRC32C are checked before a checkpoint is used (version 1 checkpoints have
// no list and are used unchecked); resolving a run directory skips a torn or corrupt newest
// checkpoint for the newest one that checks out, and says so.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/config.h"
#include "alloy/train/checkpoint_state.h"
#include "alloy/model/safetensors.h"
#include "alloy/model/transformer.h"
#include "alloy/train/optimizer.h"

namespace alloy::train {

// The directory name of STEP's checkpoint under RUN/checkpoints/ ("step_00000020").
std::string step_name(int64_t step);

// Collective save (train.async_checkpoint: false; see checkpoint_writer.h for the asynchronous
// one), in three phases (ranks synchronise between them):
std::string checkpoint_staging_dir(const std::string& run_dir, int64_t step);
void begin_checkpoint(const std::string& run_dir, int64_t step);  // rank 0
// Removes every staging directory a crashed run left (rank 0, before any rank saves).
void remove_stale_staging(const std::string& run_dir);
// Every rank: the parameters it owns (and their optimizer state; OPT may be null).
void write_checkpoint_shard(const std::string& staging_dir, int rank, int world_size,
                            const std::vector<const model::Param*>& params, const AdamW* opt);

// The same in two halves, for writing off the training thread: a copy of what one rank saves
// (taken between steps), and the files written from that copy (on any thread).
struct ShardSnapshot {
  int rank = 0, world_size = 1;
  std::vector<std::pair<std::string, model::TensorBlob>> model, optimizer, sync;
  std::string sync_key;  // write_sync_state's KEY; the sync file is written when SYNC is not empty
  int64_t bytes() const;
};
ShardSnapshot snapshot_shard(int rank, int world_size, const std::vector<const model::Param*>& params, const AdamW* opt);
void write_shard(const std::string& staging_dir, const ShardSnapshot& s);
std::string publish_checkpoint(const std::string& run_dir, const CheckpointState& st);  // rank 0

// Gradient-compression state of one rank: TENSORS by name ("residual/SET", ...); KEY (what the
// state belongs to: holder sets and grad_sync settings) goes into the metadata.
void write_sync_state(const std::string& staging_dir, int rank, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::string& key);
// The state rank RANK saved, if the checkpoint has it and it was saved under the same KEY; empty
// otherwise (a new layout or other settings: compression starts afresh).
std::map<std::string, at::Tensor> read_sync_state(const std::string& ckpt_dir, int rank, const std::string& key);

// Single-process save (import, tests).
std::string save_checkpoint(const std::string& run_dir, const CheckpointState& st, const model::Transformer& m,
                            const AdamW* opt);

// PATH is a checkpoint directory (used only if it checks out: InputError naming the file
// otherwise), or a run directory / its checkpoints/: then `latest`, or if that is torn or corrupt
// the newest step directory that checks out (logged).
std::string resolve_checkpoint(const std::string& path);
// Deletes all but the newest KEEP step directories under RUN/checkpoints (never the one `latest`
// names); KEEP 0 keeps all. Returns the directories deleted.
std::vector<std::string> prune_checkpoints(const std::string& run_dir, int64_t keep);
// Throws InputError listing the differing fields when the checkpoint holds another model.
void check_same_model(const std::string& ckpt_dir, const CheckpointState& st, const ModelConfig& m);
// Every tensor of the checkpoint's model shards whose name KEEP accepts, by name.
std::map<std::string, at::Tensor> read_checkpoint_tensors(const std::string& ckpt_dir,
                                                          const std::function<bool(const std::string&)>& keep);
// Copies every parameter of PARAMS from the checkpoint's shards, by name.
void load_params(const std::string& ckpt_dir, const std::vector<model::Param*>& params);
// Loads the AdamW state of OPT's parameters, by name, and the RNG state if present.
void load_optimizer(const std::string& ckpt_dir, AdamW& opt, int64_t optimizer_steps);
// All of the above for one full model.
void load_checkpoint(const std::string& ckpt_dir, model::Transformer& m, AdamW* opt);

}  // namespace alloy::train
