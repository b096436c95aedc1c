// The search's interleaving phase (plan/search.h, consider_interleaving).
#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/search.h"

namespace alloy::plan {

namespace {

// Whether pipeline P of PLAN may be interleaved at all (what Plan::validate and the trainer accept).
bool may_interleave(const Plan& plan, size_t p) {
  const PipelinePlan& pl = plan.pipelines[p];
  const int64_t D = static_cast<int64_t>(pl.stages.size());
  if (pl.interleaved() || D < 2 || pl.floats() || pl.cuts_mlp() || pl.has_tensor_parallel()) return false;
  if (pl.num_micro_batches > D && pl.num_micro_batches % D != 0) return false;
  for (const auto& st : pl.stages)
    for (const auto& e : plan.sharding)
      if (e.stage > 0 && std::find(e.ranks.begin(), e.ranks.end(), st.ranks[0]) != e.ranks.end()) return false;
  return true;
}

// Pipeline P of PLAN as V chunks a rank, chunk boundaries BOUNDS (D V + 1 of them, in units).
Plan with_chunks(const Plan& plan, size_t p, int64_t V, const std::vector<int64_t>& bounds) {
  Plan out = plan;
  PipelinePlan& pl = out.pipelines[p];
  const std::vector<StagePlan> ranks = plan.pipelines[p].stages;
  const size_t D = ranks.size();
  pl.stages.clear();
  for (size_t c = 0; c + 1 < bounds.size(); ++c) {
    StagePlan st = ranks[c % D];
    st.set_units(bounds[c], bounds[c + 1]);
    pl.stages.push_back(st);
  }
  pl.virtual_stages = V;
  pl.schedule = pipeline::kInterleaved;
  return out;
}

}  // namespace

void consider_interleaving(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  const double before = result.cost.step_s;
  Plan best = result.plan;
  PlanCost best_cost = result.cost;
  std::vector<std::string> changed;
  // The fastest candidate under the margin, for the note that says why the plan keeps one chunk a rank.
  double closest_s = before;
  std::string closest;
  for (size_t p = 0; p < best.pipelines.size(); ++p) {
    if (!may_interleave(best, p)) continue;
    const PipelinePlan& pl = best.pipelines[p];
    const int64_t D = static_cast<int64_t>(pl.stages.size()), U = pl.stages.back().unit_end();
    Plan p_best;
    PlanCost p_cost = best_cost;
    bool found = false;
    for (int64_t V = 2; V <= kMaxVirtualStages && D * V <= U; ++V) {
      // Chunk c (rank c mod D) takes 1/V of its rank's units: boundaries at the running sum,
      // rounded, each chunk at least one unit.
      const int64_t n = D * V;
      std::vector<int64_t> bounds(static_cast<size_t>(n + 1), 0);
      double run = 0;
      for (int64_t c = 0; c < n; ++c) {
        const StagePlan& st = pl.stages[static_cast<size_t>(c % D)];
        run += static_cast<double>(st.unit_end() - st.unit_begin()) / static_cast<double>(V);
        const int64_t want = static_cast<int64_t>(std::llround(run));
        bounds[static_cast<size_t>(c + 1)] = std::clamp(want, bounds[static_cast<size_t>(c)] + 1, U - (n - c - 1));
      }
      bounds.back() = U;
      auto price = [&](const std::vector<int64_t>& b, PlanCost* out) {
        Plan cand = with_chunks(best, p, V, b);
        try {
          *out = priced_rebalanced(cand, cluster, profile, options);
        } catch (const InputError&) {
          return false;
        }
        return out->fits;
      };
      PlanCost cur;
      if (!price(bounds, &cur)) continue;
      // Each inner boundary a unit either way while the step gets shorter.
      for (bool moved = true; moved;) {
        moved = false;
        for (int64_t k = 1; k < n; ++k)
          for (int64_t step : {-1, 1}) {
            std::vector<int64_t> b = bounds;
            b[static_cast<size_t>(k)] += step;
            if (b[static_cast<size_t>(k)] <= b[static_cast<size_t>(k - 1)] || b[static_cast<size_t>(k)] >= b[static_cast<size_t>(k + 1)]) continue;
            PlanCost c;
            if (price(b, &c) && c.step_s < cur.step_s * (1 - 1e-4)) bounds = b, cur = c, moved = true;
          }
      }
      if (cur.step_s < closest_s) closest_s = cur.step_s, closest = "pipeline " + std::to_string(p) + ", " + std::to_string(V) + " chunks a rank";
      if (cur.step_s < best_cost.step_s * (1 - kInterleaveMinGain) && cur.step_s < p_cost.step_s) {
        p_best = with_chunks(best, p, V, bounds);
        priced_rebalanced(p_best, cluster, profile, options);  // the batch split the price assumed
        p_cost = cur;
        found = true;
      }
    }
    if (!found) continue;
    best = std::move(p_best);
    best_cost = p_cost;
    changed.push_back("pipeline " + std::to_string(p) + " " + std::to_string(best.pipelines[p].virtual_stages) + " chunks a rank");
  }
  std::ostringstream o;
  o.precision(4);
  if (changed.empty()) {
    if (!closest.empty()) {
      o << "interleaved virtual stages: not used; the best (" << closest << ") predicts " << closest_s * 1e3 << " ms against "
        << before * 1e3 << " ms without; kept only for a predicted gain of " << kInterleaveMinGain * 100 << "%";
      result.notes.push_back(o.str());
    }
    return;
  }
  o << "interleaved virtual stages (interleaved-1f1b): ";
  for (size_t i = 0; i < changed.size(); ++i) o << (i ? ", " : "") << changed[i];
  o << "; predicted " << best_cost.step_s * 1e3 << " ms instead of " << before * 1e3 << " ms";
  result.notes.push_back(o.str());
  adopt_plan(result, std::move(best), best_cost);
}

}  // namespace alloy::plan
