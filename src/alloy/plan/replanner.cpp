#include "alloy/plan/replanner.h"

#include <cstdio>
#include <utility>

#include "alloy/core/log.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/sync_scope.h"

namespace alloy::plan {

Replanner::Replanner(Plan running, ClusterSpec spec, Profile profile, SearchOptions options, double min_gain,
                     double revert_margin)
    : running_(std::move(running)),
      spec_(std::move(spec)),
      profile_(std::move(profile)),
      options_(std::move(options)),
      min_gain_(min_gain),
      revert_margin_(revert_margin) {
  latest_profile_ = profile_;
}

std::shared_ptr<Plan> Replanner::measured(int64_t from, int64_t to, const std::map<int, double>& compute,
                                          const std::map<int, double>& phase, double step_s) {
  Calibration cal = calibrate(running_, spec_, profile_, compute);
  Replan rp = replan(running_, spec_, cal, options_, min_gain_, &phase);
  tried_.push_back({running_, to, step_s, rp.current});
  std::optional<size_t> back = reverted_ ? std::nullopt : revert_target(tried_, revert_margin_);
  // A slower step may also mean slower devices (another job on the machine): then the speeds just
  // measured predict the earlier plan no faster than the running one, and re-planning goes on
  // from them instead of going back.
  double earlier_now_s = 0;
  nlohmann::json declined;
  if (back) {
    earlier_now_s = simulate_plan(tried_[*back].plan, spec_, cal.profile).step_s;
    if (!(rp.current.step_s > earlier_now_s * (1.0 + revert_margin_))) {
      char msg[320];
      std::snprintf(msg, sizeof msg,
                    "the running plan measured slower than the plan run up to step %lld, but the speeds just measured "
                    "predict that one no faster (%.0f ms against %.0f ms): the devices are slower, not the plan",
                    static_cast<long long>(tried_[*back].calibrated_after_step), earlier_now_s * 1e3, rp.current.step_s * 1e3);
      log_info(msg);
      declined = {{"calibrated_after_step", tried_[*back].calibrated_after_step},
                  {"measured_step_s", tried_[*back].measured_step_s},
                  {"now_predicted_s", earlier_now_s}};
      back.reset();
    }
  }
  log_info("re-planning with the compute measured in steps " + std::to_string(from) + "-" + std::to_string(to) + ":\n" + cal.text +
           (back ? "" : rp.text));
  nlohmann::json m = nlohmann::json::object(), f = nlohmann::json::object(), ph = nlohmann::json::object();
  for (const auto& [r, v] : compute) m[std::to_string(r)] = v;
  for (const auto& [r, v] : phase) ph[std::to_string(r)] = v;
  for (const auto& [t, v] : cal.factor) f[t] = v;
  nlohmann::json e = {{"step", to},
                      {"measured_compute_s", m},
                      {"measured_phase_s", ph},
                      {"measured_step_s", step_s},
                      {"factors", f},
                      {"running_plan_predicted_s", running_.predicted.value("step_s", 0.0)},
                      {"running_plan_calibrated_s", rp.current.step_s},
                      {"best_calibrated_s", rp.best.step_s},
                      {"switched", rp.change}};
  if (!declined.is_null()) e["not_reverted_to"] = declined;  // slower, but the new speeds explain it
  if (rp.split)
    e["rebalance"] = {{"pipeline_factors", rp.split->factor},
                      {"running_split_s", rp.split->current_s},
                      {"best_split_s", rp.split->best_s},
                      {"switched", rp.split->change}};
  // What a report compares the measured step with: the plan run from here on (kept, switched to
  // or rebalanced) as predicted with the speeds just measured; for a plan gone back to, as
  // predicted by the calibration that measured it.
  int64_t calibrated_after = to;
  if (back) {
    const TriedPlan& t = tried_[*back];
    char msg[400];
    std::snprintf(msg, sizeof msg,
                  "the running plan measured %.0f ms per step in steps %lld-%lld, slower than the %.0f ms of the plan "
                  "run up to step %lld: going back to that plan, and re-planning stops here (a measured step outranks "
                  "a predicted one)",
                  step_s * 1e3, static_cast<long long>(from), static_cast<long long>(to), t.measured_step_s * 1e3,
                  static_cast<long long>(t.calibrated_after_step));
    log_warn(msg);
    rp.change = true;
    rp.plan = t.plan;
    rp.plan.predicted = t.calibrated.to_json();
    calibrated_after = t.calibrated_after_step;
    e["switched"] = true;
    if (e.contains("rebalance")) e["rebalance"]["switched"] = false;  // what the search proposed is not run
    e["reverted_to"] = {{"calibrated_after_step", t.calibrated_after_step},
                        {"measured_step_s", t.measured_step_s},
                        {"calibrated_s", t.calibrated.step_s},
                        {"now_predicted_s", earlier_now_s}};
    reverted_ = true;
  } else if (reverted_ && rp.change) {
    log_info("keeping the plan gone back to: re-planning stopped there");
    rp.change = false;
    e["switched"] = false;
    if (e.contains("rebalance")) e["rebalance"]["switched"] = false;
  }
  calibrated_ = rp.change ? rp.plan.predicted : rp.current.to_json();
  if (calibrated_.is_object()) calibrated_["calibrated_after_step"] = calibrated_after;
  latest_profile_ = cal.profile;
  if (rp.change) e["plan"] = rp.plan.to_json();
  events_.push_back(std::move(e));
  if (!rp.change) return nullptr;
  Plan next = std::move(rp.plan);
  next.grad_sync = running_.grad_sync;  // the search plans layouts; the sync settings stay the user's
  next.slow_links = slow_rank_pairs(next, spec_, next.grad_sync);
  running_ = next;
  profile_ = cal.profile;
  return std::make_shared<Plan>(std::move(next));
}

}  // namespace alloy::plan
