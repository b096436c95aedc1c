#pragma once
// Cost model: what one optimizer step of a Plan takes on a cluster, stage by stage, and whether
// every rank fits in its device's memory. It follows what the trainer does per step:
//
//  1. Every pipeline runs its schedule (pipeline::make_schedule), event by event
//     (pipeline::simulate): forward/backward of a micro-batch of m samples on a stage costs
//     blocks * t_block(m) (+ t_embed(m) on stage 0, + t_head(m) on the last stage) with the
//     MicroBatchCost t(m) of the device's TYPE from the profile; an activation or gradient message
//     between consecutive stages costs latency + m*seq_len*hidden*dtype_bytes / bandwidth of THE
//     link between the two hosts (a measured profile link wins over the cluster spec). Sends do not
//     block the sender; the messages of one link direction go one at a time, in order (a message
//     leaves once the one before has arrived), so a thin link that carries them slower than the
//     stage computes them makes them queue. Pipelines that cross the same pair of hosts share it:
//     each of their messages there takes share x bytes / bandwidth, share = the number of
//     pipelines crossing the pair (pipeline_link_shares; alike pipelines send at the same moments
//     of their schedules). A link a `shared` cluster rule gives (one line between two sites) is
//     one link for every host pair it covers: pipelines crossing it between any of those pairs
//     share it. A link inside a host is not shared out. The search prices its layouts
//     the same way (search_detail.h, Tables::get with the layout's shares).
//     Under zb-h1 a stage's backward is split: its BackwardWeight takes weight_share(type) of the
//     blocks' backward (profiled; else the projections' weight products' share by shape), its
//     Backward the rest; the stage's gradients are final at the end of its last weight pass.
//  2. Gradient sync: the parameters of every distinct set of holder ranks (a block held by one
//     stage of every pipeline; the embedding by the first stages; the head by the last stages; a
//     tied GPT-2 wte by the first AND last stages) are SUM-all-reduced in one ring per set, a
//     bucket of b bytes at a time:
//        time = c * 2(n-1)/n * sum(ring hop latencies) + 2(n-1)/n * b / slowest hop
//     with c = ceil(b / bucket_mb) collectives (1 unless one unit alone exceeds the cap), the ring in
//     host order (holders grouped by host as the cluster lists hosts, then by rank; that is rank
//     order whenever the cluster lists devices host by host). On equal hops the latency term is
//     the textbook 2(n-1)*latency; on unequal hops a chunk crosses each hop in turn, so their
//     latencies add up instead of the slowest being paid 2(n-1) times.
//     The reducer fills each set's buckets (bucket_mb) with its parameters in backward order (head,
//     blocks L-1..0, embedding, tied wte) and launches a bucket when its last gradient is final,
//     i.e. during the LAST micro-batch's backward: on a rank whose stage holds blocks [b, e),
//     block l is final (head backward) + (e - l) block backwards after that backward starts, the
//     embedding after all of them. A bucket's collective starts when every holder has launched it
//     and the one before it in the set is done (one Gloo group per set runs its collectives in
//     order); sets run concurrently (we ignore that a rank's sets share its network interface).
//     So gradients of early layers, ready only at the end of the backward, are exposed, while those
//     of late layers hide behind the rest of it. A rank is done at max(end of its last backward,
//     end of the last bucket of each of its sets); exposed sync = done - end of backward.
//     Compressed sync (grad_sync.compression lossy): a set whose gradients are compressed (all of
//     them with scope `all`; those spanning regions joined only by slow links with `slow-links`)
//     times each bucket of E elements as the runtime runs it (dist/compressed_sync.h):
//        flat:          E * encode + exchange(wire bytes among all members) + E * decode
//        hierarchical:  exact all-reduce inside each region + E * encode (leader) +
//                       exchange among the regions' leaders + broadcast of the wire inside each
//                       region + E * decode
//     with encode/decode the slowest involved device type's profiled codec cost, wire bytes per
//     gradient byte 2 * density for the sparsifiers (index + value), density for random-k (values
//     only), 1/2 for fp16/bf16, PowerSGD's r * (rows + cols) / (rows * cols) over the block's
//     matrices; all-gathers cost (n-1) * payload, all-reduces 2(n-1)/n * payload per hop. Flat
//     sets encode on the autograd thread: a rank's backward ends its sets' encode time later.
//     Shared links: every set's collectives put bytes on the directed host pairs of their rings
//     (one way of a `shared` rule's link for all the pairs it covers); a hop carrying several sets is shared as a processor-sharing link whose sets start together
//     (a set of B bytes among sets B_j finishes after sum_j min(B_j, B) / bandwidth), so the
//     set's ring runs at bandwidth * B / sum_j min(B_j, B) on that hop. Of the pipeline messages,
//     those of the last micro-batch's backward meet the buckets (the earlier ones cross before any
//     gradient is final): each pipeline puts one gradient message of m samples on every hop its
//     gradients cross, as one more B_j (add_pipeline_tail_load; the search ranks layouts with the
//     smallest candidate micro-batch there, a lower bound, and prices its chosen plan with its own).
//  3. The loss + gradient-norm all-reduce over all ranks: latency-bound, 2(W-1)/W * the ring's
//     hop latencies (16 bytes). It is a barrier: it ends when the last rank is done.
//  4. AdamW on each rank's own parameters: params * optimizer_s_per_param of its type.
//  5. Stragglers: the step waits for the slowest of the replicas' draws, not for the largest
//     mean. Replica p would be done at D_p if every other one were early (its ranks' own ends:
//     phase end, and for each bucket of their sets, their own ready time + the buckets from
//     there on; the step is max_p D_p), give or take noise_p * sqrt(D_p * 1 s), noise_p the
//     largest step_noise among its stages' device types;
//     the replicas' done times are taken as independent normals and the step waits for their
//     expected maximum (Clark's moment matching, folded in ascending mean). Equal replicas gain
//     noise * sqrt(D) * E[max of R standard normals] (0.56 for 2, 1.03 for 4, 1.42 for 8); one
//     replica far behind the others, or a single one, gains almost nothing. The search ranks
//     layouts without this wait (search_detail.h, Evaluator::evaluate) and predicts it for the
//     plan it returns.
//  Step time = (replicas' expected latest done) + world all-reduce + slowest optimizer step.
//
// Memory per rank, as the runtime holds it (ranks.json's model_memory_bytes measures the same: the
// heap's peak in the steps over what it held before the model was built):
//   weights + gradients + AdamW moments (state_bytes_per_param_byte - 2 per parameter byte) of the
//   held parameters + the reducer's bucket copy of every gradient it syncs + activations kept for
//   backward: peak micro-batches in flight (1F1B: min(S - s, M); GPipe: M) * m * activation bytes
//   per sample of the held layers, + the backward's working set: one block's activations at m
//   (the gradients of a block's intermediate tensors while it runs backward), + the pipeline
//   messages it sends (held until the step's end: M activations unless last, M gradients unless
//   first; counted with the buffers).
// Sharding (plan.sharding, per holder set of B bytes, this rank's share f): ZeRO-1 and 2 keep the
// AdamW moments of f*B only (ZeRO-2's gradients are reduced onto the owners but still land in
// full .grad tensors and buckets); ZeRO-3 keeps f*B of weights and a gradient shard of f*B, plus
// the two largest of its layers gathered at once (one in use, the next prefetched); its buckets
// hold the set's gradients once. Recomputation (a stage's recompute) keeps each block's input
// (one hidden state per sample) instead of its saved tensors, and one more block's activations
// in the working set while that block recomputes. Capacity is memory_gb * 1e9 bytes; memory_gb 0 means unknown: unlimited.
// Sharding's time: ZeRO-1/2 all-gather each owner's updated range after the optimizer (every
// member receives (1 - its share) of B: the slowest member, 1 - the smallest share), and each
// rank's AdamW covers its share only; ZeRO-3 gathers each layer before its forward and its
// backward in every micro-batch, the next layer's gather overlapping the current layer's compute
// (exposed: the first layer's gather, then what a gather takes beyond the layer before it);
// its gradients reduce onto the owners in the same buckets as an all-reduce (same bytes per hop
// counted: a reduce-scatter, then no all-gather). Recomputation adds the blocks' forward to
// their backward.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/plan.h"
#include "alloy/core/sync_tree.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"

namespace alloy::plan {

// The least a tensor-parallel group's sum costs when the profile did not time the group's pairs
// (Profile::tp_sums): Gloo's all-reduce on a CPU plus the wait for the last member. Measured on
// the emulated pool (examples/cluster-tp.yaml, two ranks on one host under CPU quotas): 1.6 ms
// per sum beyond the link model's figure, which alone had put a TP pair's step at half what it
// measured (bench/README, "Tensor parallelism").
constexpr double kTpSumFloorS = 1.5e-3;

struct StageCost {
  int pipeline = 0, stage = 0, rank = 0;
  std::string device, type, host;
  int64_t layer_begin = 0, layer_end = 0;  // the blocks the stage touches
  int64_t unit_begin = 0, unit_end = 0;    // the half blocks it holds
  // An interleaved pipeline's rank (one StageCost for all its chunks): each chunk's units; the
  // ranges above span from its first to its last. Empty otherwise.
  std::vector<std::pair<int64_t, int64_t>> chunk_units;
  double forward_s = 0, backward_s = 0;  // all micro-batches of the step
  double p2p_s = 0;        // transfer time of the messages this stage sends (overlaps compute)
  int tp = 1;              // ranks of a tensor-parallel stage (the figures here are its first rank's)
  double tp_comm_s = 0;    // all micro-batches: the group's sums, forward and backward (on the critical path)
  // A tensor-parallel stage: each member's own compute for the step (its heads' share on its own
  // device type, all micro-batches, without the sums), for calibrating every member's type.
  struct MemberCompute {
    int rank = 0;
    std::string type;
    double compute_s = 0;
  };
  std::vector<MemberCompute> tp_members;
  double bubble_s = 0;     // idle time inside the pipeline phase: pipeline makespan - compute
  double phase_end_s = 0;  // end of this stage's last backward
  double sync_s = 0;       // longest all-reduce among the holder sets this rank is in
  double sync_exposed_s = 0;
  double optimizer_s = 0;
  double param_bytes = 0;
  double state_bytes = 0, bucket_bytes = 0, activation_bytes = 0;
  // Sharding and recomputation (plan.sharding, the stage's recompute): the highest ZeRO stage
  // among its holder sets, its share of the largest of them; state_bytes = weight + grad + optimizer.
  int64_t zero_stage = 0;
  double shard = 1;
  bool recompute = false;
  double weight_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, gathered_bytes = 0;
  double gather_s = 0;        // ZeRO-3: exposed per-layer gathers in all micro-batches (in forward_s/backward_s)
  double param_gather_s = 0;  // ZeRO-1/2: the updated parameters' all-gather after the optimizer
  int64_t peak_in_flight = 0;
  double memory_bytes = 0, memory_capacity_bytes = 0;  // capacity 0 = unknown
  bool fits = true;
};

struct PipelineCost {
  int64_t micro_batch_size = 0, num_micro_batches = 0;
  double phase_s = 0;  // the schedule's makespan
  double done_s = 0;   // its last rank done with gradient sync
  // When it would be done if every other pipeline were early: the gradient sync makes all of
  // them done together (done_s), but it is this one's own lateness that moves the step. The
  // step's barrier waits for the latest own_done_s; a draw of noise_s around it (5 above).
  double own_done_s = 0, noise_s = 0;
};

struct SyncGroupCost {
  std::vector<int> ranks;  // in ring order
  bool compressed = false, hierarchical = false;
  bool tree = false;       // exact, summed along a tree around slow links
  int stripes = 1;         // tree: trees each summing a slice at once (core/sync_tree.h, sync_trees)
  int regions = 1;
  double wire_bytes = 0;   // compressed: what one member puts in the exchange
  double encode_s = 0;     // compressed: encode + decode time of all buckets
  double bytes = 0;
  int64_t buckets = 0;
  double slowest_bytes_per_s = 0;  // a tree's: the set's bytes over its most loaded link, stripes together
  double ready_s = 0;  // the first bucket can start (all holders have it)
  double time_s = 0;   // all buckets' collectives back to back
  double done_s = 0;   // the last bucket is reduced
};

struct PlanCost {
  double step_s = 0;
  double phase_s = 0;           // slowest pipeline's schedule
  double sync_done_s = 0;       // every rank has its gradients (the largest mean)
  double straggler_s = 0;       // what waiting for the slowest draw adds to sync_done_s (5 above)
  double world_allreduce_s = 0;
  double world_allreduce_exposed_s = 0;  // of it, past the sync (replicas sum it ahead of the sync)
  double optimizer_s = 0;       // slowest rank's optimizer step
  double param_gather_s = 0;    // ZeRO-1/2: slowest all-gather of updated parameters
  std::vector<StageCost> stages;  // pipelines in order, their stages in order
  std::vector<PipelineCost> pipelines;
  std::vector<SyncGroupCost> sync_groups;
  bool fits = true;
  std::string explanation;  // what does not fit and by how much; empty when everything fits
  nlohmann::json to_json() const;
};

// "[0,2.5)": half-block units [UNIT_BEGIN, UNIT_END) as blocks, halves as .5.
std::string blocks_text(int64_t unit_begin, int64_t unit_end);
std::string names_text(const std::vector<std::string>& names);  // "a, b, c"

// E[max_i X_i] for independent normal X_i given as (mean, standard deviation): Clark's closed form
// for two, numerical integration of the maximum's distribution beyond that.
double expected_max(std::vector<std::pair<double, double>> mean_sd);

// Throws InputError when a stage's device is missing or not in the cluster, a device type has no
// profile, a link has no usable bandwidth, or the plan does not validate against profile.model.
PlanCost simulate_plan(const Plan& plan, const ClusterSpec& cluster, const Profile& profile);

// The pieces simulate_plan is made of, shared with the search so that its predictions are the
// same numbers to the last bit: a cluster and a profile resolved into indexed tables.
class CostContext {
 public:
  CostContext(const ClusterSpec& cluster, const Profile& profile);  // throws InputError as above

  const ClusterSpec& cluster() const { return *cluster_; }
  const Profile& profile() const { return *profile_; }
  int num_devices() const { return static_cast<int>(dev_type_.size()); }
  int num_types() const { return static_cast<int>(types_.size()); }
  int num_hosts() const { return static_cast<int>(hosts_.size()); }
  int type_of(int device) const { return dev_type_[static_cast<size_t>(device)]; }
  int host_of(int device) const { return dev_host_[static_cast<size_t>(device)]; }
  const std::string& type_name(int type) const { return types_[static_cast<size_t>(type)]; }
  const std::string& host_name(int host) const { return hosts_[static_cast<size_t>(host)]; }
  double capacity_bytes(int device) const { return capacity_[static_cast<size_t>(device)]; }
  int64_t layers() const { return profile_->model.layers; }

  // One micro-batch of M samples through BLOCKS blocks plus the embedding (FIRST) / head (LAST).
  // BLOCKS may be fractional: a stage whose ends are half blocks (compute_blocks).
  double forward_s(int type, double blocks, bool first, bool last, int64_t m) const;
  double backward_s(int type, double blocks, bool first, bool last, int64_t m) const;
  // Half-block units [UNIT_BEGIN, UNIT_END) as blocks: whole blocks count 1, a lone attention half
  // its share of a block's compute (or parameters), a lone MLP half the rest. The shares follow
  // from the model's shapes (multiply-adds for compute, parameter counts for bytes); whole-block
  // ranges give exact integers, so block-granular callers get the same numbers as before.
  // The compute shares are each device type's measured ones (the profile's attn_share_fwd/bwd)
  // where it has them; compute_blocks (memory: activations) uses the shapes' estimate.
  double compute_blocks(int64_t unit_begin, int64_t unit_end) const { return blocks_in(unit_begin, unit_end, attn_compute_share_); }
  double param_blocks(int64_t unit_begin, int64_t unit_end) const { return blocks_in(unit_begin, unit_end, attn_param_share_); }
  double attention_share(int type, bool forward) const;
  // forward_s / backward_s of a stage holding units [UNIT_BEGIN, UNIT_END). At a cut MLP
  // (StagePlan::mlp_cut) it computes share IN of its first unit's columns (an MLP half) and share
  // OUT of its last unit's; 1: the whole unit.
  double forward_units_s(int type, int64_t unit_begin, int64_t unit_end, bool first, bool last, int64_t m, double in = 1,
                         double out = 1) const {
    const double a = attention_share(type, true);
    return forward_s(type, blocks_in(unit_begin, unit_end, a) - (2 - in - out) * (1 - a), first, last, m);
  }
  double backward_units_s(int type, int64_t unit_begin, int64_t unit_end, bool first, bool last, int64_t m, double in = 1,
                          double out = 1) const {
    const double a = attention_share(type, false);
    return backward_s(type, blocks_in(unit_begin, unit_end, a) - (2 - in - out) * (1 - a), first, last, m);
  }
  // The blocks' weight-gradient part of the backward (zb-h1's BackwardWeight, pipeline/schedule.h):
  // the share weight_share(TYPE) of the blocks' backward, as the profile measured it for the type,
  // else the projections' weight products' share by shape.
  double weight_share(int type) const {
    if (profile_->lora.enabled()) return 0;  // a frozen base has no weight products to hold back
    const double measured = type_profile_[static_cast<size_t>(type)]->weight_share;
    return measured > 0 ? measured : weight_share_;
  }
  double weight_s(int type, double blocks, int64_t m) const { return weight_share(type) * backward_s(type, blocks, false, false, m); }
  double weight_units_s(int type, int64_t unit_begin, int64_t unit_end, int64_t m, double in = 1, double out = 1) const {
    return weight_share(type) * backward_units_s(type, unit_begin, unit_end, false, false, m, in, out);
  }
  // What a pipeline stage's messages take from its compute, per micro-batch, in its forward and
  // again in its backward (each receives one message unless FIRST / LAST and sends one unless LAST /
  // FIRST): the messages' bytes times the type's profiled comm_cpu_s_per_byte (0 unmeasured).
  // IN_WIDTH / OUT_WIDTH: the messages from the previous stage / to the next in hidden states (2
  // across a cut MLP, PipelinePlan::message_width).
  double p2p_cpu_s(int type, bool first, bool last, int64_t m, double in_width = 1, double out_width = 1) const {
    return ((first ? 0.0 : in_width) + (last ? 0.0 : out_width)) * message_bytes(m) * type_profile_[static_cast<size_t>(type)]->comm_cpu_s_per_byte;
  }
  // Seconds per sample through the whole model at micro-batch M (forward + backward): a type's speed.
  double full_model_s_per_sample(int type, int64_t m) const;
  // One activation (or gradient) message of M samples between two hosts, on a link that SHARE
  // pipelines cross at once (pipeline_link_shares): its bytes take SHARE times as long.
  // WIDTH: the message in hidden states (2 across a cut MLP).
  double p2p_s(int host_a, int host_b, int64_t m, int share = 1, double width = 1) const;
  // The part of p2p_s that is the link's latency (pipeline::SimCosts::p2p_latency: messages overlap in it).
  double latency_s(int host_a, int host_b) const;
  // Pipelines sharing links: PIPELINE_HOSTS[p] are pipeline p's stages' hosts in stage order.
  // Returns, per pipeline and link s (between stages s and s+1), how many pipelines send their
  // messages over that link: 1 for a link within a host or one no other pipeline crosses, else
  // 1 + the other pipelines crossing the same host pair, or the same shared link (a `shared`
  // rule's: any pair it covers) (either direction: one pipeline's activations
  // and another's gradients meet there). Pipelines alike in shape send their messages at the same
  // moments of the schedule (one per micro-batch each way), so each gets the link's bandwidth /
  // SHARE while they cross; unlike ones overlap less, and this is the upper end for them.
  std::vector<std::vector<int>> pipeline_link_shares(const std::vector<std::vector<int>>& pipeline_hosts) const;
  // The same into OUT, reusing its storage (the search asks it for every layout it scores).
  void pipeline_link_shares(const std::vector<std::vector<int>>& pipeline_hosts, std::vector<std::vector<int>>* out) const;
  double message_bytes(int64_t m) const { return static_cast<double>(m) * act_message_bytes_; }
  double link_bytes_per_s(int host_a, int host_b) const { return bw_[idx(host_a, host_b)]; }
  double link_latency_s(int host_a, int host_b) const { return lat_[idx(host_a, host_b)]; }

  // Parameter bytes of a stage, activation bytes per sample kept for backward, and the tied wte.
  double param_bytes(double blocks, bool first, bool last) const;
  // LoRA's frozen base held by a stage (weights only: no gradients, optimizer state or sync).
  double frozen_bytes(double blocks, bool first, bool last) const;
  // The same for a tensor-parallel member: a piece of a double-quantized nf4 base keeps its share
  // of the whole's block scales in fp32 (model::quantized_part cuts the whole's quantization; the
  // second quantization of the scales is not cut with it): 0.5 + 4/64 bytes per element against the
  // whole's 0.5 + 1/64 + 4/(64 x 256). The profile measured the whole.
  double tp_frozen_bytes(double blocks, bool first, bool last) const;
  double act_bytes_per_sample(double blocks, bool first, bool last) const;
  // With whole-block recomputation: each block keeps its input only (embedding and head as before).
  double act_bytes_per_sample(double blocks, bool first, bool last, bool recompute) const;
  // One block's saved tensors per sample: what a recomputing block holds during its backward.
  double block_act_bytes_per_sample() const { return profile_->memory.act_bytes_per_sample_block; }
  // A block's backward at micro-batch M holds gradients of its intermediate tensors about as large
  // as its saved ones (measured on the emulator: a 1-block stage's heap peaked a block's
  // activations above what it kept); a recomputing block also holds its recomputed tensors.
  // The messages a stage sends in a step (activations forward unless LAST, gradients back unless
  // FIRST, MBS micro-batches of M samples): the executor keeps each until the step's end.
  double send_buffer_bytes(bool first, bool last, int64_t mbs, int64_t m) const {
    return static_cast<double>((first ? 0 : 1) + (last ? 0 : 1)) * static_cast<double>(mbs) * message_bytes(m);
  }
  double working_bytes(double blocks, int64_t m, bool recompute) const {
    return blocks > 0 ? (recompute ? 2.0 : 1.0) * static_cast<double>(m) * block_act_bytes_per_sample() : 0.0;
  }
  double dtype_bytes() const { return dtype_bytes_; }
  double optimizer_s(int type, double param_bytes) const;
  double step_noise(int type) const { return type_profile_[static_cast<size_t>(type)]->step_noise; }
  // A tensor-parallel member of TYPE holding fraction F of the heads: its share of a block's
  // compute. Between the shard sizes the profile timed (DeviceProfile::tp_shard_shares) and the
  // whole block, on the line through them (below the smallest, the line through the two smallest);
  // without them f + tp_whole_share (1 - f), what every member computes whole.
  double tp_block_share(int type, double f) const;
  // A member computing C seconds of a pass (at its steady rate) in CHUNKS stretches between sums
  // that keep it waiting SUMS_S in all. Under a CPU quota (DeviceProfile::quota_fraction q,
  // quota_burst_s B) each wait refills up to B of CPU, which the next stretch spends at the core's
  // full speed: a stretch of c steady seconds saves min(c (1 - q), b (1/q - 1)) with b = min(B,
  // q w) after a wait w. Summed over the pass that is C + SUMS_S less the least of C (1 - q)
  // (everything at full speed), SUMS_S (1 - q) (what the waits refill) and CHUNKS x B (1/q - 1)
  // (a full quota per stretch). Without a quota: C + SUMS_S. Measured on the emulated 3-device
  // pool: members under 0.4 and 0.2 core computed 1.1 s of a step where the steady rate said 2.7.
  double tp_member_s(int type, double compute_s, double sums_s, double chunks) const {
    const DeviceProfile& d = *type_profile_[static_cast<size_t>(type)];
    return tp_member_s_at(d.quota_fraction, d.quota_burst_s, compute_s, sums_s, chunks);
  }
  static double tp_member_s_at(double quota_fraction, double quota_burst_s, double compute_s, double sums_s, double chunks) {
    const double q = std::clamp(quota_fraction, 1e-3, 1.0);
    if (q >= 1 || quota_burst_s <= 0 || chunks <= 0) return compute_s + sums_s;
    const double saved = std::min({compute_s * (1 - q), sums_s * (1 - q), chunks * quota_burst_s * (1 / q - 1)});
    return compute_s + sums_s - std::max(0.0, saved);
  }
  // Standard deviation of a replica done DONE_S after the step's start on devices of NOISE.
  static double done_sd(double noise, double done_s) { return noise * std::sqrt(std::max(0.0, done_s)); }
  double state_bytes_per_param_byte() const { return profile_->memory.state_bytes_per_param_byte; }
  double memory_bytes(double param_bytes, double bucket_bytes, int64_t in_flight, int64_t m, double act_per_sample) const;
  // The least a rank could need with sharding and recomputation (the search's relief mode,
  // plan/fit_memory.h): a rank that syncs (BUCKET_BYTES > 0) could hand all its weights and AdamW
  // state to the other holders (ZeRO-3, a share near 0) and keep buckets, two gathered blocks and
  // recomputed activations; one that does not can only recompute.
  double memory_floor_bytes(double param_bytes, double bucket_bytes, int64_t in_flight, int64_t m, int64_t blocks, bool first,
                            bool last) const;
  // Relief mode: the search checks memory against memory_floor_bytes instead of memory_bytes.
  void set_memory_relief(bool on) { relief_ = on; }
  bool memory_relief() const { return relief_; }

  // Gradient sync settings the model follows (compression, scope, bucket size); default exact.
  void set_grad_sync(const GradSyncConfig& g);
  const GradSyncConfig& grad_sync() const { return gs_; }
  double bucket_bytes() const { return gs_.bucket_mb * 1024 * 1024; }
  // Whether two devices' hosts are joined by a slow link (grad_sync.slow_link_gbps).
  bool slow_pair(int dev_a, int dev_b) const { return slow_[static_cast<size_t>(host_of(dev_a)) * hosts_.size() + static_cast<size_t>(host_of(dev_b))] != 0; }

  // Bytes the sets of one layout put on each link, for sharing links among them.
  struct LinkLoads {
    // Per directed link (a host pair's own path, or one way of a shared rule's link): bytes of
    // every set crossing it.
    std::vector<std::vector<double>> hop;
    double factor(size_t hop_index, double own) const { return std::max(1.0, ratio(hop_index, own)); }
    double ratio(size_t hop_index, double own) const;  // sum_j min(B_j, own) / own (0 for an idle link)
  };

  // A ring of devices, in the order given (callers sort with ring_less): hop figures. With LOADS,
  // each hop's bandwidth is what a set putting OWN bytes on it gets among the others.
  struct Ring {
    int n = 0;
    double slowest_bytes_per_s = 0, latency_sum_s = 0;
    double max_latency_s = 0;  // the ring's longest hop
  };
  Ring ring(const std::vector<int>& devices_in_order, const LinkLoads* loads = nullptr, double own = 0) const;

  // How one holder set's gradients travel: an exact ring all-reduce, a flat compressed exchange,
  // or hierarchical (regions exact, their leaders compressed).
  // An exact set summed along a tree (core/sync_tree.h): every tree edge carries the set's bytes
  // once each way, chunk by chunk, so a bucket takes its bytes over the slowest tree edge, plus
  // the first chunk's way up to the root (or both ends of a root edge, and across it) and down to
  // every member (sync_tree_round_trip, each hop at its own link's speed and latency), less the one
  // chunk time already counted.
  // With stripes (core/sync_tree.h, sync_trees) every tree carries its slice of each bucket at
  // once: a link that K of the S stripes cross (a fast one they share, or one shared line) carries
  // K/S of the bytes, and the slowest rate is over the links so loaded.
  struct Tree {
    int depth = 0, stripes = 1;
    double slowest_bytes_per_s = 0;  // the set's bytes over the most loaded link, either way
    std::vector<int> devices, parent;  // the members (the shape's order), the first stripe's parents (-1: root)
    std::vector<SyncTree> trees;       // every stripe's tree, the first's included
    std::vector<double> degree;        // per member: tree edges, averaged over the stripes (bytes sent per set byte, each way)
    // Per stripe and member, the hop to its parent and the hop from it: seconds per byte (loads
    // included), latency.
    struct Hop {
      double up_s_per_byte = 0, up_latency_s = 0, down_s_per_byte = 0, down_latency_s = 0;
    };
    std::vector<std::vector<Hop>> hops;
    double degree_of(int device) const;  // the most of any member for a device not among them
  };
  struct SyncShape {
    bool compressed = false, hierarchical = false, tree = false;
    Ring ring;                    // every member (exact, flat)
    Tree sum_tree;                // exact, along a tree around slow links (tree)
    std::vector<Ring> regions;    // hierarchical: the regions of two or more members
    Ring leaders;                 // hierarchical: one device per region
    int num_regions = 1;
    double encode_s_per_elem = 0, decode_s_per_elem = 0;
  };
  // DEVICES in ring order. The set's compression follows grad_sync and, with scope slow-links,
  // whether its devices split into regions.
  SyncShape sync_shape(const std::vector<int>& devices_in_order, const LinkLoads* loads = nullptr, double set_bytes = 0) const;
  // DEVICES split into regions by slow links (in DEVICES' order; a region's first is its leader).
  std::vector<std::vector<int>> regions_of(const std::vector<int>& devices_in_order) const;
  // Adds what the set of DEVICES (ring order) syncing SET_BYTES puts on each hop to LOADS.
  void add_load(const std::vector<int>& devices_in_order, double set_bytes, LinkLoads* loads) const;
  // Adds the pipeline messages that meet the sets' traffic to LOADS: a pipeline's last micro-batch
  // sends its input gradient from each stage to the one before while the stages' buckets sync
  // (they launch during that backward), so every hop a pipeline's gradients cross (HOSTS in stage
  // order) carries one message of M samples as a load of its own. The messages before it cross
  // before any gradient is final; those of other pipelines are taken to meet the sets as these do.
  void add_pipeline_tail_load(const std::vector<int>& hosts, int64_t m, LinkLoads* loads) const;
  LinkLoads empty_loads() const;
  // Bytes one member puts in a compressed exchange per gradient byte.
  double wire_ratio() const;
  // The time of one bucket of BYTES (gradient) under SHAPE, and the time to encode it (flat sets
  // encode on the autograd thread).
  double bucket_s(const SyncShape& shape, double bytes, int64_t* collectives = nullptr) const;
  double encode_s(const SyncShape& shape, double bytes) const { return shape.encode_s_per_elem * bytes / dtype_bytes_; }
  // The CPU time a member of TYPE spends moving a set's sync (SHAPE, BYTES of gradient, N members)
  // at the type's comm_cpu_s_per_byte: what it sends plus what it receives, an all-reduce 2 (k - 1)
  // / k of its payload each way, an all-gather (k - 1) payloads; hierarchical sets charge every
  // member its region's exact all-reduce and the leaders' compressed exchange (an upper bound for
  // members that lead nothing). The member's compute and this share its CPU, so its sync cannot
  // end before its last backward plus this (charged like encoding).
  // A tree's member moves the set's bytes each way over each of its tree edges (DEVICE: the member;
  // -1: the busiest).
  double sync_cpu_s(int type, const SyncShape& shape, double bytes, size_t n, int device = -1) const;
  // A bucket of BYTES summed along TREE (chunks of dist/tree_allreduce's kChunkBytes).
  double tree_allreduce_s(const Tree& tree, double bytes) const;
  // What a run of buckets along TREE pays once (dist/tree_allreduce.h pipelines them): the first
  // chunk's way up to the root and back beyond its bytes at the slowest rate. A bucket's own time
  // is then its bytes at the slowest rate (Bucket::time_s); the chain is priced by chain_latency_s.
  double tree_latency_s(const Tree& tree, double bytes) const;
  // The once-per-set term of SHAPE's bucket chain (SET_BYTES in all): a tree's latency, else 0.
  double chain_latency_s(const SyncShape& shape, double set_bytes) const {
    return shape.tree ? tree_latency_s(shape.sum_tree, set_bytes) : 0.0;
  }
  // Memory the set's sync keeps on each member: the reducer's bucket copy (exact), or staging,
  // output, residual and DGC velocity buffers (compressed).
  double sync_buffer_bytes(const SyncShape& shape, double set_bytes) const;
  bool ring_less(int dev_a, int key_a, int dev_b, int key_b) const {  // host order, then KEY (rank)
    return host_of(dev_a) != host_of(dev_b) ? host_of(dev_a) < host_of(dev_b) : key_a < key_b;
  }
  double allreduce_s(const Ring& r, double bytes, double bucket_bytes, int64_t* buckets = nullptr) const;
  double allgather_s(const Ring& r, double bytes_per_member) const;
  // An all-gather into receives posted beforehand (Comm::post_allgather, Group::post_sum_small):
  // every member sends straight to every other, so one latency, the longest, where Gloo's ring
  // passes blocks on n - 1 times; the bytes are the ring's, n - 1 blocks through each member.
  double posted_gather_s(const Ring& r, double bytes_per_member) const;
  // ZeRO's gather of a set of BYTES among ring R, each member receiving the others' ranges (the
  // smallest share MIN_SHARE: the member receiving most).
  double shard_gather_s(const Ring& r, double bytes, double min_share) const;
  double world_allreduce_s() const { return world_allreduce_s_; }
  // What the step's figures sum adds to a step: nothing where every replica is one stage of one
  // rank, unsharded (they sum it ahead of the gradient sync, which crosses the same links after
  // the slowest backward too: train/step_figures.h), all of it otherwise.
  double world_sum_exposed_s(bool replicas_of_one_stage) const { return replicas_of_one_stage ? 0.0 : world_allreduce_s_; }
  // The step's one world sum of its figures (loss, gradient norm, sync figures: kWorldSumBytes)
  // among DEVICES in rank order, routed as the trainer routes it: along sync_tree where three or
  // more have a slow pair among them, Gloo's ring otherwise. Its cost is latency: on a 40 ms link
  // between regions a ring of four crossed it six times a sum.
  double world_sum_s(const std::vector<int>& devices_in_rank_order) const;
  static constexpr double kWorldSumBytes = 8 * 8.0;
  // One tensor-parallel sum of BYTES among DEVICES (any order), from what the profile measured
  // each pair's sums to take under compute (TpSumProfile: a line in the bytes through the sizes
  // measured; the group takes its slowest pair's line, the bytes scaled as a ring moves them). Not the
  // link model: a ping-pong with a device under a small CPU quota measures its throttling as
  // latency (8.7 ms on a 1 Gbit/s veth once). A group with a pair nobody measured (older
  // profiles, pools over 8 devices): the ring's time, at least kTpSumFloorS.
  // LAST: the members the group may wait for at each sum (empty: as the pairs measured). A pair's
  // line holds the CPU time its slower member, arriving last with its quota's burst spent, took to
  // move the sum (comm_cpu_s_per_byte, twice the ring bytes: sent and received); in a group the sum
  // waits instead for the LAST members at that rate and for the others at their cores' full speed,
  // since they waited. Measured on the 3-device pool: uneven TP 3:2:1 (the fast device last)
  // summed 23.6 ms per sum where the fast+quarter pair's line said 27.0 and its CPU terms 23.8;
  // even TP (the members' arrivals within 8% of each other, the quarter last) 26.3 ms.
  double tp_sum_s(std::vector<int> devices, double bytes, const std::vector<int>& last = {}) const;
  // Of DEVICES arriving at a sum after ARRIVAL_S (in the same order), those the sum may wait for:
  // within kTpLastMargin of the latest, since the members' arrivals jitter and the burst model
  // that orders them is itself off by 10-20% (bench/README, tensor parallelism).
  static std::vector<int> tp_last_members(const std::vector<int>& devices, const std::vector<double>& arrival_s);
  static constexpr double kTpLastMargin = 0.15;
  // The members of DEVICES a group's sums wait for (tp_last_members), member k computing
  // COMPUTE_S[k] per pass in CHUNKS stretches between SUMS_S of sums at the pairs' measured price:
  // each arrives after its compute less what its quota's burst gives back (tp_member_s).
  std::vector<int> tp_waited_for(const std::vector<int>& devices, const std::vector<double>& compute_s, double sums_s, double chunks) const;

  // Parameter units and their holders. A stage of a pipeline, seen by the sync computation.
  struct Holder {
    int id;                  // rank (simulate_plan) or device (search)
    int64_t begin, end;      // half-block units (2 * blocks for a whole-block stage)
    bool first, last;
    // A cut MLP at this holder's end (StagePlan::mlp_cut): the share of its last unit's columns it
    // holds, the next holder of the pipeline the rest (0: no cut; its last unit whole).
    double cut_share = 0;
  };
  // Parameter units in backward order, the order the reducer fills buckets: 0 head rest,
  // 1..2L half blocks (the last block's MLP half, its attention half, ..., block 0's attention
  // half), 2L+1 embedding rest, 2L+2 tied wte (0 bytes when untied).
  int num_units() const { return 2 * static_cast<int>(layers()) + 3; }
  // The unit of half block HALF (2b: block b's attention half, 2b + 1 its MLP half).
  int half_unit(int64_t half) const { return static_cast<int>(2 * layers() - half); }
  int embed_unit() const { return 2 * static_cast<int>(layers()) + 1; }
  int wte_unit() const { return 2 * static_cast<int>(layers()) + 2; }
  double unit_bytes(int u) const;
  // Distinct holder sets with two or more members, their units (ascending, with bytes) and the
  // bytes they sync, summed in unit order so every caller gets the same number.
  struct SyncSet {
    std::vector<int> ids;  // sorted ascending
    double bytes = 0;
    std::vector<std::pair<int, double>> units;
  };
  std::vector<SyncSet> sync_sets(const std::vector<std::vector<Holder>>& pipelines) const;
  // How long after the start of its last backward a stage (TYPE, units [BEGIN, END), FIRST,
  // LAST) has unit U's gradients final, as a function of the micro-batch size.
  MicroBatchCost unit_ready(int type, int64_t begin, int64_t end, bool first, bool last, int u) const;
  // The reducer's buckets of one set: units (ascending) packed up to CAP bytes; a unit over CAP
  // alone is split into ceil(bytes / CAP) collectives that are ready together.
  struct Bucket {
    int last_unit = 0;  // the unit whose gradients complete it
    double bytes = 0, time_s = 0;
    int64_t collectives = 0;
  };
  void buckets(const SyncShape& s, const std::vector<std::pair<int, double>>& units, double cap, std::vector<Bucket>* out) const;
  // The last gradient of a stage is final this long after its last backward starts: the backward's
  // end, its messages' CPU time (p2p_cpu_s, linear in the micro-batch size) included.
  MicroBatchCost backward_end(int type, int64_t begin, int64_t end, bool first, bool last) const {
    MicroBatchCost r = unit_ready(type, begin, end, first, last, first ? embed_unit() : half_unit(begin));
    MicroBatchCost messages;
    messages.per_sample_s = p2p_cpu_s(type, first, last, 1);
    if (messages.per_sample_s > 0) r.add(messages, 1.0);
    return r;
  }

 private:
  size_t idx(int a, int b) const { return static_cast<size_t>(a) * hosts_.size() + static_cast<size_t>(b); }
  static double blocks_in(int64_t unit_begin, int64_t unit_end, double attn_share);
  const ClusterSpec* cluster_;
  const Profile* profile_;
  std::vector<std::string> types_, hosts_;
  std::vector<int> dev_type_, dev_host_;
  std::vector<double> capacity_;
  std::vector<const DeviceProfile*> type_profile_;
  std::vector<double> bw_, lat_, ring_bw_;  // host x host
  // Host x host: the link a directed pair's traffic crosses, for sharing its bandwidth (its own
  // index unless a shared rule gives it: then H x H + ClusterSpec::shared_link, one per rule and
  // way), and the same for messages that meet either way (pipelines: a pair's unordered index, or
  // H x H + the rule).
  std::vector<size_t> hop_link_, pair_link_;
  size_t num_links_ = 0, num_pair_links_ = 0;
  std::vector<char> slow_;                  // host x host
  std::vector<std::pair<double, double>> tp_line_;  // device x device: a TP sum's (fixed s, s per byte); fixed < 0 unknown
  GradSyncConfig gs_;
  // sync_trees of a holder set (its devices in order), kept: the search prices the same sets over
  // and over, and each build asks every one of the n^2 pairs whether it is slow. Cleared by
  // set_grad_sync (the slow pairs and tree_stripes come from it). The search is single-threaded; a
  // context is not shared across threads.
  mutable std::map<std::vector<int>, std::vector<SyncTree>> trees_of_;
  double powersgd_ratio_ = 1;
  double act_message_bytes_ = 0, dtype_bytes_ = 4;
  double wte_ = 0, embed_rest_ = 0, head_rest_ = 0;
  double attn_compute_share_ = 0.5, attn_param_share_ = 0.5, weight_share_ = 0;
  bool tied_ = false, relief_ = false;
  double world_allreduce_s_ = 0;
};

}  // namespace alloy::plan
