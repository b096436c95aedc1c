// The search's batch-split phase: short last micro-batches (plan/search.h,
// consider_short_micro_batches).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "alloy/plan/cost_model.h"
#include "alloy/plan/search.h"
#include "alloy/plan/search_detail.h"

namespace alloy::plan {

namespace {

// One replica per device (rank d on device d, as the search numbers them), the global batch split
// in proportion to the devices' whole-model speeds at micro-batch size M; empty when a device
// cannot take a sample.
Plan all_replicas(const Plan& like, const ClusterSpec& cluster, const Profile& profile, int64_t m) {
  const CostContext ctx(cluster, profile);
  const size_t n = cluster.devices.size();
  Plan plan;
  plan.global_batch = like.global_batch;
  plan.schedule = "1f1b";  // one stage each: no schedule differs
  plan.grad_sync = like.grad_sync;
  plan.slow_links = like.slow_links;
  if (static_cast<int64_t>(n) > like.global_batch) return plan;
  std::vector<double> speed(n);
  for (size_t d = 0; d < n; ++d) speed[d] = 1.0 / ctx.full_model_s_per_sample(ctx.type_of(static_cast<int>(d)), m);
  const std::vector<int64_t> share = detail::proportional_split(like.global_batch, speed);
  for (size_t d = 0; d < n; ++d) {
    PipelinePlan pl;
    pl.set_samples(share[d], std::min(m, share[d]));
    pl.stages.push_back({{static_cast<int>(d)}, 0, profile.model.layers, cluster.devices[d].name});
    plan.pipelines.push_back(pl);
  }
  return plan;
}

}  // namespace

void consider_short_micro_batches(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  if (!options.short_micro_batches || !std::isfinite(result.cost.step_s) || result.plan.pipelines.size() > kShortSplitUpTo) return;
  const Plan& chosen = result.plan;
  Plan best = chosen;
  PlanCost best_cost = result.cost;
  std::string what;
  // The chosen layout re-split (the refinement phases may have done it already).
  {
    Plan cand = chosen;
    const PlanCost c = priced_rebalanced(cand, cluster, profile, options);
    if (c.fits && c.step_s < best_cost.step_s * (1 - 2e-3)) best = cand, best_cost = c, what = "the batch re-split";
  }
  // Every device a replica: with whole micro-batches their samples move in steps of a
  // micro-batch, so a pipeline may have won by a few percent that a short last micro-batch takes back.
  const bool has_pipeline = std::any_of(chosen.pipelines.begin(), chosen.pipelines.end(), [](const PipelinePlan& p) { return p.stages.size() > 1; });
  const bool one_rank_each = chosen.world_size() == static_cast<int>(cluster.devices.size());
  // Compared as each will run: make_plan tunes the buckets next, which gains replicas (whose
  // whole gradient waits for the backward's end) more than a pipeline. Compared before tuning, a
  // pipeline 0.9% ahead of the replicas was kept on the 3-device pool and ran 1.1% behind them
  // once both had their buckets.
  auto tuned_s = [&](const Plan& p, const PlanCost& pc) {
    SearchResult t;
    t.plan = p;
    t.cost = pc;
    tune_buckets(t, cluster, profile);
    return t.cost.step_s;
  };
  if (one_rank_each && chosen.sharding.empty() && cluster.devices.size() <= kShortSplitUpTo) {
    int64_t m = 1;
    for (const auto& pl : chosen.pipelines) m = std::max(m, pl.micro_batch_size);
    // Every device a replica in micro-batches of the pipelines' size (where a pipeline was chosen),
    // and, where the replicas' sum must cross a slow link (the devices fall into regions apart),
    // every device a replica of one micro-batch: a replica's gradient is final only after its last
    // micro-batch, so its buckets sum during that micro-batch's backward alone; in one micro-batch
    // they sum during the whole backward. Across a distant link the sum is a large part of the step
    // (examples/cluster-2region.yaml: 7.1 MiB at 0.1 Gbit/s and 40 ms). Elsewhere the sum is short
    // and such micro-batches lie far beyond the profile's sizes (its per-sample cost at 8 samples
    // stands for 50), so they are not tried.
    std::vector<std::pair<int64_t, const char*>> tries;
    if (has_pipeline) tries.push_back({m, "every device a replica"});
    std::vector<int> every(cluster.devices.size());
    for (size_t d = 0; d < every.size(); ++d) every[d] = static_cast<int>(d);
    CostContext ctx(cluster, profile);
    ctx.set_grad_sync(chosen.grad_sync);
    if (ctx.regions_of(every).size() > 1)
      tries.push_back({chosen.global_batch, "every device a replica of one micro-batch"});
    for (const auto& [size, name] : tries) {
      Plan cand = all_replicas(chosen, cluster, profile, size);
      if (cand.pipelines.empty()) continue;
      const PlanCost c = size == m ? priced_rebalanced(cand, cluster, profile, options) : simulate_plan(cand, cluster, profile);
      if (c.fits && tuned_s(cand, c) < tuned_s(best, best_cost) * (1 - kShortSplitLayoutMinGain))
        best = cand, best_cost = c, what = name;
    }
  }
  if (what.empty()) return;
  bool any_short = false;
  std::string splits;
  for (const auto& pl : best.pipelines) {
    any_short = any_short || pl.short_last();
    splits += (splits.empty() ? "" : ", ") + pl.batch_text();
  }
  std::ostringstream o;
  o.precision(4);
  o << what << (any_short ? " with short last micro-batches" : "") << " (" << splits << "): predicted " << best_cost.step_s * 1e3
    << " ms instead of " << result.cost.step_s * 1e3 << " ms";
  result.notes.push_back(o.str());
  adopt_plan(result, std::move(best), best_cost);
}

}  // namespace alloy::plan
