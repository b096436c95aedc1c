#pragma once
// Internal to the cost model (cost_model.cpp): what a tensor-parallel stage costs per micro-batch.
// The model is described in docs/DESIGN.md ("Tensor parallelism", Planner).
#include <cstdint>
#include <vector>

#include "alloy/core/plan.h"
#include "alloy/plan/cost_model.h"

namespace alloy::plan::detail {

// Rank K's share of a tensor-parallel stage's heads (1 for a stage of one rank).
double tp_share(const StagePlan& st, const ModelConfig& model, size_t k);

struct TpStageTime {
  double forward_s = 0, backward_s = 0, comm_s = 0;  // per micro-batch
};

// Each member's compute for one micro-batch of M samples (its heads' share on its own type, the
// recomputed forward included, no sums), in rank order.
struct TpMemberTime {
  double forward_s = 0, backward_s = 0;
};
std::vector<TpMemberTime> tp_member_times(const CostContext& ctx, const ModelConfig& model, const StagePlan& st,
                                          const std::vector<int>& dev_of, bool first, bool last, int64_t m);

// One micro-batch of M samples through the tensor-parallel stage ST (FIRST / LAST: it holds the
// embedding / head); DEV_OF: rank -> device.
TpStageTime tp_stage_time(const CostContext& ctx, const ModelConfig& model, const StagePlan& st, const std::vector<int>& dev_of,
                          bool first, bool last, int64_t m);

}  // namespace alloy::plan::detail
