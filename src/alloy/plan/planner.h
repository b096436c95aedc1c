#pragma once
// What `alloy plan`, `alloy profile` and `alloy train --plan auto` print: the chosen plan next to
// the baselines, with the predicted step time broken down and memory against capacity, and after
// a run the predicted against the measured step time per stage.
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"
#include "alloy/plan/search.h"

namespace alloy::plan {

std::string describe_profile(const Profile& p);

// A cluster from a ClusterSpec YAML, a PTAFM data-centre description (recognised by NUM_STAGE; its
// stage count goes to *PTAFM_STAGES) or a HeteroShard hetero_config.json (recognised by "workers").
ClusterSpec load_cluster(const std::string& path, int* ptafm_stages = nullptr);

struct PlanReport {
  SearchResult chosen;
  std::vector<SearchResult> baselines;  // the other strategies, for comparison
  std::vector<std::string> failed;      // strategies that found nothing that fits, with why
  // The best plan under the other gradient sync: exact when the chosen plan compresses, and
  // compressed when lossy compression was allowed but not worth it. Absent otherwise.
  std::optional<SearchResult> other_sync;
  std::string text() const;             // the plan, its breakdown, memory, and the comparison table
};

// The gradient sync grad_sync.allow_lossy lets the planner try when the user named none: DGC at
// the configured density, compressing only across slow links, aligned adaptive fusion.
GradSyncConfig lossy_candidate(const GradSyncConfig& g);

// Runs STRATEGY and, when COMPARE, every other strategy on the same inputs. Gradient sync follows
// options.grad_sync; lossy compression is used only when it names a lossy method, or when
// allow_lossy is set and the lossy_candidate is predicted at least 5% faster than exact sync.
PlanReport make_plan(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options, bool compare = true);

// A report whose chosen plan is PLAN (read from WHERE; validated against MODEL), predicted on
// the same inputs, with the strategies' plans of SEARCHED (their chosen one included) beside it.
PlanReport evaluate_plan(const Plan& plan, const std::string& where, const ModelConfig& model, const ClusterSpec& cluster,
                         const Profile& profile, const PlanReport& searched);

// Table of predicted (PLAN_PREDICTED: PlanCost::to_json) against measured (RANKS: the run's
// ranks.json) step time per stage; MEASURED_STEP_S is the job's median step time. A prediction
// with "calibrated_after_step" says it comes from that calibration; EARLIER (the plan's own,
// from the profile) is then shown beside it.
std::string predicted_vs_measured(const nlohmann::json& plan_predicted, const nlohmann::json& ranks, double measured_step_s,
                                  const nlohmann::json* earlier = nullptr);

}  // namespace alloy::plan
