#pragma once
// Profile: what `alloy profile` measured, per device type and per link, that the cost model
// turns into step times. A compute time is a function of the micro-batch size m: the medians
// measured at a few sizes (the sizes plans use by default), joined by straight lines, and beyond
// the largest size a line fitted to all of them (t(m) = fixed + per_sample * m). At a measured
// size the planner uses what was measured there, not a line that averages it with the others
// (a fixed cost per call, or sizes that use the cores worse, would be smoothed away).
#include <array>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/config.h"
#include "alloy/plan/cluster.h"

namespace alloy::plan {

struct MicroBatchCost {
  static constexpr int kMaxPoints = 8;
  double fixed_s = 0, per_sample_s = 0;  // the fitted line
  // Measured (m, seconds), m strictly increasing; none: the line alone.
  int n = 0;
  std::array<double, kMaxPoints> m{}, t{};

  double at(double samples) const;
  // this + k * other, as a function of m (points at the union of both sizes, at most kMaxPoints).
  void add(const MicroBatchCost& other, double k);
  void set_points(const std::vector<double>& ms, const std::vector<double>& ts);
  // From measured medians T at sizes M (increasing): points shaped so that a larger micro-batch
  // never takes less time, nor more time per sample (least-squares isotonic fits, per sample
  // first, then of the times), and the line through them past the largest size. A throttled
  // device's readings wander by 30% at one size (the demo's half device: 7.3 ms per sample at 4
  // against 6.5 at 1 and 5.7 at 8, where training measured 4 cheaper per sample than 1), and an
  // unshaped point made the planner choose micro-batches of 1 that ran 16% over its prediction.
  static MicroBatchCost measured(const std::vector<double>& ms, const std::vector<double>& ts);
};

// Gradient compression on a device: seconds per gradient element to encode (error feedback and
// selection included) and to decode one member's contribution, at density 0.01.
struct CodecCost {
  double encode_s_per_elem = 0, decode_s_per_elem = 0;
};

struct DeviceProfile {
  MicroBatchCost block_fwd, block_bwd;  // one transformer block
  MicroBatchCost embed_fwd, embed_bwd;  // the embedding (first stage)
  MicroBatchCost head_fwd, head_bwd;    // final norm + logits + loss (last stage)
  double optimizer_s_per_param = 0; // AdamW step + clipping
  // How much a stretch of T seconds of compute varies from one time to the next on this device
  // (a shared or throttled machine): its standard deviation is step_noise * sqrt(T * 1 s), the
  // scaling of independent short disturbances. Ranks that meet at a barrier each step wait for
  // the slowest draw, so a synchronous step takes the expected maximum, not the largest mean.
  // 0: steady (old profiles, or a device that measured none).
  double step_noise = 0;
  std::map<std::string, CodecCost> codecs;  // by grad_sync.compression method; empty in old profiles
  // A block's attention half's share of the block's forward / backward time (the MLP half takes
  // the rest), timed on one half of each at the largest micro-batch size: what a pipeline
  // boundary inside a block moves. 0: not measured (older profiles), the model's shapes decide.
  double attn_share_fwd = 0, attn_share_bwd = 0;
  // The blocks' weight products' share of their backward, as zb-h1 splits it (measured: a block
  // stack's backward with those products held back, then their weight pass); 0 = not measured
  // (the cost model's estimate by shape).
  double weight_share = 0;
  // Seconds of this device's compute lost per byte it sends or receives while computing (profile
  // version 9): messages cost CPU time (copies, the kernel's TCP work, Gloo's threads), taken from
  // the same cores or CPU quota the compute runs on. Measured as a block's forward and backward
  // slowed by a stream of round trips to another rank. 0: not measured (older profiles, one rank).
  double comm_cpu_s_per_byte = 0;
  // The share of a block's time a tensor-parallel member computes whole whatever its share of the
  // heads (norms, the residual stream, rotary positions, the copies around its products; profile
  // version 10): a member holding fraction f of the heads computes f + tp_whole_share * (1 - f) of
  // the block. Measured on the first member of an even pair with its sums left out. 0: not
  // measured (older profiles), the share alone.
  double tp_whole_share = 0;
  // A tensor-parallel member's compute measured per shard size (profile version 13): (f, share)
  // for each piece timed, f the fraction of the heads it holds (the smallest piece a split allows,
  // and half), share its time over the whole block's, sums left out. Increasing in f. The cost
  // model interpolates between them and (1, 1) (CostContext::tp_block_share) rather than assume
  // tp_whole_share's line holds for small pieces. Empty: not measured (older profiles).
  std::vector<std::pair<double, double>> tp_shard_shares;
  // A CPU quota (cgroup CFS: a container's CPU limit, the emulator's devices), as it shows to a
  // rank that waits (profile version 12). The quota hands out its CPU per period, so a rank that
  // waited through a period computes QUOTA_BURST_S at the core's full speed (measured: the kernel
  // throttles on its timer tick, so more than quota x period) before it is held to
  // QUOTA_FRACTION of the core, its steady rate (what every time above is). A
  // tensor-parallel member computing a few milliseconds between sums gains it (CostContext::
  // tp_member_s). quota_fraction 1 and quota_burst_s 0: none showed (a core or GPU of its own,
  // older profiles).
  double quota_fraction = 1;
  double quota_burst_s = 0;
};

struct LinkProfile {
  std::string host_a, host_b;
  double bytes_per_s = 0, latency_s = 0;          // point to point
  double allreduce_bytes_per_s = 0;                // measured ring all-reduce "bus" bandwidth, if any
};

// Tensor parallelism's sums between two devices, timed the way a TP stage runs them (profile
// version 7): both devices run one block as an even pair's members hold it, with its sums of
// BYTES over the pair, again and again; SECONDS is the time per sum inside the sums on the member
// that spent least there (training's ranks.json tp_comm_s measures the same). A pair has one
// entry per size measured (the smallest and largest micro-batch). It holds the wire time and what
// a CPU quota, Gloo's threads and the members' uneven arrival add to it.
struct TpSumProfile {
  std::string device_a, device_b;  // the cluster's device names
  double bytes = 0, seconds = 0;
};

struct MemoryProfile {
  double param_bytes_per_block = 0, param_bytes_embed = 0, param_bytes_head = 0;
  // Activations kept for backward, per sample: one block, the embedding, the head.
  double act_bytes_per_sample_block = 0, act_bytes_per_sample_embed = 0, act_bytes_per_sample_head = 0;
  // Bytes per parameter for weights + gradients + AdamW moments (4 + 4 + 8 in float32).
  double state_bytes_per_param_byte = 4.0;
  // LoRA: the param_bytes above are what trains (the adapters: synced, with gradients and AdamW
  // state); these are the frozen base's weights as held (int8 / nf4 storage included), which
  // only take memory. 0 without LoRA.
  double frozen_bytes_per_block = 0, frozen_bytes_embed = 0, frozen_bytes_head = 0;
};

struct Profile {
  ModelConfig model;
  std::map<std::string, DeviceProfile> devices;  // by device type
  std::vector<LinkProfile> links;                // measured host pairs (optional)
  std::vector<TpSumProfile> tp_sums;             // measured device pairs (optional)
  MemoryProfile memory;
  LoraConfig lora;  // what was measured trains LoRA adapters over a frozen base (rank 0: everything trains)
  double activation_bytes_per_sample() const;    // one hidden-state tensor crossing a stage boundary

  nlohmann::json to_json() const;
  static Profile from_json(const nlohmann::json& j, const std::string& where);
  static Profile load(const std::string& path);
  // Why this profile does not describe training CFG's model (another model, or LoRA settings that
  // change the costs: rank, targets, base storage); empty when it does.
  std::string mismatch(const Config& cfg) const;
  void save(const std::string& path) const;  // atomic
};

// DeviceProfile::step_noise from repeated timings. FIGURES: per figure (one slice at one
// micro-batch size), its rounds as (seconds per call, seconds timed). The rounds time the same work
// in windows spread over the whole measurement; a round's relative deviation from its figure's
// mean, times sqrt(its window), has the spread of one second of compute when disturbances are
// independent (a window of T seconds varies as 1/sqrt(T)). Pooled over the figures (rounds - 1
// degrees of freedom each); 0 without two rounds of anything; at most 0.5.
double pooled_step_noise(const std::vector<std::vector<std::pair<double, double>>>& figures);

// Least-squares line y = intercept + slope * x, neither part negative: noise can tilt it below
// zero at either end, and a time cannot be negative.
struct Line {
  double intercept = 0, slope = 0;
};
Line fit_line(const std::vector<double>& x, const std::vector<double>& y);

// A link from ping-pongs: BYTES ascending, SECONDS each size's fastest one-way time. The
// bandwidth from the two largest sizes (their difference cancels the latency and what is fixed per
// message; a least-squares line when they do not rise), the latency the least any size took beyond
// its bytes at that bandwidth (>= 0). A line through every size let one slow large message tilt
// it, and its intercept read 0-4.7 ms on the same emulated veth from one profile to the next; and
// every ping of the first size timed can be slow (a pair right after the compute figures: 4 KB
// took 2-4 ms where 256 KB then took 1.1 ms), so no one size decides the latency.
LinkProfile link_from_pings(const std::vector<double>& bytes, const std::vector<double>& seconds);

// Fills device types nobody measured from a measured one, scaled by the spec's speed (or flops)
// hints, and links nobody measured from the spec. Returns notes on what was estimated.
std::vector<std::string> complete_profile(Profile& p, const ClusterSpec& spec);

}  // namespace alloy::plan
