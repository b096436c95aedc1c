#pragma once
// The Plan: exactly which rank holds which blocks, with which micro-batch size and count, on which
// schedule, with which gradient sync. The runtime executes Plans and nothing else; they are
// written by hand, converted from SynerFuse flags or a HeteroShard shard_plan, or produced by the
// planner.
//
// Invariants (validate() checks them and names the offending field and values):
//  - sum over pipelines of samples() == global_batch (micro_batch_size x num_micro_batches, less
//    what a short last micro-batch leaves out)
//  - every pipeline's stages cover blocks [0, model.layers) contiguously, in order, none empty;
//    a boundary may fall inside a block, between its attention and its MLP half (units below);
//    two neighbouring stages may share one unit when the first has a float_share (a floating
//    boundary, below), and every stage still runs at least one unit of every micro-batch
//  - every rank 0..world-1 appears in exactly one stage of one pipeline
//  - a stage with several ranks is a tensor-parallel group: tp_split gives each rank's attention
//    heads (empty: even), summing to model.heads; MLP columns follow the same ratio, GQA key/value
//    heads too (each rank's heads must cover whole key/value groups)
//  - grad_sync's fields are valid (GradSyncConfig::validate); slow_links name ranks of the plan
// Layer indices count transformer blocks; the embedding lives with the stage holding block 0 and
// the head (final norm, logits, loss) with the stage holding the last block, as in Megatron.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/config.h"

namespace alloy {

struct StagePlan {
  std::vector<int> ranks;
  int64_t layer_begin = 0, layer_end = 0;  // blocks [begin, end)
  std::string device;                      // optional: device name from the cluster spec
  bool recompute = false;                  // blocks recompute activations in the backward (version 2)
  // Half-block boundaries (plan version 3): the stage starts with block layer_begin's MLP half
  // (the previous stage ran its attention half) / ends after block layer_end - 1's attention half.
  // layer_begin and layer_end always name every block the stage touches. In units (half blocks:
  // unit 2b is block b's attention and residual add, 2b + 1 its MLP and residual add) the stage
  // holds [unit_begin(), unit_end()).
  bool from_mlp = false, to_attention = false;
  int64_t unit_begin() const { return 2 * layer_begin + (from_mlp ? 1 : 0); }
  int64_t unit_end() const { return 2 * layer_end - (to_attention ? 1 : 0); }
  bool splits_block() const { return from_mlp || to_attention; }
  void set_units(int64_t begin, int64_t end);
  double blocks() const { return static_cast<double>(unit_end() - unit_begin()) / 2.0; }
  // Tensor parallelism (plan version 4): with several RANKS, the attention heads each holds, in
  // rank order (empty: split evenly). tp_heads resolves it; tp_bounds gives the head boundaries
  // (0, h0, h0 + h1, ..., heads).
  std::vector<int64_t> tp_split;
  std::vector<std::string> devices;  // optional: each rank's device (DEVICE is the first's)
  // A floating boundary (plan version 5): this stage and the next both hold the unit where they
  // meet (this stage's last, the next's first), and this stage runs it for FLOAT_SHARE of the
  // micro-batches (the next stage for the rest), spread evenly (PipelinePlan::cut). The average
  // split then moves in steps of 1/M of a half block, where whole units allow only 3 : 1 or
  // 2.5 : 1.5 between a 0.4 and a 0.2 device that want 2.67 : 1.33. The shared unit's gradients
  // are summed over its two holders by the holder-set sync, as for replicas. 0: no float.
  double float_share = 0;
  bool floats() const { return float_share > 0; }
  // A boundary inside an MLP (plan version 8): this stage and the next both hold the MLP half where
  // they meet (this stage's last unit, the next's first), split by columns: this stage computes
  // the columns of heads [0, MLP_CUT) (the MLP's columns go in the heads' ratio, as under tensor
  // parallelism), the next stage the rest, in every micro-batch. The message across then carries
  // the residual stream and this stage's partial MLP output side by side (twice a hidden state),
  // and their gradients back; the next stage adds the two, the MLP's output bias and the residual.
  // Unlike a float, both stages run their share of every micro-batch (no lockstep on the heavier
  // side), and only the norm is held by both; the split parameters are pieces (model/
  // tensor_parallel.h), each with its own holders. 0: no cut.
  int64_t mlp_cut = 0;
  bool cuts_mlp() const { return mlp_cut > 0; }
  // Sequence parallelism for this tensor-parallel stage (plan version 7; train.sequence_parallel
  // turns it on for every such stage): between its products each member holds its share of the
  // positions, in the heads' ratio. The planner sets it where the group fits memory only with it.
  bool sequence_parallel = false;
  int tp() const { return static_cast<int>(ranks.size()); }
  std::vector<int64_t> tp_heads(int64_t heads) const;
  std::vector<int64_t> tp_bounds(int64_t heads) const;
  // Sequence parallelism: the boundaries of each member's positions of SEQ_LEN, in the heads'
  // ratio (a member may get none; Plan::validate and Plan::training_problem refuse that).
  std::vector<int64_t> sequence_bounds(int64_t heads, int64_t seq_len) const { return positions_by_heads(tp_bounds(heads), seq_len); }
  static std::vector<int64_t> positions_by_heads(const std::vector<int64_t>& head_bounds, int64_t seq_len);
  // The first member BOUNDS (positions_by_heads's) give no position, or -1 when each has some.
  static int member_without_positions(const std::vector<int64_t>& bounds);
};

// Why SPLIT (heads per rank) cannot divide MODEL's attention heads, MLP columns and key/value
// heads exactly, with a split that would work; empty when it can.
std::string tp_split_problem(const ModelConfig& model, const std::vector<int64_t>& split);
// The most even split of MODEL's heads over N ranks that divides exactly (each rank a whole number
// of key/value groups); empty when there is none.
std::vector<int64_t> even_tp_split(const ModelConfig& model, int n);

struct PipelinePlan {
  int64_t micro_batch_size = 1;
  int64_t num_micro_batches = 1;
  std::vector<StagePlan> stages;
  // This pipeline's own schedule (plan version 6); empty: the plan's. Pipelines of one plan differ
  // in depth and balance, so the schedule that hides one's bubble best may not suit another's
  // (a split backward pays off on an uneven pipeline bounding the step, and only there).
  std::string schedule;
  // A short last micro-batch (plan version 9): the last of the num_micro_batches has this many
  // samples, 1 <= last < micro_batch_size; 0: as many as the others. Replicas of unlike devices
  // then take any number of samples while every other micro-batch keeps the efficient size: on
  // the 3-device pool 57 / 26 / 13 samples in micro-batches of 6 where whole micro-batches allow
  // only 60 / 24 / 12 (or smaller, slower micro-batches). Every micro-batch's loss is divided by
  // the global batch's tokens, so the sum is the same gradient however the samples are cut.
  int64_t last_micro_batch_size = 0;
  int64_t last_size() const { return last_micro_batch_size > 0 ? last_micro_batch_size : micro_batch_size; }
  bool short_last() const { return last_micro_batch_size > 0 && last_micro_batch_size != micro_batch_size; }
  // SAMPLES in micro-batches of M, the last one short when M does not divide them.
  void set_samples(int64_t samples, int64_t m);
  // "6 x 10", or "6 x 10 (the last of 3)".
  std::string batch_text() const;
  int64_t samples() const { return micro_batch_size * (num_micro_batches - 1) + last_size(); }
  // The micro-batch size for SAMPLES when train.rebalance moves samples: a pipeline planned as one
  // micro-batch stays one (a replica's buckets then sum during its whole backward, not only its last
  // micro-batch's: 28 samples becoming 28 + 1 would leave the sum almost nothing to hide behind);
  // the others keep their size, the last micro-batch short.
  int64_t micro_batch_for(int64_t samples) const { return num_micro_batches == 1 ? std::max<int64_t>(samples, 1) : micro_batch_size; }
  // Interleaved virtual stages (plan version 10, schedule "interleaved-1f1b"): STAGES lists the
  // pipeline's S x V chunks in layer order, and chunk c runs on the ranks of chunk c mod S, so each
  // rank holds V chunks spread through the model (pipeline/schedule.h, interleaved_one_f_one_b).
  // 1: every stage is a rank's only chunk.
  int64_t virtual_stages = 1;
  bool interleaved() const { return virtual_stages > 1; }
  // The ranks' positions: S, the stages listed over V.
  int64_t depth() const { return static_cast<int64_t>(stages.size()) / std::max<int64_t>(virtual_stages, 1); }
  bool has_tensor_parallel() const;  // a stage with several ranks
  // The unit where micro-batch MB passes from stage S to S + 1: the stages' own boundary, or, for
  // a floating one, the shared unit's end in round(float_share x M) of the M micro-batches (those
  // where the running count steps up, so they spread evenly) and its begin in the others.
  int64_t cut(size_t s, int64_t mb) const;
  // The units stage S runs for micro-batch MB: [cut(S - 1, MB), cut(S, MB)), from 0 / to the end.
  std::pair<int64_t, int64_t> units_of(size_t s, int64_t mb) const;
  bool floats() const;
  bool cuts_mlp() const;  // a stage ends inside an MLP (StagePlan::mlp_cut)
  // The width of what stage S sends to S + 1 (and receives back as its gradient): HIDDEN, or twice
  // it across a cut MLP.
  int64_t message_width(size_t s, int64_t hidden) const { return stages.at(s).cuts_mlp() ? 2 * hidden : hidden; }
  // How many micro-batches stage S runs its floating end unit for.
  int64_t float_count(size_t s) const;
};

// Sharded data parallelism (ZeRO, dist/sharding.h) of one holder set: the ranks holding the same
// parameters, sorted; stage 0 (full replicas), 1 (optimizer state) or 2 (gradients too); each
// member's share of the set's flat buffer, in rank order (empty: even). Sets without an entry take
// train.zero_stage / train.shard_ratio.
struct ShardingPlan {
  std::vector<int> ranks;
  int64_t stage = 0;
  std::vector<double> shares;
};

struct Plan {
  int64_t global_batch = 0;
  std::string schedule = "1f1b";  // 1f1b | eager-1f1b | gpipe | zb-h1 (pipeline/schedule.h); per pipeline below
  std::vector<PipelinePlan> pipelines;
  // The schedule pipeline P runs: its own, or the plan's.
  const std::string& schedule_of(size_t p) const;
  // The plan's schedule with the pipelines that run another: "1f1b" or "1f1b (pipeline 1 zb-h1)".
  std::string schedules_text() const;
  GradSyncConfig grad_sync;  // bucket size, compression; what the runtime does
  // Pairs of ranks (a < b) whose direct link is slow: with grad_sync.scope slow-links, the ranks of
  // a holder set joined by fast links sync exactly among themselves and compress what crosses.
  // Filled from the cluster when the plan is made or resolved (plan/sync_scope.h).
  std::vector<std::pair<int, int>> slow_links;
  std::vector<ShardingPlan> sharding;  // per holder set; written as plan version 2
  const ShardingPlan* sharding_of(const std::vector<int>& ranks) const;
  nlohmann::json predicted;  // filled by the planner; informational

  int world_size() const;
  // Where a rank sits (in an interleaved pipeline: its first chunk, which is its position 0..S-1
  // among the ranks); throws if the rank is not in the plan.
  struct Position {
    int pipeline = -1, stage = -1;
    int tp_rank = 0;  // index among the stage's ranks (tensor parallelism)
  };
  Position locate(int rank) const;
  // The entries of its pipeline's stages that RANK runs: {its stage} unless the pipeline is
  // interleaved, then its V chunks in layer order.
  std::vector<int> chunks_of(int rank) const;
  // Why RANKS do not run the same schedule (the same blocks at the same stage position of
  // pipelines with as many stages and micro-batches), naming two that differ; empty when they do.
  // ZeRO-3 needs it: every member issues the same per-layer gathers in the same order.
  std::string schedule_mismatch(const std::vector<int>& ranks) const;
  // First sample of pipeline P within each global batch (pipelines take consecutive slices).
  int64_t sample_offset(int pipeline) const;

  // Throws InputError (WHERE names the plan's source) on any broken invariant.
  void validate(const ModelConfig& model, const std::string& where = "plan") const;

  nlohmann::json to_json() const;
  static Plan from_json(const nlohmann::json& j, const std::string& where);
  static Plan load(const std::string& path);
  void save(const std::string& path) const;  // atomic
  bool has_tensor_parallel() const;
  bool cuts_mlp() const;
  // Some rank stores parameters as pieces (tensor parallelism or a cut MLP): every rank then
  // builds its slice from dist::tp_layout.
  bool has_pieces() const { return has_tensor_parallel() || cuts_mlp(); }
  // train.sequence_parallel: every tensor-parallel stage runs sequence parallel, so the cost model
  // prices a plan as the trainer will run it.
  void set_sequence_parallel();
  // Why CFG's training cannot run on this plan, known before any rank starts (LoRA adapters on
  // tensor-parallel stages); empty when it can. The trainer and `alloy sweep` both ask.
  std::string training_problem(const Config& cfg) const;
  // One line per pipeline, e.g. "pipeline 0: 6 x 4 samples | rank 0 blocks [0,6) -> rank 1 [6,8)".
  std::string describe() const;

  // One device, the whole model: what `alloy train` runs without a plan.
  static Plan single_device(const Config& cfg);
  // Data parallelism only: one single-stage pipeline per entry of (micro_batch_size, count).
  static Plan data_parallel(int64_t num_layers, const std::vector<std::pair<int64_t, int64_t>>& mbs_nmb,
                            const std::string& schedule = "1f1b");
};

}  // namespace alloy
