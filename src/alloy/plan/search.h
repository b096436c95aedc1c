#pragma once
// The planner: which devices form each data-parallel replica (pipeline), in which stage order,
// which blocks each stage holds, how many samples each replica takes and in micro-batches of
// which size, and which schedule, so that simulate_plan's step time is smallest and every rank
// fits in memory.
//
// THE SEARCH SPACE (search() and exhaustive() enumerate exactly this; plans outside it are never
// proposed, and "optimal" means optimal within it):
//  - replicas: any partition of the cluster's devices into non-empty sets; every device is used,
//    exactly once, as its own rank: stage.ranks = {device index}, stage.device = device name;
//  - stage order: any permutation of a replica's devices (a replica has at most model.layers
//    devices, since every stage holds >= 1 block);
//  - layer split: any contiguous split of the blocks with >= 1 block per stage;
//  - batch: replica r takes b_r >= 1 samples, sum b_r = global_batch, in micro-batches of a size
//    m_r from SearchOptions' candidate sizes that divides b_r (num_micro_batches = b_r / m_r);
//  - schedule: one of SearchOptions::schedules, for the whole plan (refine_schedules, after the
//    search, may then give single pipelines another);
//  - gradient sync: SearchOptions::grad_sync (bucket size, compression, scope), fixed.
// Feasible: every rank fits its device's memory. Objective: simulate_plan(plan).step_s.
// Devices with the same type, host and memory are interchangeable under the cost model (the sync
// ring runs in host order), which the exact search exploits.
//
// STRATEGIES
//  - "alloy" (default): exact when the space is small (at most exact_limit replica/order/split
//    configurations, and configurations x (global_batch+1)^2 <= 256 x exact_limit for the batch
//    DP): branch and bound over the space modulo interchangeable devices, the batch split solved
//    exactly per configuration (min-max DP over replicas). Beyond: heuristics (see search.cpp):
//    replicas from device groupings (locality, stage-major across hosts/regions, folded
//    stage-major, type-homogeneous, speed-balanced) at each pipeline depth, layer splits by a
//    min-max DP on per-stage compute, batch by a throughput-proportional start refined by greedy
//    min-max moves, then local search on layer boundaries within time_budget_s. The baselines'
//    plans are seeds, so alloy is never predicted slower than them.
//  - "uniform" (Megatron/DeepSpeed): equal layers per stage, equal batch per replica. Pure data
//    parallelism if the model fits every device, else the smallest equal depth d (d divides the
//    device count) whose pipelines of consecutive devices fit.
//  - "proportional" (SynerFuse ITD-like): uniform's replicas, but layers within a pipeline and
//    samples across replicas proportional to measured device speed.
//  - "ptafm" (PTAFM-style): hosts (data centres) grouped into K stages by longest-processing-time
//    balancing of compute power (the profile's speed) then deterministic move/swap improvement of
//    PTAFM's cost 1*DP + 2*PP + 5*balance; stage groups chained in the order of cheapest links;
//    each replica takes a share of every stage group; layers and samples by power.
// Every strategy throws InputError, saying what does not fit and by how much, when the global
// batch cannot be split, the model does not fit the pool, or no plan of the strategy fits.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/plan.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/profile.h"

namespace alloy::plan {

// A schedule that splits the backward (zb-h1) is kept only when predicted at least this much
// faster than the best plan on the others (SearchOptions::split_schedule_min_gain): on the demo's
// pool the model put zb-h1 0.7% ahead of 1F1B and it measured 2.5-5% behind (docs/DESIGN.md).
constexpr double kSplitScheduleMinGain = 0.05;
// A device is noted as slowing the step (SearchOptions::suggest_leaving_out) when the pool without
// it is predicted at least this much faster, on pools of at most kLeaveOutMaxDevices (one search each).
constexpr double kLeaveOutMinGain = 0.05;
constexpr int kLeaveOutMaxDevices = 8;
// The planner notes a larger global batch (SearchOptions::suggest_larger_batch) when twice the
// batch is predicted to train at least this much more samples per second.
constexpr double kLargerBatchMinGain = 0.05;

struct SearchOptions {
  std::string strategy = "alloy";  // alloy | uniform | proportional | ptafm
  int64_t global_batch = 0;        // required
  double time_budget_s = 1.0;      // heuristic local search stops here; the exact search runs to the end
  std::vector<std::string> schedules = pipeline::schedule_names();  // all of them
  // A split-backward schedule's plan must be predicted this much faster than the best plan on the
  // other schedules to be chosen (kSplitScheduleMinGain); 0: the fastest predicted, whatever it is.
  double split_schedule_min_gain = kSplitScheduleMinGain;
  int64_t max_micro_batch = 8;
  std::vector<int64_t> micro_batch_sizes;  // candidate sizes; empty: powers of two and 3 x powers of two up to max_micro_batch
  GradSyncConfig grad_sync;  // bucket size, compression and its scope: fixed, as the cost model prices them
  int ptafm_stages = 0;  // PTAFM's NUM_STAGE; 0: the fewest stages whose plan fits
  // The alloy strategy is exact when the space has at most this many (partition, order, split)
  // configurations per schedule, counted before removing interchangeable devices.
  double exact_limit = 2e6;
  // Memory-poor devices (plan/fit_memory.h): where a device's memory_gb is known, the alloy
  // strategy also searches the layouts that fit only with sharding or recomputation, gives the
  // best of them the cheapest sharding/recomputation that fits, and keeps it when it is faster
  // than the best plan of full replicas (or when that does not exist).
  bool fit_memory = true;
  // Internal (set by search() for that second search): memory checked against what sharding and
  // recomputation could at best bring it down to (CostContext::memory_floor_bytes).
  bool memory_relief = false;
  // make_plan refines the alloy strategy's plan with boundaries inside blocks (refine_units).
  bool split_blocks = true;
  // ... and with floating boundaries (PipelinePlan::cut: two stages share a half block, each
  // running it for part of the micro-batches) where the model predicts a gain.
  bool float_boundaries = true;
  // ... and with boundaries inside an MLP, split by columns (StagePlan::mlp_cut) where the model
  // predicts a gain.
  bool mlp_cuts = true;
  // make_plan tries interleaving pipelines' ranks into virtual stages (consider_interleaving).
  bool interleave = true;
  // Batch splits may end a pipeline with a short micro-batch (PipelinePlan::last_micro_batch_size):
  // in the rebalance (calibrate.h) and consider_short_micro_batches.
  bool short_micro_batches = true;
  // make_plan tries groups of devices as tensor-parallel stages (consider_tensor_parallel).
  bool tensor_parallel = true;
  // make_plan (alloy strategy, pools of at most kLeaveOutMaxDevices) also plans the pool without
  // each device in turn and notes the device whose absence is predicted at least kLeaveOutMinGain
  // faster: the run itself uses every device.
  bool suggest_leaving_out = true;
  // make_plan (alloy strategy) also plans twice the global batch and notes it where the pool would
  // train at least kLargerBatchMinGain more samples per second: the bubble, the gradient sums and
  // the optimizer cost the same per step whatever the batch. The run keeps the batch it was given
  // (a batch is an optimisation choice, not the planner's).
  bool suggest_larger_batch = true;
  // train.sequence_parallel: every tensor-parallel stage the planner makes runs sequence parallel
  // (and is priced so). Without it, the planner turns it on for a group that fits memory only with it.
  bool sequence_parallel = false;

  std::vector<int64_t> candidate_micro_batches() const;  // sorted ascending, validated
};

struct SearchResult {
  Plan plan;
  PlanCost cost;
  std::string strategy;
  int64_t candidates_evaluated = 0;  // full plans whose step time was computed
  double search_s = 0;
  bool exact = false;  // the plan is optimal within the search space
  double search_step_s = 0;  // the step time the search computed; equals cost.step_s (checked by tests)
  std::vector<std::string> notes;
  nlohmann::json to_json() const;
};

SearchResult search(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// Smaller gradient buckets start the late layers' all-reduces while the backward still runs, at
// one latency per extra collective. Re-simulates RESULT's plan with bucket caps from its own down
// to 1 MiB and keeps the fastest when it gains over 0.2%, noting the change. Applied after the
// search, so search() stays comparable with exhaustive() at a fixed cap.
void tune_buckets(SearchResult& result, const ClusterSpec& cluster, const Profile& profile);

// Pipeline boundaries inside blocks, between a block's attention and MLP halves: from RESULT's
// plan (whole blocks), moves one boundary by half a block at a time while simulate_plan predicts
// a gain over 0.2%, and notes the change. This is how a stage comes to hold 2.5 blocks, so that a
// small model splits between unlike devices as their speeds ask. Plans with sharding entries are
// left as they are (their entries name holder sets, which such a move changes). Applied after
// the search (search() itself stays whole-block, comparable with exhaustive()) when
// SearchOptions::split_blocks is on.
// The batch split is re-chosen for each move (calibrate.h's rebalance, among OPTIONS' micro-batch
// sizes), since a pipeline whose stages balance better may take more of the batch.
// Then, with SearchOptions::float_boundaries, floating boundaries the same way: a boundary's
// neighbouring half block held by both stages and run by the first in k of the M micro-batches
// (StagePlan::float_share), each share k = 1..M-1 priced, so a 0.4 and a 0.2 device can split
// 2.67 : 1.33 where half blocks allow 3 : 1 or 2.5 : 1.5.
// Floating boundaries are kept only when predicted at least kFloatMinGain faster than the best
// plan without them: on the emulated two-region pool their step ran 5-13% over the model's
// prediction, against 4-5% for the same pool's fixed boundaries (the cause is not modelled yet;
// the stage that takes the shared unit in some micro-batches computed more than predicted).
constexpr double kFloatMinGain = 0.05;
// Before the floats, with SearchOptions::mlp_cuts: a boundary moved inside the MLP half next to
// it, the first stage computing the columns of k of the model's heads (StagePlan::mlp_cut), each
// k = 1..heads-1 priced with the batch re-split, greedily per boundary as above; kept for a gain
// over 0.2% like the half-block moves. Both stages run their share of every micro-batch, so a
// 0.4 and a 0.2 device split 2.7 : 1.3 blocks of the demo's model (6 heads) without a float's
// per-micro-batch imbalance. Kept only when predicted at least kMlpCutMinGain faster than the best
// plan without it: a cut is chosen to balance its two stages, and balanced 1F1B stages wait on
// each other's per-micro-batch noise, which the model does not price (bench/cut_bench.py on
// examples/cluster-2dev-pipeline.yaml: predicted 2.3% faster, measured 0.5% slower, the faster
// stage's idle share rising 3% -> 7-13% as the slower's fell 36% -> 13-19%).
constexpr double kMlpCutMinGain = 0.05;
void refine_units(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// CAND priced by simulate_plan, with its batch re-split among its pipelines (calibrate.h's
// rebalance, for up to four pipelines) when that is faster: CAND becomes the re-split plan then.
// The refinement phases price their moves with it, since a pipeline made faster may take more of
// the batch.
// RESULT takes PLAN, priced COST, as its plan (cost, prediction and search step with it), keeping
// the strategy its plan's prediction names: how the refinement phases hand back what they found.
void adopt_plan(SearchResult& result, Plan plan, const PlanCost& cost);
PlanCost priced_rebalanced(Plan& cand, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// Short last micro-batches: RESULT's plan with its batch re-split where a pipeline may end with a
// short micro-batch (priced_rebalanced), and, where it has a pipeline of several stages and one rank
// per device, the plan with every device a replica, split the same way. Whole micro-batches move
// a replica's samples in steps of a micro-batch, so on the 3-device pool three replicas could take
// only 60 / 24 / 12 samples in micro-batches of 6 (the quarter idle) or smaller, slower
// micro-batches, and a half/quarter pipeline won by 0.1%; with 57 / 26 / 13 they are predicted
// 2.8% faster than that pipeline. The re-split is kept for a gain over 0.2%, the other layout for
// kShortSplitLayoutMinGain, both layouts priced with their buckets tuned (tune_buckets, which
// make_plan applies next).
// Pools of up to kShortSplitUpTo pipelines (the rebalance's limit). Applied by make_plan after
// refine_schedules, with SearchOptions::short_micro_batches.
constexpr size_t kShortSplitUpTo = 4;
constexpr double kShortSplitLayoutMinGain = 0.01;
void consider_short_micro_batches(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// Schedules per pipeline (PipelinePlan::schedule): from RESULT's plan, greedily gives one
// pipeline of two or more stages another of OPTIONS' schedules while that is predicted faster
// (with the batch re-split), by over 0.2%, or by split_schedule_min_gain for a schedule that
// splits the backward where the pipeline's did not (the margin search() asks of a plan-wide
// split). A split backward pays off on an uneven pipeline that bounds the step; on a replica
// beside it, it only delays that replica's gradients. Skips what the runtime refuses: split
// backwards on tensor-parallel pipelines or on ranks sharded with ZeRO-3. Notes each change.
// Applied by make_plan after refine_units.
void refine_schedules(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// Interleaved virtual stages (PipelinePlan::virtual_stages, schedule interleaved-1f1b): for each
// pipeline of RESULT's plan with two or more ranks, one rank a stage and whole units (no floats,
// cut MLPs or ZeRO), and as many micro-batches as a multiple of its ranks or at most as many, V =
// 2 to kMaxVirtualStages chunks a rank: each rank's units spread over its chunks in the plan's own
// proportions, then each boundary moved a unit either way while that is predicted faster. Kept
// where predicted at least kInterleaveMinGain faster (each chunk's messages cost CPU time and a
// crossing; the margin of a split backward, which the model also prices closely); noted. Applied
// by make_plan after consider_tensor_parallel, with SearchOptions::interleave.
constexpr int64_t kMaxVirtualStages = 4;
constexpr double kInterleaveMinGain = 0.05;
void consider_interleaving(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// Where RESULT's plan runs eager 1F1B on some pipeline, notes what the same plan is predicted to
// take on plain 1F1B there: the extra micro-batch of activations per stage is paid for by that
// difference alone (make_plan adds it once the plan is final).
void note_eager_schedule(SearchResult& result, const ClusterSpec& cluster, const Profile& profile);

// For the tensor-parallel phase (consider_tensor_parallel), whose composite search runs no split
// backward: RESULT's plan with its tensor-parallel stages on zb-h1 (where OPTIONS allow it) when
// that clears the split schedule's margin, then refine_schedules per pipeline.
void split_tensor_parallel_backward(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// Tensor parallelism: groups of 2 to 4 devices (pools of up to kTensorParallelMaxDevices; those
// joined by the fastest links first, at most kTensorParallelMaxGroups of them, within the time
// budget) each tried as one tensor-parallel stage. For a group, the whole search runs on the pool
// with the group as one composite device (its members' combined speed, as if its heads split
// in proportion to their speeds, plus the group's sums on its links per block; embedding and head
// at its slowest member's speed, since every member computes them); the composite's stages then
// become tensor-parallel stages with the valid head splits nearest the speeds, each priced by
// simulate_plan on the real pool. Then several groups at once, greedily: from the best group,
// each disjoint group that gave a plan alone is added in turn and kept where the plan with it is
// predicted faster (a group inside each host, a pipeline across the hosts' links, found rather
// than asked for). RESULT's plan is replaced when the best is predicted more than
// kTensorParallelMinGain faster; either way a note says what the best group predicted. A group
// spanning a thin link pays for its sums there and loses to pipelines, which send one activation
// per micro-batch instead of four sums per block. A candidate whose groups do not fit memory is
// tried again with sequence parallelism on them (their activations split by position too), which
// costs more exchanges; SearchOptions::sequence_parallel puts it on every group. Applied by
// make_plan after refine_units and tune_buckets when SearchOptions::tensor_parallel is on. A plan
// that fits only with sharding (ZeRO, recomputation) is compared like any other: a group that fits
// without it and is predicted faster replaces it.
constexpr int kTensorParallelMaxDevices = 8;
constexpr int kTensorParallelMaxGroups = 24;
constexpr double kTensorParallelMinGain = 0.02;
void consider_tensor_parallel(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// The reference: walks every configuration of the search space (every set partition, every
// permutation, every split, every schedule; for each, the best batch split by an exact min-max DP
// over replicas, itself checked against enumerating every allocation in the tests). Throws
// InputError when the space has more than options.exact_limit configurations per schedule.
SearchResult exhaustive(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options);

// Min-max split of TOTAL units over replicas: minimises max_r g[r][b_r] over b_r >= 1 with
// sum b_r = TOTAL, exactly, by DP over replicas (O(R * TOTAL^2)); g[r] has TOTAL + 1 entries
// (index = units), +inf where a replica cannot take that many. Returns the optimum (+inf if none)
// and the b_r in CHOICE.
double minmax_split(const std::vector<std::vector<double>>& g, int64_t total, std::vector<int64_t>* choice);

// Size of the space without symmetry: sum over set partitions of prod over replicas of
// k! * C(L-1, k-1) (k devices, L blocks). Infinity when it overflows a double.
double search_space_configurations(int num_devices, int64_t layers);

}  // namespace alloy::plan
