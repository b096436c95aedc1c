#pragma once
// Where gradient sync may be lossy: which links of a cluster are slow, and which pairs of a plan's
// ranks they join. With grad_sync.scope slow-links the runtime compresses only what crosses these
// (dist/sync_layout.h); the cost model prices the same split.
#include <utility>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/core/plan.h"
#include "alloy/plan/cluster.h"

namespace alloy::plan {

// Links below this many Gbit/s are slow: grad_sync.slow_link_gbps, or (0) a quarter of the fastest
// link between two different hosts of the cluster.
double slow_link_threshold_gbps(const ClusterSpec& cluster, const GradSyncConfig& g);

// The device a rank runs on: its stage's `device` name when the plan names one, else device RANK
// (the emulator's convention: rank i is device i). Throws InputError when neither exists.
int device_of_rank(const Plan& plan, const ClusterSpec& cluster, int rank);

// Whether the runtime looks at the plan's slow links under G: scope slow-links compresses across
// them, and exact sets (allreduce auto) sum along trees around them.
bool needs_slow_links(const GradSyncConfig& g);

// Pairs of ranks (a < b) on different hosts whose link is slow.
std::vector<std::pair<int, int>> slow_rank_pairs(const Plan& plan, const ClusterSpec& cluster, const GradSyncConfig& g);

// The plan's gradient sync from the config: a plan made here (from flags, a HeteroShard file, the
// planner) takes the config's grad_sync whole; a plan read from a file keeps its own, except for
// the keys the config sets explicitly. Validates the result against the config's model, naming
// WHERE (the plan's source) in an error.
void apply_grad_sync(Plan& plan, const Config& cfg, bool plan_from_file, const std::string& where = "plan");

}  // namespace alloy::plan
