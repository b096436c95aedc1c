#pragma once
// The job's side of re-planning from measured speeds (train.replan_step, --plan auto). Each call
// says what the running plan's steps measured; the replanner calibrates the profile with it,
// searches again and decides: keep the plan, switch to a plan predicted faster, rebalance the
// batch split, or go back to a plan the job already ran and measured faster (plan::revert_target).
// Rank 0 calls it; the trainer switches at a checkpoint. Kept free of LibTorch and of files so the
// decisions can be tested on made-up measurements.
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "alloy/core/plan.h"
#include "alloy/plan/calibrate.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"
#include "alloy/plan/search.h"

namespace alloy::plan {

class Replanner {
 public:
  // MIN_GAIN: how much faster a searched plan must be predicted to be switched to; REVERT_MARGIN:
  // how much slower the running plan must measure than one run before to go back to it.
  Replanner(Plan running, ClusterSpec spec, Profile profile, SearchOptions options, double min_gain = 0.05,
            double revert_margin = 0.05);

  // After a switch the calibrated profile and the new plan become the running ones, so a later
  // call corrects what an earlier calibration got wrong (the profile's shape across micro-batch
  // sizes, a device read in bursts). Steps FROM..TO ran the running plan. COMPUTE and PHASE: rank -> median seconds of compute and
  // of step start to its last schedule action; STEP_S: the median step. Returns the plan to run
  // from here on, or null to keep the running one.
  std::shared_ptr<Plan> measured(int64_t from, int64_t to, const std::map<int, double>& compute,
                                 const std::map<int, double>& phase, double step_s);

  const Plan& running() const { return running_; }
  // One entry per call (replan.json's "replans").
  const nlohmann::json& events() const { return events_; }
  // The running plan's step as the latest calibration that measured it predicts it (what a
  // report compares the measured step with), with "calibrated_after_step"; null before any call.
  const nlohmann::json& calibrated_prediction() const { return calibrated_; }
  // The profile scaled by the latest measurements (profile-calibrated.json).
  const Profile& calibrated_profile() const { return latest_profile_; }
  bool reverted() const { return reverted_; }

 private:
  Plan running_;
  ClusterSpec spec_;
  Profile profile_, latest_profile_;
  SearchOptions options_;
  double min_gain_, revert_margin_;
  nlohmann::json events_ = nlohmann::json::array();
  nlohmann::json calibrated_;
  std::vector<TriedPlan> tried_;
  bool reverted_ = false;
};

}  // namespace alloy::plan
