#pragma once
// Calibration from a running job: a profile measures each device type on its own for a few
// seconds, and on a shared or throttled machine such a figure can be off by 10-35% for the whole
// run (measured on the 2-core VM: one profile put the 0.4-core device 34% slower than it then
// trained). The first steps of the job measure what matters, each rank's compute in the real
// schedule. Scaling each device type's costs by measured / predicted and searching again gives a
// plan made for the speeds the devices really have; the trainer switches to it (checkpoint, new
// layout, resume) when it is predicted faster by a margin. The margin (5%) is above what a few
// steps measure on that VM from one window to the next (a device's compute per sample varied by up
// to 10% between 4-step windows, and switching at 3% chased that noise back and forth).
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "alloy/core/plan.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"
#include "alloy/plan/search.h"

namespace alloy::plan {

struct Calibration {
  Profile profile;                       // the input profile, each type's compute scaled
  std::map<std::string, double> factor;  // device type -> measured / predicted compute
  std::string text;                      // one line per type, for the log
};

// MEASURED_COMPUTE: rank -> median seconds of forward and backward per step while PLAN ran. Types
// with no rank measured (or none predicted to compute) keep their figures. Factors are clamped
// to [1/4, 4]: a measurement further off than that is a stall, not a speed.
Calibration calibrate(const Plan& plan, const ClusterSpec& cluster, const Profile& profile,
                      const std::map<int, double>& measured_compute);

// The batch split of a running plan, corrected by what each pipeline took. Calibrating device
// types fixes compute per block, but a pipeline's schedule also waits (fill and drain, transfers
// between stages, stages sharing a core) more or less than predicted, and at every step the other
// replicas then wait for it: on the emulated 3-device pool a pipeline 7% over its prediction made
// the fast device wait 170 ms of a 1.9 s step. MEASURED_PHASE: rank -> median seconds from a
// step's start to the rank's last schedule action. Each pipeline's predicted makespan is scaled by
// measured / predicted (clamped to [1/2, 2]); samples then move between pipelines, micro-batch
// sizes re-chosen among OPTIONS' candidates, while the predicted step with those factors falls.
// The margin is smaller than a layout switch's (5%): the layout stays, so only the pipelines'
// own measurements enter, not the whole profile's noise, and a split that overshoots is
// corrected at the next calibration. Checked offline on the saved runs of the 3-device pool: the
// two worst (0.80 and 0.85 of the devices' sum) were predicted 8.3% and 2.8% faster rebalanced,
// the three others unchanged.
struct Rebalance {
  bool change = false;          // the new split is predicted faster by at least min_gain
  Plan plan;                    // same layout, new samples per pipeline (the input when !change)
  double current_s = 0, best_s = 0;  // step predicted with the pipelines' factors
  std::vector<double> factor;   // per pipeline: measured / predicted makespan
  std::string text;
};
Rebalance rebalance(const Plan& plan, const ClusterSpec& cluster, const Profile& profile,
                    const std::map<int, double>& measured_phase, const SearchOptions& options, double min_gain = 0.02);

struct Replan {
  bool change = false;       // the new plan is predicted faster by at least min_gain
  Plan plan;                 // the plan to run from here on (the current one when !change)
  PlanCost current, best;    // both predicted with the calibrated profile
  // The batch split's check (for replan.json): set when the layout stayed and every pipeline's
  // phase was measured; split->change means the new plan is that rebalanced split.
  std::optional<Rebalance> split;
  std::string text;
};

// Searches OPTIONS.strategy again on the calibrated profile and compares with CURRENT. When the
// running layout stays and MEASURED_PHASE is given, its batch split is rebalanced (above).
Replan replan(const Plan& current, const ClusterSpec& cluster, const Calibration& cal, const SearchOptions& options,
              double min_gain = 0.05, const std::map<int, double>* measured_phase = nullptr);

// Try and revert. A calibration can mislead: under a CPU quota a rank that computes in short
// bursts between long waits runs each burst at a whole core's speed, so it reads faster than it
// trains once it is given the work (on the emulated shared-line pool the quarter device read
// x0.39, and the plan made from it took the step from 2.09 s to 4.41 s). Ignoring such readings
// would also ignore the correction re-planning exists for (a device the profile undersold gets
// little work, and its real speed shows only in short bursts too). So every plan the job runs
// keeps its measured step, and a measured step outranks a predicted one: when the running plan
// measures slower than a plan the job ran before by more than the margin, and the speeds just
// measured agree (they predict that plan faster by the margin too; a machine that got slower for
// every plan is no reason to go back), the job goes back to the fastest of those and stops
// re-planning.
struct TriedPlan {
  Plan plan;
  int64_t calibrated_after_step = 0;  // the calibration that measured it
  double measured_step_s = 0;         // the lower median of its steps
  PlanCost calibrated;                // its prediction from that calibration
};
// The index in TRIED of the plan to go back to, or nullopt. TRIED's last entry is the running plan.
std::optional<size_t> revert_target(const std::vector<TriedPlan>& tried, double margin = 0.05);

}  // namespace alloy::plan
