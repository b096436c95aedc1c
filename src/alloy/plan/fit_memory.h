#pragma once
// Plans that fit memory: which holder sets shard (ZeRO-1 or 3, even shares or shares by memory)
// and which stages recompute their activations, so that every rank fits its device's memory_gb,
// the fastest such choice as simulate_plan prices it (cost_model.h).
//
// Greedy from full replicas: while some rank overflows, every single change that could help one
// of the overflowing ranks (recompute its stage; shard one of its holder sets at a higher stage,
// evenly or by memory) is priced, and the one that fits fastest (if any fits) or leaves the least
// overflow is taken. Then each change is undone where the plan still fits and is no slower. ZeRO-2
// is never chosen: it holds what ZeRO-1 holds (the gradients still land in full tensors) for the
// same traffic. ZeRO-3 only where the runtime can run it (members with the same layers, stage
// position and micro-batch count, dist/zero3.h); sets that grad_sync compresses are not sharded.
#include <string>
#include <vector>

#include "alloy/core/plan.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/profile.h"

namespace alloy::plan {

struct FitResult {
  bool fits = false;
  PlanCost cost;                     // of the plan as left
  std::vector<std::string> changes;  // what was sharded or recomputed, and for whom
};

// Sets PLAN's sharding entries and stages' recompute (both cleared first). When nothing fits,
// PLAN holds the choice with the least overflow and COST explains it.
FitResult fit_memory(Plan& plan, const ClusterSpec& cluster, const Profile& profile);

}  // namespace alloy::plan
