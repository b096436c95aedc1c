#pragma once
// Internal to the cost model (cost_model.cpp) and the memory fitting (fit_memory.cpp): what a
// plan's sharding entries save and cost each rank. The model is described in cost_model.h.
#include <cstdint>
#include <utility>
#include <vector>

#include "alloy/core/plan.h"
#include "alloy/plan/cost_model.h"

namespace alloy::plan::detail {

struct RankShard {
  // Parameter bytes whose weights / gradients / AdamW moments other holders keep for this rank.
  double weights_saved = 0, grads_saved = 0, optimizer_saved = 0;
  double gathered = 0;        // ZeRO-3: the two largest of its sharded layers, resident at once
  double param_gather_s = 0;  // ZeRO-1/2: the slowest of its sets' all-gathers after the optimizer
  int64_t zero = 0;           // highest stage among its sets
  double shard = 1;           // its share of its largest sharded set
  std::vector<double> unit_gather_s;  // ZeRO-3: per parameter unit (CostContext's numbering), its gather; 0 = not sharded
};

// Each pipeline's stages as holders (ids = ranks), for CostContext::sync_sets; HEADS (the model's)
// turn a cut MLP's mlp_cut into the share of its columns.
std::vector<std::vector<CostContext::Holder>> plan_holders(const Plan& plan, int64_t heads);

// Per rank (index = rank). SETS: ctx.sync_sets of HOLDERS (ids = ranks); DEV_OF: rank -> device.
// Sets without a plan entry are full replicas (stage 0).
std::vector<RankShard> rank_shards(const Plan& plan, const CostContext& ctx, const std::vector<CostContext::SyncSet>& sets,
                                   const std::vector<int>& dev_of);

// Exposed ZeRO-3 gather time of one micro-batch of M samples on a stage (blocks [BEGIN, END)),
// forward and backward: the first layer's gather, then each gather beyond the layer before it.
std::pair<double, double> zero3_exposed_s(const CostContext& ctx, const RankShard& rs, int type, int64_t begin, int64_t end, bool first,
                                          bool last, bool recompute, int64_t m);

}  // namespace alloy::plan::detail
