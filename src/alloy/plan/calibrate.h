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
#include <string>

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

struct Replan {
  bool change = false;       // the new plan is predicted faster by at least min_gain
  Plan plan;                 // the plan to run from here on (the current one when !change)
  PlanCost current, best;    // both predicted with the calibrated profile
  std::string text;
};

// Searches OPTIONS.strategy again on the calibrated profile and compares with CURRENT.
Replan replan(const Plan& current, const ClusterSpec& cluster, const Calibration& cal, const SearchOptions& options,
              double min_gain = 0.05);

}  // namespace alloy::plan
