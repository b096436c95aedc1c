#include "alloy/plan/calibrate.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "alloy/plan/cost_model.h"
#include "alloy/plan/planner.h"

namespace alloy::plan {
namespace {
std::string f2(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", v);
  return b;
}
std::string ms(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f ms", s * 1e3);
  return b;
}
void scale(MicroBatchCost& c, double k) {
  c.fixed_s *= k, c.per_sample_s *= k;
  for (int i = 0; i < c.n; ++i) c.t[static_cast<size_t>(i)] *= k;
}
nlohmann::json layout(const Plan& p) {
  nlohmann::json j = p.to_json();
  j.erase("predicted");
  return j;
}
}  // namespace

Calibration calibrate(const Plan& plan, const ClusterSpec& cluster, const Profile& profile,
                      const std::map<int, double>& measured_compute) {
  const PlanCost predicted = simulate_plan(plan, cluster, profile);
  std::map<std::string, double> meas, pred;
  std::map<std::string, int> ranks;
  for (const auto& s : predicted.stages) {
    auto it = measured_compute.find(s.rank);
    const double p = s.forward_s + s.backward_s;
    if (it == measured_compute.end() || !(it->second > 0) || !(p > 0)) continue;
    meas[s.type] += it->second;
    pred[s.type] += p;
    ++ranks[s.type];
  }
  Calibration c;
  c.profile = profile;
  std::ostringstream o;
  for (const auto& [type, m] : meas) {
    const double k = std::clamp(m / pred[type], 0.25, 4.0);
    c.factor[type] = k;
    DeviceProfile& d = c.profile.devices.at(type);
    for (MicroBatchCost* mc : {&d.block_fwd, &d.block_bwd, &d.embed_fwd, &d.embed_bwd, &d.head_fwd, &d.head_bwd}) scale(*mc, k);
    d.optimizer_s_per_param *= k;
    o << "  " << type << ": measured " << ms(m / ranks[type]) << " of compute per step against " << ms(pred[type] / ranks[type])
      << " predicted" << (ranks[type] > 1 ? " (mean of " + std::to_string(ranks[type]) + " ranks)" : "") << ": x" << f2(k)
      << "\n";
  }
  c.text = o.str();
  return c;
}

Replan replan(const Plan& current, const ClusterSpec& cluster, const Calibration& cal, const SearchOptions& options,
              double min_gain) {
  Replan r;
  r.current = simulate_plan(current, cluster, cal.profile);
  PlanReport found = make_plan(cluster, cal.profile, options, false);
  r.best = found.chosen.cost;
  const bool same = layout(found.chosen.plan) == layout(current);
  r.change = !same && r.best.step_s < r.current.step_s * (1.0 - min_gain);
  r.plan = r.change ? found.chosen.plan : current;
  r.plan.predicted = (r.change ? r.best : r.current).to_json();
  std::ostringstream o;
  if (same) {
    o << "the calibrated profile gives the same plan: predicted " << ms(r.current.step_s) << " per step\n";
  } else {
    o << "with the calibrated profile: the running plan " << ms(r.current.step_s) << " per step, the best found "
      << ms(r.best.step_s) << " (" << f2(100.0 * (r.current.step_s - r.best.step_s) / r.current.step_s) << "% less)";
    if (r.change)
      o << ": switching to\n" << found.chosen.plan.describe();
    else
      o << ": keeping the running plan (a switch needs " << f2(100.0 * min_gain) << "%)\n";
  }
  r.text = o.str();
  return r;
}

}  // namespace alloy::plan
