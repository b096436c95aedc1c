// The search's schedule phase: a schedule per pipeline (plan/search.h, refine_schedules).
#include <algorithm>
#include <chrono>
#include <iomanip>
#include <cstdint>
#include <sstream>
#include <string>

#include "alloy/core/error.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/search.h"

namespace alloy::plan {

namespace {

// Whether the runtime can run a split backward on PLAN's pipeline P: no rank in a ZeRO-3 set (its
// weight passes need the layers ZeRO-3 frees after a backward).
bool may_split(const Plan& plan, size_t p) {
  for (const auto& st : plan.pipelines[p].stages) {
    for (int r : st.ranks)
      for (const auto& e : plan.sharding)
        if (e.stage == 3 && std::find(e.ranks.begin(), e.ranks.end(), r) != e.ranks.end()) return false;
  }
  return true;
}

// Whether every ZeRO-3 set of PLAN still runs one schedule (its members gather each layer in their
// own schedules, in step): a schedule change, or the batch re-split that comes with it, may break it.
bool zero3_sets_agree(const Plan& plan) {
  for (const auto& e : plan.sharding)
    if (e.stage == 3 && !plan.schedule_mismatch(e.ranks).empty()) return false;
  return true;
}

}  // namespace

void refine_schedules(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  if (options.schedules.size() < 2 || result.plan.pipelines.size() < 2) return;  // one pipeline: the search chose for it
  const double before = result.cost.step_s;
  Plan best = result.plan;
  PlanCost best_cost = result.cost;
  const auto t0 = std::chrono::steady_clock::now();
  auto out_of_time = [&]() { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > options.time_budget_s; };
  for (size_t round = 0; round < best.pipelines.size() && !out_of_time(); ++round) {
    // Candidates are priced with the batch re-split, so they are measured against the plan so far
    // re-split too: a gain must come from the schedule, not from the re-split alone.
    Plan base = best;
    PlanCost base_cost = priced_rebalanced(base, cluster, profile, options);
    if (!(base_cost.fits && base_cost.step_s < best_cost.step_s && zero3_sets_agree(base))) base_cost = best_cost;
    Plan round_best;
    PlanCost round_cost = best_cost;
    bool found = false;
    for (size_t p = 0; p < best.pipelines.size(); ++p) {
      if (best.pipelines[p].stages.size() < 2) continue;  // one stage: the schedules differ only in memory
      const bool was_split = pipeline::splits_backward(best.schedule_of(p));
      for (const std::string& name : options.schedules) {
        if (name == best.schedule_of(p)) continue;
        const bool split = pipeline::splits_backward(name);
        if (split && !may_split(best, p)) continue;
        Plan cand = best;
        cand.pipelines[p].schedule = name == cand.schedule ? std::string() : name;
        PlanCost c;
        try {
          c = priced_rebalanced(cand, cluster, profile, options);
        } catch (const InputError&) {
          continue;
        }
        if (!zero3_sets_agree(cand)) continue;
        const double need = split && !was_split ? options.split_schedule_min_gain : 2e-3;
        // Each candidate must clear its own margin against the plan so far, and beat the round's best.
        if (c.fits && c.step_s < base_cost.step_s * (1 - need) && c.step_s < round_cost.step_s)
          round_best = std::move(cand), round_cost = c, found = true;
      }
    }
    if (!found) break;
    best = std::move(round_best);
    best_cost = round_cost;
  }
  if (!(best_cost.step_s < before)) return;
  std::ostringstream o;
  o.precision(4);
  o << "schedules per pipeline: " << best.schedules_text() << ", predicted " << best_cost.step_s * 1e3 << " ms instead of "
    << before * 1e3 << " ms with " << result.plan.schedules_text();
  result.notes.push_back(o.str());
  adopt_plan(result, std::move(best), best_cost);
}

void note_eager_schedule(SearchResult& result, const ClusterSpec& cluster, const Profile& profile) {
  Plan plain = result.plan;
  int64_t most = 0;  // the most extra forwards any pipeline runs
  auto unroll = [&](std::string& schedule) {
    const int64_t extra = pipeline::eager_extra(schedule);
    if (extra < 1) return;
    schedule = "1f1b";
    most = std::max(most, extra);
  };
  unroll(plain.schedule);
  for (auto& pl : plain.pipelines) unroll(pl.schedule);
  if (most == 0) return;
  PlanCost c;
  try {
    c = simulate_plan(plain, cluster, profile);
  } catch (const InputError&) {
    return;
  }
  std::ostringstream o;
  o << std::fixed << std::setprecision(1) << "schedule: " << result.plan.schedules_text() << " ("
    << (most == 1 ? "one more micro-batch" : "up to " + std::to_string(most) + " more micro-batches")
    << " of activations on every stage but the last, hiding the messages between stages), predicted " << result.cost.step_s * 1e3
    << " ms against " << c.step_s * 1e3 << " ms for the same plan on 1f1b";
  result.notes.push_back(o.str());
}

void split_tensor_parallel_backward(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  if (!result.plan.has_tensor_parallel()) return;
  const auto it = std::find_if(options.schedules.begin(), options.schedules.end(), pipeline::splits_backward);
  if (it == options.schedules.end()) return;
  const std::string was = result.plan.schedules_text();
  // The whole plan on the split schedule (a single pipeline's only choice), then each pipeline's own.
  Plan cand = result.plan;
  cand.schedule = *it;
  for (auto& pl : cand.pipelines) pl.schedule.clear();
  bool may = true;
  for (size_t p = 0; p < cand.pipelines.size(); ++p) may = may && may_split(cand, p);
  if (may) {
    try {
      const PlanCost c = priced_rebalanced(cand, cluster, profile, options);
      if (c.fits && zero3_sets_agree(cand) && c.step_s < result.cost.step_s * (1 - options.split_schedule_min_gain)) {
        std::ostringstream o;
        o.precision(4);
        o << "schedule: " << *it << " with the tensor-parallel stages (their members' weight passes held back), predicted "
          << c.step_s * 1e3 << " ms instead of " << result.cost.step_s * 1e3 << " ms with " << was;
        result.notes.push_back(o.str());
        adopt_plan(result, std::move(cand), c);
      }
    } catch (const InputError&) {
    }
  }
  refine_schedules(result, cluster, profile, options);
}

}  // namespace alloy::plan
