#pragma once
// `alloy profile`: measures, on the real ranks, what the cost model needs. One rank per device
// type times the forward and backward of one block, the embedding and the head at several
// micro-batch sizes (kept as points, plus a fitted line for larger sizes), the optimizer step per parameter and
// the activation memory per sample (all ranks compute at once while it does, see
// ProfileOptions::concurrent); one rank per host pair measures point-to-point latency and
// bandwidth (ping-pong at several message sizes); every pair of devices times tensor-parallel sums
// under compute (TpSumProfile). Rank 0 collects everything through the store.
#include <memory>
#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"

namespace alloy::dist {
class World;
}

namespace alloy::plan {

struct ProfileOptions {
  // Up to the planner's largest default candidate (8): costs per sample still fall a little
  // between 4 and 8, and a line fitted to small sizes alone overestimates the larger ones.
  std::vector<int64_t> micro_batch_sizes = {1, 2, 4, 8};
  int repeats = 5;            // link ping-pongs per message size (at most 3 on slow links)
  double window_s = 0.4;      // each compute figure averages calls over this long (spans CPU-quota periods)
  int rounds = 3;             // ... split into this many rounds, spread out in time; the median is kept
  int blocks_timed = 4;       // blocks timed together (at most the model's); their mean is the per-block figure
  std::vector<int64_t> message_bytes = {1 << 12, 1 << 18, 1 << 20, 1 << 21};
  bool measure_links = true;
  // Tensor parallelism's sums per device pair (Profile::tp_sums), in pools of at most 8 devices
  // (the planner's TP search looks no further): about a second per pair.
  bool measure_tp_sums = true;
  // Every rank times its device at once, as they all compute during training; the first device of
  // each type gives that type's figures. Measured on the 2-core VM: two cores streaming memory at
  // once get 35 GB/s each against 72 GB/s for one alone, and a device profiled on an otherwise
  // idle machine ran 10-15% slower in the pool than predicted. False: types take turns on an
  // idle machine (a device's speed alone).
  bool concurrent = true;
  // Where this rank computes: cpu, cuda or cuda:N (`alloy launch --devices`, train.device).
  std::string device = "cpu";
  // LoRA fine-tuning: slices are timed with their adapters over the frozen (maybe quantized) base,
  // so the figures include the adapters' path and the dequantization and lack the base's weight
  // gradients; the optimizer and memory figures count what trains and what is held.
  LoraConfig lora;
};

// Every rank of WORLD calls this (rank i runs on device i of SPEC); rank 0 returns the full
// profile. Without a world (single process), measures this process as every device type (the
// types' `speed` hints scale it) and takes link figures from the spec.
Profile run_profile(const ModelConfig& model, const ClusterSpec& spec, dist::World* world, const ProfileOptions& o = {});

// Compute figures of the device this process runs on.
DeviceProfile measure_device(const ModelConfig& model, const ProfileOptions& o, MemoryProfile* memory);

// A CPU quota as a rank sees it (DeviceProfile::quota_fraction, quota_burst_s), read from the
// times at which a loop of equal small pieces of work finished: STEADY, back to back for a while
// already; AFTER_WAITS, each started right after a wait longer than a quota's period. A gap of
// more than GAP_S between two pieces is the quota's throttling (or another process's turn). The
// fraction is the share of the steady run spent computing; the burst the median run from a wait
// to its first gap. {1, 0}: no quota showed (the fraction 0.95 or more, or no gap after a wait).
struct QuotaFigures {
  double fraction = 1, burst_s = 0;
};
QuotaFigures quota_from_times(const std::vector<double>& steady, const std::vector<std::vector<double>>& after_waits, double gap_s);
// The quota the calling thread runs under (about 1.1 s); {1, 0} on a GPU. DEVICE as
// ProfileOptions::device.
QuotaFigures measure_quota(const std::string& device);


}  // namespace alloy::plan
