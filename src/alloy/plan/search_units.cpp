// The search's last phase: pipeline boundaries inside blocks (plan/search.h, refine_units).
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <sstream>
#include <string>

#include "alloy/core/error.h"
#include "alloy/plan/calibrate.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/search.h"

namespace alloy::plan {

namespace {

constexpr size_t kRebalanceUpTo = kShortSplitUpTo;

std::string layout_text(const Plan& plan) {
  std::string out;
  for (const auto& pl : plan.pipelines) {
    if (pl.stages.size() < 2) continue;
    if (!out.empty()) out += "; ";
    for (size_t s = 0; s < pl.stages.size(); ++s)
      out += (s ? " -> " : "") + (pl.stages[s].device.empty() ? "rank " + std::to_string(pl.stages[s].ranks[0]) : pl.stages[s].device) +
             " " + blocks_text(pl.stages[s].unit_begin(), pl.stages[s].unit_end()) +
             (pl.stages[s].floats() ? " (its last half block in " + std::to_string(pl.float_count(s)) + " of " +
                                          std::to_string(pl.num_micro_batches) + " micro-batches)"
              : pl.stages[s].cuts_mlp() ? " (its last MLP's columns of " + std::to_string(pl.stages[s].mlp_cut) + " heads)"
                                        : "");
  }
  return out;
}

// A note on a refinement the model found faster but not by MIN_GAIN, so the plan keeps its
// boundaries: what it was and what it predicted.
std::string not_kept(const std::string& what, const Plan& plan, const PlanCost& cost, const PlanCost& kept, double min_gain) {
  std::ostringstream o;
  o.precision(4);
  o << what << ": not used; the best (" << layout_text(plan) << ") predicts " << cost.step_s * 1e3 << " ms against "
    << kept.step_s * 1e3 << " ms without; kept only for a predicted gain of " << min_gain * 100 << "%";
  return o.str();
}

}  // namespace

PlanCost priced_rebalanced(Plan& cand, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  PlanCost c = simulate_plan(cand, cluster, profile);
  if (cand.pipelines.size() > 1 && cand.pipelines.size() <= kRebalanceUpTo) {
    std::map<int, double> phase;
    for (size_t q = 0; q < cand.pipelines.size(); ++q)
      for (const auto& st : cand.pipelines[q].stages) phase[st.ranks[0]] = c.pipelines[q].phase_s;
    Rebalance rb = rebalance(cand, cluster, profile, phase, options, 0.0);
    if (rb.change) {
      try {
        PlanCost rc = simulate_plan(rb.plan, cluster, profile);
        if (rc.fits && rc.step_s < c.step_s) cand = std::move(rb.plan), c = rc;
      } catch (const InputError&) {
        // A re-split the pipeline cannot take (an interleaved one's micro-batches must stay a
        // multiple of its ranks): the split as it was.
      }
    }
  }
  return c;
}

namespace {

// The floating boundaries of PLAN's pipeline P at boundary S (between stages S and S + 1) worth
// pricing: the unit on either side of a whole cut, or another share for a boundary that floats
// already, each in k of M micro-batches for k = 1..M-1 (every share the pipeline can express).
std::vector<Plan> floating_candidates(const Plan& plan, size_t p, size_t s) {
  std::vector<Plan> out;
  const PipelinePlan& pl = plan.pipelines[p];
  const StagePlan &a = pl.stages[s], &b = pl.stages[s + 1];
  if (a.tp() > 1 || b.tp() > 1 || pl.num_micro_batches < 2) return out;
  const double M = static_cast<double>(pl.num_micro_batches);
  std::vector<std::pair<int64_t, int64_t>> layouts;  // (a's end, b's begin) with one unit shared
  if (a.floats()) layouts.push_back({a.unit_end(), b.unit_begin()});
  else layouts = {{a.unit_end() + 1, b.unit_begin()}, {a.unit_end(), b.unit_begin() - 1}};
  for (const auto& [a_end, b_begin] : layouts)
    for (int64_t k = 1; k < pl.num_micro_batches; ++k) {
      Plan cand = plan;
      StagePlan &ca = cand.pipelines[p].stages[s], &cb = cand.pipelines[p].stages[s + 1];
      if (a.floats() && k == pl.float_count(s)) continue;
      if (a_end > cb.unit_end() || b_begin < ca.unit_begin()) continue;
      ca.set_units(ca.unit_begin(), a_end);
      cb.set_units(b_begin, cb.unit_end());
      ca.float_share = static_cast<double>(k) / M;
      out.push_back(std::move(cand));
    }
  return out;
}

// The cuts inside an MLP of PLAN's pipeline P at boundary S worth pricing: inside the MLP half
// on either side of a whole cut (or, for a cut already there, its other column splits), the first
// stage computing the columns of k heads, k = 1..heads-1.
std::vector<Plan> mlp_cut_candidates(const Plan& plan, size_t p, size_t s, int64_t heads) {
  std::vector<Plan> out;
  const PipelinePlan& pl = plan.pipelines[p];
  const StagePlan &a = pl.stages[s], &b = pl.stages[s + 1];
  if (a.tp() > 1 || b.tp() > 1 || a.floats() || b.floats() || (s > 0 && pl.stages[s - 1].floats())) return out;
  int64_t shared = -1;  // the MLP half both stages would hold
  if (a.cuts_mlp()) shared = a.unit_end() - 1;
  else shared = a.unit_end() % 2 == 0 ? a.unit_end() - 1 : a.unit_end();
  for (int64_t k = 1; k < heads; ++k) {
    if (a.cuts_mlp() && k == a.mlp_cut) continue;
    Plan cand = plan;
    StagePlan &ca = cand.pipelines[p].stages[s], &cb = cand.pipelines[p].stages[s + 1];
    if (shared + 1 > cb.unit_end() || shared < ca.unit_begin()) continue;
    ca.set_units(ca.unit_begin(), shared + 1);
    cb.set_units(shared, cb.unit_end());
    ca.mlp_cut = k;
    out.push_back(std::move(cand));
  }
  return out;
}

}  // namespace

void refine_units(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  // Sharding entries name holder sets, which a boundary inside a block changes.
  if (!result.plan.sharding.empty()) return;
  const double before = result.cost.step_s;
  Plan best = result.plan;
  PlanCost best_cost = result.cost;
  // Hill-climbing by half blocks from the search's whole-block optimum: each round moves the one
  // boundary that gains most. Every move is priced by simulate_plan, the model that ranked the
  // layouts, so a move is kept only where the model sees a gain beyond its rounding (0.2%).
  // Bounded by the search's time budget: each move costs a simulation (and a rebalance, which
  // simulates the plan once per sample moved, so only for a few pipelines).
  const auto t0 = std::chrono::steady_clock::now();
  auto out_of_time = [&]() { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > options.time_budget_s; };
  for (int round = 0; round < 4 * static_cast<int>(profile.model.layers) && !out_of_time(); ++round) {
    Plan round_best;
    PlanCost round_cost = best_cost;
    bool found = false;
    for (size_t p = 0; p < best.pipelines.size(); ++p)
      for (size_t s = 0; s + 1 < best.pipelines[p].stages.size(); ++s)
        for (int delta : {-1, 1}) {
          Plan cand = best;
          StagePlan& a = cand.pipelines[p].stages[s];
          StagePlan& b = cand.pipelines[p].stages[s + 1];
          const int64_t cut = a.unit_end() + delta;
          if (cut <= a.unit_begin() || cut >= b.unit_end()) continue;  // a stage would be empty
          a.set_units(a.unit_begin(), cut);
          b.set_units(cut, b.unit_end());
          PlanCost c = priced_rebalanced(cand, cluster, profile, options);
          if (c.fits && c.step_s < round_cost.step_s * (1 - 2e-3)) round_best = std::move(cand), round_cost = c, found = true;
        }
    if (!found) break;
    best = std::move(round_best);
    best_cost = round_cost;
  }
  // Greedy from (PLAN, COST), as above but over CANDIDATES(plan, p, s) at each boundary: each round
  // keeps the one candidate that gains most (over 0.2%), its batch re-split; at most four rounds.
  auto climb = [&](Plan& plan, PlanCost& cost, const std::function<std::vector<Plan>(const Plan&, size_t, size_t)>& candidates) {
    for (int round = 0; round < 4 && !out_of_time(); ++round) {
      Plan round_best;
      PlanCost round_cost = cost;
      bool found = false;
      for (size_t p = 0; p < plan.pipelines.size(); ++p)
        for (size_t s = 0; s + 1 < plan.pipelines[p].stages.size(); ++s)
          for (Plan& cand : candidates(plan, p, s)) {
            if (out_of_time()) break;
            PlanCost c;
            try {
              c = priced_rebalanced(cand, cluster, profile, options);
            } catch (const InputError&) {
              continue;  // a stage would run no unit of its own
            }
            if (c.fits && c.step_s < round_cost.step_s * (1 - 2e-3)) round_best = std::move(cand), round_cost = c, found = true;
          }
      if (!found) return;
      plan = std::move(round_best);
      cost = round_cost;
    }
  };
  // Then cuts inside an MLP, by columns, greedy as above; kept for a clear predicted gain only
  // (kMlpCutMinGain).
  if (options.mlp_cuts && profile.model.ffn_resolved() % profile.model.heads == 0) {
    Plan cut = best;
    PlanCost cut_cost = best_cost;
    climb(cut, cut_cost, [&](const Plan& pl, size_t p, size_t s) { return mlp_cut_candidates(pl, p, s, profile.model.heads); });
    if (cut_cost.step_s < best_cost.step_s * (1 - kMlpCutMinGain)) best = std::move(cut), best_cost = cut_cost;
    else if (cut_cost.step_s < best_cost.step_s) result.notes.push_back(not_kept("a boundary inside an MLP", cut, cut_cost, best_cost, kMlpCutMinGain));
  }
  // Then floating boundaries: a boundary's neighbouring unit shared by its two stages, run by the
  // first in a share of the micro-batches, so the average split moves by 1/M of a half block
  // (PipelinePlan::cut). Greedy as above: each round keeps the one boundary and share that gains
  // most, with the batch re-split. Whole-block stages stay whole where nothing floats.
  if (options.float_boundaries) {
    Plan floated = best;
    PlanCost floated_cost = best_cost;
    climb(floated, floated_cost, floating_candidates);
    // Kept only for a clear predicted gain: measured on the emulated pools, floating plans ran
    // 5-13% slower than predicted where fixed boundaries ran 4-5% slower (see kFloatMinGain).
    if (floated_cost.step_s < best_cost.step_s * (1 - kFloatMinGain)) best = std::move(floated), best_cost = floated_cost;
    else if (floated_cost.step_s < best_cost.step_s)
      result.notes.push_back(not_kept("a floating boundary", floated, floated_cost, best_cost, kFloatMinGain));
  }
  if (best_cost.step_s >= before) return;
  std::ostringstream o;
  o.precision(4);
  o << "pipeline boundaries inside blocks (" << layout_text(best) << "; micro-batches";
  for (const auto& pl : best.pipelines) o << " " << pl.micro_batch_size << "x" << pl.num_micro_batches;
  o << "): predicted " << best_cost.step_s * 1e3 << " ms instead of "
    << before * 1e3 << " ms with whole blocks";
  result.notes.push_back(o.str());
  adopt_plan(result, std::move(best), best_cost);
}

void adopt_plan(SearchResult& result, Plan plan, const PlanCost& cost) {
  const std::string strategy = result.plan.predicted.is_object() ? result.plan.predicted.value("strategy", result.strategy) : result.strategy;
  result.plan = std::move(plan);
  result.cost = cost;
  result.plan.predicted = cost.to_json();
  result.plan.predicted["strategy"] = strategy;
  result.search_step_s = cost.step_s;
}

}  // namespace alloy::plan
