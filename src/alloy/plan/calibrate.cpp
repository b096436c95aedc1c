#include "alloy/plan/calibrate.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <sstream>

#include "alloy/core/error.h"
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
  auto add = [&](int rank, const std::string& type, double p) {
    auto it = measured_compute.find(rank);
    if (it == measured_compute.end() || !(it->second > 0) || !(p > 0)) return;
    meas[type] += it->second;
    pred[type] += p;
    ++ranks[type];
  };
  for (const auto& s : predicted.stages) {
    // A tensor-parallel stage's members each measure their own compute (the trainer leaves the
    // sums out), so each calibrates its own type; before, only the first member's type learned.
    if (s.tp_members.empty()) add(s.rank, s.type, s.forward_s + s.backward_s);
    for (const auto& mc : s.tp_members) add(mc.rank, mc.type, mc.compute_s);
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
    d.comm_cpu_s_per_byte *= k;  // the messages' CPU time slows with the device's compute
    for (auto& [m, c] : d.codecs) c.encode_s_per_elem *= k, c.decode_s_per_elem *= k;
    o << "  " << type << ": measured " << ms(m / ranks[type]) << " of compute per step against " << ms(pred[type] / ranks[type])
      << " predicted" << (ranks[type] > 1 ? " (mean of " + std::to_string(ranks[type]) + " ranks)" : "") << ": x" << f2(k)
      << "\n";
  }
  c.text = o.str();
  return c;
}

Rebalance rebalance(const Plan& plan, const ClusterSpec& cluster, const Profile& profile,
                    const std::map<int, double>& measured_phase, const SearchOptions& options, double min_gain) {
  Rebalance rb;
  rb.plan = plan;
  const size_t n = plan.pipelines.size();
  if (n < 2) return rb;
  const PlanCost predicted = simulate_plan(plan, cluster, profile);
  rb.factor.assign(n, 1.0);
  for (size_t r = 0; r < n; ++r) {
    double m = 0;
    for (const auto& st : plan.pipelines[r].stages)
      for (int rank : st.ranks) {
        auto it = measured_phase.find(rank);
        if (it == measured_phase.end() || !(it->second > 0)) return rb;  // a pipeline unmeasured: no basis
        m = std::max(m, it->second);
      }
    const double p = predicted.pipelines[r].phase_s;
    if (!(p > 0)) return rb;
    rb.factor[r] = std::clamp(m / p, 0.5, 2.0);
  }
  // The step with each pipeline's makespan scaled: the slowest scaled makespan, plus what the
  // prediction puts after the makespans (the last gradient sync, the optimizer).
  auto score = [&](const Plan& p) {
    try {
      const PlanCost c = simulate_plan(p, cluster, profile);
      if (!c.fits) return std::numeric_limits<double>::infinity();
      double raw = 0, scaled = 0;
      for (size_t r = 0; r < n; ++r) {
        raw = std::max(raw, c.pipelines[r].phase_s);
        scaled = std::max(scaled, rb.factor[r] * c.pipelines[r].phase_s);
      }
      return scaled + (c.step_s - raw);
    } catch (const InputError&) {
      return std::numeric_limits<double>::infinity();
    }
  };
  auto scaled_phase = [&](const Plan& p, size_t r) {
    return rb.factor[r] * simulate_plan(p, cluster, profile).pipelines[r].phase_s;
  };
  const std::vector<int64_t> sizes = options.candidate_micro_batches();
  rb.current_s = score(plan);
  Plan best = plan;
  double best_s = rb.current_s;
  // Greedy: from the slowest pipeline, move the number of samples (up to the largest micro-batch
  // size) to the other pipeline that lowers the predicted step most; repeat while it falls.
  for (int round = 0; round < 64; ++round) {
    size_t hi = 0;
    for (size_t r = 1; r < n; ++r)
      if (scaled_phase(best, r) > scaled_phase(best, hi)) hi = r;
    Plan round_best = best;
    double round_s = best_s;
    const int64_t have = best.pipelines[hi].samples();
    // The sizes a pipeline may take N samples in: each candidate dividing N, and with short last
    // micro-batches its own size (only that: every size would multiply the simulations by the
    // number of candidates, and the search chose the size). A pipeline of one micro-batch stays
    // one, as train.rebalance keeps it (PipelinePlan::micro_batch_for): the planner chose it so its
    // buckets sum during the whole backward, and cutting 28 samples into 8 x 3 the last of 4 put the
    // sum back behind a quarter of it (the two-region pool's step went from 2.47 to 2.95 s).
    auto sizes_for = [&](const PipelinePlan& pl, int64_t count) {
      std::vector<int64_t> out;
      if (pl.num_micro_batches == 1) return std::vector<int64_t>{count};
      for (int64_t m : sizes)
        if (count % m == 0) out.push_back(m);
      if (options.short_micro_batches && count > pl.micro_batch_size && count % pl.micro_batch_size)
        out.push_back(pl.micro_batch_size);
      return out;
    };
    for (size_t lo = 0; lo < n; ++lo) {
      if (lo == hi) continue;
      for (int64_t d = 1; d <= sizes.back() && d < have; ++d) {
        const int64_t a = have - d, b = best.pipelines[lo].samples() + d;
        for (int64_t ma : sizes_for(best.pipelines[hi], a)) {
          for (int64_t mb : sizes_for(best.pipelines[lo], b)) {
            Plan cand = best;
            cand.pipelines[hi].set_samples(a, ma);
            cand.pipelines[lo].set_samples(b, mb);
            const double sc = score(cand);
            if (sc < round_s) round_s = sc, round_best = cand;
          }
        }
      }
    }
    if (!(round_s < best_s)) break;
    best = round_best, best_s = round_s;
  }
  rb.best_s = best_s;
  rb.change = best_s < rb.current_s * (1.0 - min_gain);
  std::ostringstream o;
  o << "pipelines measured against predicted makespan:";
  for (size_t r = 0; r < n; ++r) o << (r ? "," : "") << " " << r << " x" << f2(rb.factor[r]);
  o << "; with these the running split takes " << ms(rb.current_s);
  if (best_s < rb.current_s) {
    o << ", the best split " << ms(best_s) << " (";
    for (size_t r = 0; r < n; ++r) o << (r ? ", " : "") << best.pipelines[r].batch_text();
    o << ")" << (rb.change ? ": rebalancing" : ": keeping the split (a change needs " + f2(100.0 * min_gain) + "%)");
  }
  o << "\n";
  rb.text = o.str();
  if (rb.change) {
    rb.plan = best;
    rb.plan.predicted = simulate_plan(best, cluster, profile).to_json();
  }
  return rb;
}

Replan replan(const Plan& current, const ClusterSpec& cluster, const Calibration& cal, const SearchOptions& options,
              double min_gain, const std::map<int, double>* measured_phase) {
  Replan r;
  r.current = simulate_plan(current, cluster, cal.profile);
  // The notes' extra searches (a device left out, a larger batch) would only lengthen the pause.
  SearchOptions quiet = options;
  quiet.suggest_leaving_out = false;
  quiet.suggest_larger_batch = false;
  PlanReport found = make_plan(cluster, cal.profile, quiet, false);
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
      << ms(r.best.step_s)
      << (r.best.step_s < r.current.step_s ? " (" + f2(100.0 * (r.current.step_s - r.best.step_s) / r.current.step_s) + "% less)"
                                           : " (no faster)");
    if (r.change)
      o << ": switching to\n" << found.chosen.plan.describe();
    else
      o << ": keeping the running plan (a switch needs " << f2(100.0 * min_gain) << "%)\n";
  }
  if (!r.change && measured_phase) {
    Rebalance rb = rebalance(current, cluster, cal.profile, *measured_phase, options);
    o << rb.text;
    if (rb.current_s > 0) r.split = rb;  // every pipeline was measured
    if (rb.change) {
      r.change = true;
      r.plan = rb.plan;
      r.best = simulate_plan(rb.plan, cluster, cal.profile);
      o << r.plan.describe();
    }
  }
  r.text = o.str();
  return r;
}

std::optional<size_t> revert_target(const std::vector<TriedPlan>& tried, double margin) {
  if (tried.size() < 2) return std::nullopt;
  const double running = tried.back().measured_step_s;
  std::optional<size_t> best;
  for (size_t i = 0; i + 1 < tried.size(); ++i) {
    const double s = tried[i].measured_step_s;
    if (s <= 0) continue;  // not measured
    if (!best || s < tried[*best].measured_step_s) best = i;
  }
  if (!best || !(running > tried[*best].measured_step_s * (1.0 + margin))) return std::nullopt;
  return best;
}

}  // namespace alloy::plan
