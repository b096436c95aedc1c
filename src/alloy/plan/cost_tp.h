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
  // Under a split backward (zb-h1): the weight pass (the slowest member's; no sums in it), and the
  // backward with that part held back (its sums all stay there).
  double weight_s = 0, input_backward_s = 0;
};

// Each member's compute for one micro-batch of M samples (its heads' share on its own type, the
// recomputed forward included, no sums), in rank order.
struct TpMemberTime {
  double forward_s = 0, backward_s = 0;
  double weight_s = 0;  // the part of backward_s a zb-h1 weight pass runs: its projections' weight products
};
std::vector<TpMemberTime> tp_member_times(const CostContext& ctx, const ModelConfig& model, const StagePlan& st,
                                          const std::vector<int>& dev_of, bool first, bool last, int64_t m);

// One micro-batch of M samples through the tensor-parallel stage ST (FIRST / LAST: it holds the
// embedding / head); DEV_OF: rank -> device.
TpStageTime tp_stage_time(const CostContext& ctx, const ModelConfig& model, const StagePlan& st, const std::vector<int>& dev_of,
                          bool first, bool last, int64_t m);

}  // namespace alloy::plan::detail
