// The planner. How it stays exact where it can and fast where it cannot:
//  - Every candidate is scored by the Evaluator with the cost model's own decomposition
//    (cost_model.h): step = max over replicas of max(makespan, max_s(last backward start_s +
//    longest sync of that rank)) + world all-reduce + slowest optimizer. Only the max over
//    replicas depends on the batch split, and each replica's term depends only on its own
//    samples and micro-batch size once the layout (which fixes the holder sets) is chosen, so the
//    best batch split of a layout is a min-max allocation: exact by DP when small, greedy beyond.
//  - Pipeline timings are simulated once per (types, split, link classes, schedule, m, M) and
//    shared by every replica and candidate with the same key.
//  - Exact mode enumerates the search space of search.h with devices of one class (type, host,
//    memory) taken as interchangeable, which the cost model cannot tell apart, and prunes with
//    lower bounds that need no simulation first and simulated makespans second.
//  - Heuristic mode builds layouts from groupings that follow where the costs are: sync rings
//    want holders of a layer inside a host or region (stage-major), pipelines want fast links
//    between consecutive stages (local), a tied embedding wants first and last stages close
//    (folded), and compute wants work in proportion to speed (balanced splits, proportional
//    batches), pipeline depths coarse to fine so a short budget sees every scale. Local search
//    then moves layer boundaries while the time budget lasts.
//
// Files: search_detail.h (internals shared by the files below, not API; min-max allocation),
// search_eval.cpp (timing tables, the Evaluator), search_baselines.cpp (input checks, baselines),
// search_exact.cpp (Exact), search_heuristic.cpp (Heuristic), and this one: the shared helpers,
// the result of a search, and the public entry points of search.h.
#include "alloy/plan/search.h"

#include "alloy/pipeline/schedule.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/plan/fit_memory.h"
#include "alloy/plan/search_detail.h"

namespace alloy::plan {

namespace detail {

std::string fmt(double v, int precision) {
  std::ostringstream o;
  o.precision(precision);
  o << v;
  return o.str();
}

std::string gb(double bytes) { return fmt(bytes / 1e9) + " GB"; }

}  // namespace detail

using namespace detail;

namespace {

Plan to_plan(const Problem& P, const Layout& l) {
  Plan plan;
  plan.global_batch = P.G;
  plan.schedule = P.opt.schedules[static_cast<size_t>(l.sched)];
  plan.grad_sync = P.opt.grad_sync;
  std::vector<const Replica*> reps;
  for (const auto& r : l.reps) reps.push_back(&r);
  // Pipelines in order of their first device, so equal layouts print the same.
  std::sort(reps.begin(), reps.end(), [](const Replica* a, const Replica* b) { return a->dev.front() < b->dev.front(); });
  for (const Replica* r : reps) {
    PipelinePlan pl;
    pl.micro_batch_size = r->mbs;
    pl.num_micro_batches = r->samples / r->mbs;
    int64_t begin = 0;
    for (size_t s = 0; s < r->dev.size(); ++s) {
      const int d = r->dev[s];
      pl.stages.push_back({{d}, begin, begin + r->blocks[s], P.cluster.devices[static_cast<size_t>(d)].name});
      begin += r->blocks[s];
    }
    plan.pipelines.push_back(pl);
  }
  return plan;
}

SearchResult finish(Problem& P, const Layout& l, const std::string& strategy, Clock::time_point t0, bool exact) {
  SearchResult res;
  {
    Layout copy = l;
    res.search_step_s = P.ev.evaluate(copy, Batch::Fixed, /*stragglers=*/true);
  }
  res.strategy = strategy;
  res.plan = to_plan(P, l);
  res.plan.validate(P.profile.model, "planner");
  res.cost = simulate_plan(res.plan, P.cluster, P.profile);
  res.plan.predicted = res.cost.to_json();
  res.plan.predicted["strategy"] = strategy;
  res.candidates_evaluated = P.ev.evaluated;
  res.exact = exact;
  res.notes = P.notes;
  res.search_s = seconds_since(t0);
  return res;
}

}  // namespace

void tune_buckets(SearchResult& result, const ClusterSpec& cluster, const Profile& profile) {
  const double start = result.plan.grad_sync.bucket_mb, before = result.cost.step_s;
  Plan best = result.plan;
  PlanCost best_cost = result.cost;
  for (double mb : {16.0, 8.0, 4.0, 2.0, 1.0}) {
    if (!(mb < start)) continue;
    Plan p = result.plan;
    p.grad_sync.bucket_mb = mb;
    PlanCost c = simulate_plan(p, cluster, profile);
    if (c.fits && c.step_s < best_cost.step_s * (1 - 2e-3)) best = p, best_cost = c;  // worth a change of plan
  }
  if (best.grad_sync.bucket_mb == start) return;
  std::ostringstream o;
  o.precision(4);
  o << "gradient buckets of " << best.grad_sync.bucket_mb << " MiB instead of " << start << ": predicted " << best_cost.step_s * 1e3
    << " ms instead of " << before * 1e3 << " ms (late layers' all-reduces start during the backward)";
  result.notes.push_back(o.str());
  adopt_plan(result, std::move(best), best_cost);
}

std::vector<int64_t> SearchOptions::candidate_micro_batches() const {
  std::vector<int64_t> c = micro_batch_sizes;
  if (c.empty()) {
    if (max_micro_batch < 1)
      throw InputError("planner", "max_micro_batch must be >= 1, got " + std::to_string(max_micro_batch));
    // Powers of two and the sizes halfway between them (1, 2, 3, 4, 6, 8, 12, ...): a replica's
    // samples then come in steps of a few percent, so heterogeneous replicas can be balanced
    // (on the 3-device pool 57 / 27 / 12 samples instead of 60 / 24 / 12), while the search's
    // candidates grow by half, not to every size.
    for (int64_t m = 1; m <= max_micro_batch; m *= 2) {
      c.push_back(m);
      if (m >= 2 && m + m / 2 <= max_micro_batch) c.push_back(m + m / 2);
    }
  }
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  if (c.front() < 1) throw InputError("planner", "micro-batch sizes must be >= 1, got " + std::to_string(c.front()));
  return c;
}

double minmax_split(const std::vector<std::vector<double>>& g, int64_t total, std::vector<int64_t>* choice) {
  std::vector<const double*> rows;
  for (const auto& r : g) {
    if (static_cast<int64_t>(r.size()) < total + 1)
      throw std::invalid_argument("minmax_split: a row has " + std::to_string(r.size()) + " entries, need " + std::to_string(total + 1));
    rows.push_back(r.data());
  }
  return minmax_allocate(rows, total, choice);
}

double search_space_configurations(int n, int64_t layers) {
  // c[k] = sum over set partitions of k devices of prod a(|block|), a(j) = j! C(L-1, j-1):
  // c[k] = sum_j C(k-1, j-1) a(j) c[k-j] (the block holding the first device has j devices).
  std::vector<double> a(static_cast<size_t>(n + 1), 0), c(static_cast<size_t>(n + 1), 0);
  auto binom = [](double nn, double kk) {
    if (kk < 0 || kk > nn) return 0.0;
    double r = 1;
    for (double i = 1; i <= kk; ++i) r = r * (nn - kk + i) / i;
    return r;
  };
  double fact = 1;
  for (int j = 1; j <= n; ++j) {
    fact *= j;
    a[static_cast<size_t>(j)] = fact * binom(static_cast<double>(layers - 1), j - 1);
  }
  c[0] = 1;
  for (int k = 1; k <= n; ++k) {
    for (int j = 1; j <= k; ++j) c[static_cast<size_t>(k)] += binom(k - 1, j - 1) * a[static_cast<size_t>(j)] * c[static_cast<size_t>(k - j)];
    // Past double's range the count only grows: stop (the O(n^3) sum took 0.3 s at 512 devices,
    // twice a search).
    if (!std::isfinite(c[static_cast<size_t>(k)])) return std::numeric_limits<double>::infinity();
  }
  return c[static_cast<size_t>(n)];
}

namespace {

void check_options(const SearchOptions& o) {
  if (o.global_batch < 1) throw InputError("planner", "global_batch must be >= 1, got " + std::to_string(o.global_batch));
  if (o.schedules.empty()) throw InputError("planner", "schedules: allow at least one of " + pipeline::schedule_names_text());
  const auto& names = pipeline::schedule_names();
  for (const auto& s : o.schedules)
    if (std::find(names.begin(), names.end(), s) == names.end())
      throw InputError("planner", "schedules: unknown schedule '" + s + "' (valid: " + pipeline::schedule_names_text() + ")");
  o.grad_sync.validate("planner", "grad_sync");
  if (o.strategy != "alloy" && o.strategy != "uniform" && o.strategy != "proportional" && o.strategy != "ptafm")
    throw InputError("planner", "unknown strategy '" + o.strategy + "' (valid: alloy, uniform, proportional, ptafm)");
}

bool exact_tractable(const Problem& P) {
  if (P.N > 64) return false;
  const double configs = search_space_configurations(P.N, P.L);
  const double g = static_cast<double>(P.G + 1);
  return configs <= P.opt.exact_limit && configs * g * g <= 256.0 * P.opt.exact_limit;
}

}  // namespace

namespace {

SearchResult search_layouts(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  const auto t0 = Clock::now();
  check_options(options);
  Problem P(cluster, profile, options);
  check_inputs(P);
  if (options.strategy != "alloy") {
    double step = kInf;
    Layout l = options.strategy == "ptafm" ? ptafm_layout(P, &step) : baseline(P, options.strategy, &step);
    return finish(P, l, options.strategy, t0, false);
  }
  // Seeds: the baselines' layouts, with the batch split re-optimised.
  std::vector<Layout> seeds;
  std::string baseline_error;
  for (const std::string name : {"uniform", "proportional", "ptafm"}) {
    try {
      double step = kInf;
      seeds.push_back(name == "ptafm" ? ptafm_layout(P, &step) : baseline(P, name, &step));
    } catch (const InputError& e) {
      // A baseline that finds no plan is no seed; the search below may still find one. Its
      // message names a rank that overflows, which explains an overall failure best.
      if (baseline_error.empty()) baseline_error = e.what();
    }
  }
  auto fail = [&]() {
    throw InputError("planner", "alloy: no plan in the search space fits in memory" +
                                    (baseline_error.empty() ? std::string() : " (" + baseline_error + ")"));
  };
  P.notes.clear();
  if (exact_tractable(P)) {
    P.ev.force_dp = true;
    Exact ex(P, true, true);
    for (auto& s : seeds)
      for (int sched = 0; sched < static_cast<int>(options.schedules.size()); ++sched) {
        Layout l = s;
        l.sched = sched;
        ex.offer(l);
      }
    ex.run();
    if (!(ex.best_step < kInf)) fail();
    P.notes.push_back("exact: branch and bound over " + fmt(search_space_configurations(P.N, P.L)) +
                      " configurations per schedule; " + std::to_string(ex.leaves) + " evaluated in full, " +
                      std::to_string(P.tables.simulations()) + " pipeline simulations");
    return finish(P, ex.best, "alloy", t0, true);
  }
  Heuristic h(P, t0);
  for (auto& s : seeds)
    for (int sched = 0; sched < static_cast<int>(options.schedules.size()); ++sched) {
      Layout l = s;
      l.sched = sched;
      h.offer(l);
    }
  h.run();
  h.improve();
  if (!(h.best_step < kInf)) fail();
  const double configs = search_space_configurations(P.N, P.L);
  P.notes.push_back("heuristic: the space has " + (std::isfinite(configs) ? fmt(configs) : std::string("over 1e308")) +
                    " configurations per schedule, beyond exact_limit " + fmt(options.exact_limit) + "; " +
                    std::to_string(P.ev.evaluated) + " layouts evaluated, " + std::to_string(P.tables.simulations()) +
                    " pipeline simulations");
  return finish(P, h.best, "alloy", t0, false);
}

}  // namespace

namespace {

SearchResult search_fitting(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  bool capacities = false;
  for (const auto& d : cluster.devices) capacities = capacities || d.memory_gb > 0;
  if (options.strategy != "alloy" || !options.fit_memory || options.memory_relief || !capacities)
    return search_layouts(cluster, profile, options);
  const auto t0 = Clock::now();
  std::optional<SearchResult> plain;
  std::string plain_error, fit_error;
  try {
    plain = search_layouts(cluster, profile, options);
  } catch (const InputError& e) {
    plain_error = e.what();
  }
  std::optional<SearchResult> relieved;
  SearchOptions ro = options;
  ro.memory_relief = true;
  try {
    SearchResult r = search_layouts(cluster, profile, ro);
    FitResult f = fit_memory(r.plan, cluster, profile);
    if (f.fits) {
      r.cost = f.cost;
      r.search_step_s = f.cost.step_s;
      r.exact = false;  // optimal among layouts, not among sharding choices
      r.notes.insert(r.notes.end(), f.changes.begin(), f.changes.end());
      relieved = std::move(r);
    } else {
      fit_error = f.cost.explanation;
    }
  } catch (const InputError& e) {
    fit_error = e.what();
  }
  // Sharding and recomputation cost time and make the run harder to follow: only for a clear gain.
  if (relieved && (!plain || relieved->cost.step_s < plain->cost.step_s * (1 - 5e-3))) {
    if (plain)
      relieved->notes.push_back("memory: sharding/recomputation lets a faster layout fit: predicted " + fmt(relieved->cost.step_s) +
                                " s/step against " + fmt(plain->cost.step_s) + " s with full replicas");
    else
      relieved->notes.push_back("memory: no layout of full replicas fits (" + plain_error + "); sharding/recomputation makes this one fit");
    relieved->search_s = std::chrono::duration<double>(Clock::now() - t0).count();
    return *relieved;
  }
  if (plain) {
    plain->search_s = std::chrono::duration<double>(Clock::now() - t0).count();
    return *plain;
  }
  // Messages come as "planner: ..." (InputError's where): one prefix for the sentence.
  auto bare = [](const std::string& m) { return m.rfind("planner: ", 0) == 0 ? m.substr(9) : m; };
  throw InputError("planner", bare(plain_error) + (fit_error.empty() || bare(fit_error) == bare(plain_error)
                                                       ? std::string()
                                                       : "; with sharding and recomputation too: " + bare(fit_error)));
}

}  // namespace

SearchResult search(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  SearchResult r = search_fitting(cluster, profile, options);
  if (options.strategy != "alloy" || !pipeline::splits_backward(r.plan.schedule) || !(options.split_schedule_min_gain > 0)) return r;
  // A split backward only for a clear predicted gain over the best plan without one.
  SearchOptions whole = options;
  whole.schedules.erase(std::remove_if(whole.schedules.begin(), whole.schedules.end(), pipeline::splits_backward), whole.schedules.end());
  if (whole.schedules.empty()) return r;
  std::optional<SearchResult> w;
  try {
    w = search_fitting(cluster, profile, whole);
  } catch (const InputError&) {
    return r;  // nothing fits without it
  }
  char buf[200];
  std::snprintf(buf, sizeof buf, "%.1f ms against %.1f ms with %s", r.cost.step_s * 1e3, w->cost.step_s * 1e3, w->plan.schedule.c_str());
  if (r.cost.step_s < w->cost.step_s * (1 - options.split_schedule_min_gain)) {
    r.notes.push_back("schedule: " + r.plan.schedule + " (" + buf + ")");
    return r;
  }
  w->notes.push_back("schedule: " + r.plan.schedule + " not used, its gain is under " + fmt(options.split_schedule_min_gain * 100) + "% (" +
                     buf + ")");
  w->search_s += r.search_s;
  return *w;
}

SearchResult exhaustive(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  const auto t0 = Clock::now();
  check_options(options);
  Problem P(cluster, profile, options);
  check_inputs(P);
  const double configs = search_space_configurations(P.N, P.L);
  if (configs > options.exact_limit)
    throw InputError("planner", "exhaustive: the space has " + fmt(configs) + " configurations per schedule, more than exact_limit " +
                                    fmt(options.exact_limit));
  P.ev.force_dp = true;
  Exact ex(P, false, false);
  ex.run();
  if (!(ex.best_step < kInf)) {
    std::vector<Layout> none;
    no_fit(P, "exhaustive", none);
  }
  P.notes.push_back("exhaustive: " + std::to_string(ex.leaves) + " configurations evaluated");
  return finish(P, ex.best, "exhaustive", t0, true);
}

nlohmann::json SearchResult::to_json() const {
  return {{"strategy", strategy}, {"candidates_evaluated", candidates_evaluated}, {"search_s", search_s}, {"exact", exact},
          {"notes", notes},       {"plan", plan.to_json()},                       {"cost", cost.to_json()}};
}

}  // namespace alloy::plan
