#pragma once
// Converters from other heterogeneous-training front-ends into an alloy::Plan, so that a user
// coming from SynerFuse (Megatron flags) or HeteroShard (hetero_config.json) can keep their split.
// Every converter checks the front-end's own constraints first and reports a violation in that
// front-end's vocabulary (flag names, JSON paths) with the offending values, then returns a Plan
// that already passes Plan::validate for a model with the given number of blocks.
//
// SynerFuse rank layout: Megatron's two rank orders (innermost dimension first).
//  - tp-pp-dp, under --use-tp-pp-dp-mapping (SynerFuse's heterogeneous data parallelism needs it:
//    its arguments.py gives rank r the micro-batch size of data-parallel index r / (tp*pp), so the
//    per-dp lists imply it): consecutive ranks form a pipeline; stage s of pipeline d holds ranks
//    (d*pp + s)*tp .. +tp-1, and a `n0 mbs0 n1 mbs1 ...` group list assigns mbs0 to data-parallel
//    indices 0..n0-1 (ranks 0..n0*pp*tp-1), mbs1 to the next n1 indices, and so on.
//  - tp-dp-pp, Megatron's default (run.sh without the flag): the first tp*dp ranks are stage 0 of
//    every pipeline; stage s of pipeline d holds ranks (s*dp + d)*tp .. +tp-1.
// The two differ only when both pp and dp exceed 1. Each stage is a tensor-parallel group of tp
// consecutive ranks (TP innermost in both), splitting the heads as --tp-split says (Alloy's flag;
// even by default).
// Every pipeline gets the same --hetero-pipeline-stages split, because SynerFuse cannot express
// anything else; a hand-written Alloy plan may give each pipeline its own split.
// Alloy accepts some inputs SynerFuse's own checks refuse, because each still names one valid
// plan: the two per-dp lists may group the indices differently (they are compared per index),
// --num-micro-batches-per-dp may hold more than two distinct counts or come without
// --micro-batch-size-per-dp, and --hetero-pipeline-stages may be combined with the per-dp lists.
//
// HeteroShard layout. One pipeline: shard_plan[0] must be the coordinator ("local") and becomes
// rank 0; shard_plan[k] becomes rank k, so workers are ranked in shard_plan order, not in the
// order of the "workers" list (workers the shard_plan never names get no rank).
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/plan.h"

namespace alloy {

struct SynerFuseArgs {
  int64_t num_layers = 0;                         // --num-layers
  int64_t pipeline_model_parallel_size = 1;       // --pipeline-model-parallel-size
  int64_t tensor_model_parallel_size = 1;         // --tensor-model-parallel-size: ranks per stage
  std::vector<int64_t> tp_split;                  // --tp-split h0 h1 ... (Alloy's): heads per rank of a stage; empty = even
  int64_t num_attention_heads = 0;                // the model's heads (set by the caller; 0 = only what tp_split says)
  int64_t global_batch_size = 0;                  // --global-batch-size
  int64_t micro_batch_size = 0;                   // --micro-batch-size (used when no per-dp list is given)
  int64_t data_parallel_size = 0;                 // --data-parallel-size (Alloy's); 0 = world / pp if the world
                                                  //   size is known, else the per-dp lists' group total, else 1
  int64_t world_size = 0;                         // --world-size (Alloy's); 0 = pp * dp, else must equal it
  std::vector<int64_t> hetero_pipeline_stages;    // n0 l00 l01 ... n1 l10 ...: n_i stages, then their n_i layer counts
  // --num-layers-per-virtual-pipeline-stage (Megatron's interleaved schedule): every pipeline's
  // layers in chunks of this many, chunk c on stage c mod pp (Plan's virtual stages); 0 = off.
  int64_t layers_per_virtual_stage = 0;
  std::vector<int64_t> micro_batch_size_per_dp;   // n0 mbs0 n1 mbs1 ...
  std::vector<int64_t> num_micro_batches_per_dp;  // n0 nmb0 n1 nmb1 ...
  bool tp_pp_dp_mapping = false;                  // --use-tp-pp-dp-mapping (the per-dp lists imply it)
  bool sequence_parallel = false;                 // --sequence-parallel: its tensor-parallel stages run sequence parallel
  std::string schedule = "1f1b";                  // not a Megatron flag; set by the caller
};

// Parses a SynerFuse/Megatron-style argument list, e.g.
//   {"--num-layers", "8", "--pipeline-model-parallel-size", "2", "--hetero-pipeline-stages", "1", "6", "1", "2"}.
// Accepts "--flag value" and "--flag=value". Multi-value flags take every following token up to the
// next one starting with "--" (so "-3" is read as a value, and then rejected as non-positive by
// plan_from_synerfuse). --data-parallel-size and --world-size are Alloy's own (Megatron takes them
// from torchrun). Megatron's model and training flags (megatron_args.h) are skipped with their
// values, and named in IGNORED when given: a plan does not depend on them.
// A repeated flag keeps its last value, as argparse does. Unknown flags, stray values and
// non-integers throw InputError naming the token.
SynerFuseArgs parse_synerfuse_args(const std::vector<std::string>& argv, std::vector<std::string>* ignored = nullptr);

// Checks SynerFuse's constraints (stage counts sum to --pipeline-model-parallel-size, layer counts
// sum to --num-layers, per-dp group sizes sum to the data-parallel size, global batch =
// sum n_i * mbs_i * nmb_i, ...) and builds the pipeline-major plan described above. Without
// --hetero-pipeline-stages the layers are split evenly, which, as in Megatron, requires
// pp to divide --num-layers. The micro-batch count per data-parallel index is, in order of
// preference: the --num-micro-batches-per-dp list; global / sum(n_i * mbs_i) when only
// --micro-batch-size-per-dp is given; global / (dp * --micro-batch-size) otherwise. Stage devices
// are left empty.
Plan plan_from_synerfuse(const SynerFuseArgs& a);

// Converts a parsed hetero_config.json. WHERE (usually the file's path) prefixes every error,
// followed by the JSON path at fault. num_layers <= 0 means "whatever the shard_plan covers"
// (the last stage's end); otherwise the plan must cover exactly [0, num_layers). The pipeline uses
// micro_batch for its micro-batch size and global_batch / micro_batch micro-batches, which must
// divide exactly. Shard ids are compared with worker ids by value, so 1 and "1" match. Each stage's
// device is the hostname of its worker, or the coordinator's for "local" (empty when absent).
Plan plan_from_hetero_config(const nlohmann::json& j, int64_t num_layers, int64_t global_batch, int64_t micro_batch,
                             const std::string& where);
Plan plan_from_hetero_config_file(const std::string& path, int64_t num_layers, int64_t global_batch,
                                  int64_t micro_batch);

// The rest of a HeteroShard hetero_config.json, what a run does besides the layout:
//   training.visualize / visualization_format (png | svg | pdf | mmd): draw the plan when training starts
//   training.log_level (Python's names: DEBUG, INFO, WARNING, ERROR, CRITICAL): the run's log level
//   checkpoint_dir: the run directory (checkpoints under it); resume_step: resume from that step there
//   coordinator.device / workers[i].device (auto | cuda | cuda:N | mps | cpu): each stage's device
//   lora {r, lora_alpha, lora_dropout, target_modules, load_in_4bit, load_in_8bit,
//         bnb_4bit_use_double_quant} (PEFT's and bitsandbytes' names): LoRA over a quantized base
// Every field is optional; one of the wrong type or value is an InputError naming the file and field.
struct HeteroShardRun {
  bool visualize = true;  // HeteroShard draws architecture.png when training starts unless told not to
  std::string visualization_format = "png";
  std::string log_level;  // "" = not given
  std::string checkpoint_dir;
  int64_t resume_step = -1;                 // -1: start fresh
  std::vector<std::string> stage_devices;   // per shard_plan entry (= rank); "" = not given
  // Per shard_plan entry (= rank): the hostname and ip its machine is known by (the coordinator's
  // for rank 0), for finding this process's role when every machine runs the same command.
  std::vector<std::vector<std::string>> stage_addresses;
  std::string coordinator_address;          // its ip, else its hostname; "" = not given
  std::vector<std::string> config_overrides;  // "lora.rank=8", ... (applied before the user's --set)
};
HeteroShardRun hetero_run_settings(const nlohmann::json& j, const std::string& where);
HeteroShardRun hetero_run_settings_file(const std::string& path);

// The micro-batch size to assume when neither --micro-batch-size nor train.micro_batch says: the
// whole per-replica share of the global batch (one micro-batch per replica without pipelining,
// and one micro-batch per pipeline stage with it, so a pipeline is never left with a single
// micro-batch). WORLD_SIZE 0 = take the data-parallel size from the flags.
int64_t default_micro_batch(const Config& cfg, const SynerFuseArgs& a, int64_t world_size);

}  // namespace alloy
